"""Whether a job may start now: the gate (quotas checked, devices reserved, or the job queued),
the durable queue's passes, the quotas, and the scheduling rounds that divide free devices."""
