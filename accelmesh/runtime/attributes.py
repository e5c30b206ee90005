"""Every span attribute name the mesh sets, in one place (namespaced under `accelmesh.`)."""

DEVICE_ID = "accelmesh.device.id"
DEVICE_COUNT = "accelmesh.device.count"
NODE_ADDRESS = "accelmesh.node.address"
JOB_ID = "accelmesh.job.id"
POLL_REASON = "accelmesh.poll.reason"  # "interval", "refresh" or "takeover"
POLL_OUTCOME = "accelmesh.poll.outcome"  # "ok" or the error

JOB_KIND = "accelmesh.job.kind"
PROGRAM = "accelmesh.program"  # "<name>@<version>"
SHARD_INDEX = "accelmesh.shard.index"
SHARD_ATTEMPT = "accelmesh.shard.attempt"
SHARD_ROWS = "accelmesh.shard.rows"
SHARD_BYTES = "accelmesh.shard.bytes"  # input bytes sent to the worker
PLACEMENT_STRATEGY = "accelmesh.placement.strategy"  # a placed model's job: "ranked" or "balanced"
PIPELINE_STAGE = "accelmesh.pipeline.stage"  # a placed model's shard: the stage it runs
MICRO_BATCH = "accelmesh.pipeline.micro_batch"  # ... and the micro-batch it carries
RULE = "accelmesh.rule"
TARGET_TYPE = "accelmesh.target_type"
ARTIFACT_KEY = "accelmesh.artifact.key"
