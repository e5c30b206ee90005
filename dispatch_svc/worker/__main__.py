"""`python -m dispatch_svc.worker`: run a node agent."""

from __future__ import annotations

import logging
import os
import sys

from accelmesh import errors
from dispatch_svc.worker.config import parse_args, xla_flags_for


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=os.environ.get("ACCELMESH_LOG_LEVEL", "INFO"), format="%(asctime)s %(name)s %(message)s")
    try:
        config = parse_args(argv)
    except errors.AccelmeshError as exc:
        print(f"accelmesh-worker: {exc}", file=sys.stderr)
        return 2
    # XLA reads this once, at jax's first import, which happens below this line.
    os.environ["XLA_FLAGS"] = xla_flags_for(config.cpu_devices, os.environ.get("XLA_FLAGS", ""))

    from accelmesh.runtime.launcher import ready_line
    from accelmesh.runtime.server import serve_until_signal
    from dispatch_svc.worker.server import build_worker, register_with_inventory

    server = build_worker(config)
    server.start()
    if config.inventory:
        register_with_inventory(config, server.port, server.tracer_provider)
    # Ready only once registered, so whoever waits for this line finds the devices listed.
    print(ready_line("worker", config.node_ip, server.port), flush=True)
    serve_until_signal(server)
    return 0


if __name__ == "__main__":
    sys.exit(main())
