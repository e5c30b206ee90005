"""`python -m dispatch_svc`: run the dispatch service."""

from __future__ import annotations

import logging
import os
import sys

from accelmesh import errors
from accelmesh.runtime.launcher import ready_line
from accelmesh.runtime.server import serve_until_signal
from dispatch_svc.config import parse_args


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=os.environ.get("ACCELMESH_LOG_LEVEL", "INFO"), format="%(asctime)s %(name)s %(message)s")
    try:
        config = parse_args(argv)
        from dispatch_svc.server import build_dispatch

        server, _ = build_dispatch(config)
    except errors.AccelmeshError as exc:
        print(f"accelmesh-dispatch: {exc}", file=sys.stderr)
        return 2
    server.start()
    print(ready_line("dispatch", config.listen.rsplit(":", 1)[0], server.port), flush=True)
    serve_until_signal(server)
    return 0


if __name__ == "__main__":
    sys.exit(main())
