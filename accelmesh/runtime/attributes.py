"""Every span attribute name the mesh sets, in one place (namespaced under `accelmesh.`)."""

DEVICE_ID = "accelmesh.device.id"
DEVICE_COUNT = "accelmesh.device.count"
NODE_ADDRESS = "accelmesh.node.address"
NODE_IP = "accelmesh.node.ip"
JOB_ID = "accelmesh.job.id"
POLL_REASON = "accelmesh.poll.reason"  # "interval" or "refresh"
POLL_OUTCOME = "accelmesh.poll.outcome"  # "ok" or the error
FILTER = "accelmesh.filter"
TASK_KIND = "accelmesh.task.kind"

