"""A running job's devices watched for loss: every `interval_s` (Limits.device_watch_s) the inventory is asked which of
them it holds lost, and each one it names leaves the job at once.

The inventory calls a node lost once it missed its polls (inventory_svc: `--lost-after-polls`
polls, `--poll-interval` apart); a shard in flight on it would otherwise wait for its stream to
break, and a cut link with no reset breaks nothing until gRPC's keepalive gives up on it. A lost
device is taken out of the job's pool (no shard goes to it again), its stream is cancelled, and
the shards that were on it are retried on the job's other devices. An inventory that does not
answer is asked again at the next tick: the keepalive still bounds the wait then.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from accelmesh import errors
from dispatch_svc.dataplane.device_queues import DevicePool
from dispatch_svc.ports import Inventory, JobDevice, LiveJob, Workers

log = logging.getLogger(__name__)

def watch_devices(inventory: Inventory, workers: Workers, pool: DevicePool, job_id: str,
                  devices: Sequence[JobDevice], live: LiveJob, interval_s: float) -> None:
    """Start the job's watch on a thread of its own; it ends with the job (`live.done`)."""
    if interval_s > 0 and devices:
        threading.Thread(target=_watch, args=(inventory, workers, pool, job_id, [d.id for d in devices], live,
                                              interval_s), name=f"devices-{job_id}", daemon=True).start()


def _watch(inventory: Inventory, workers: Workers, pool: DevicePool, job_id: str, device_ids: list[str],
           live: LiveJob, interval_s: float) -> None:
    watched = list(device_ids)
    while watched and not live.done.wait(interval_s):
        if live.scope.cancelled.is_set():
            return
        try:
            lost = inventory.lost_devices(watched)
        except errors.AccelmeshError as exc:
            log.info("could not ask the inventory for lost devices of job %s (%s); asking again in %.1f s",
                     job_id, exc, interval_s)
            continue
        for device_id in sorted(lost):
            cause = (f"device {device_id} was lost: the inventory stopped hearing from its node, so its shards "
                     "in flight were stopped and retried on another device")
            log.warning("job %s: %s", job_id, cause)
            pool.lose(device_id, cause)  # first: a retry of its shards must not come back to it
            workers.drop_device(job_id, device_id, cause)
        watched = [d for d in watched if d not in lost]
