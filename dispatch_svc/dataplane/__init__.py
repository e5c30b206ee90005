"""Moving shards to devices and back: per-device queues with retries, the worker streams, and the
tensors workers hold. It knows no job book and no queue."""
