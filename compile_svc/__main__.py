"""`python -m compile_svc`: run the compile service."""

from __future__ import annotations

import logging
import os
import sys

from accelmesh import errors
from accelmesh.runtime.launcher import ready_line
from accelmesh.runtime.server import serve_until_signal
from compile_svc.config import parse_args


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=os.environ.get("ACCELMESH_LOG_LEVEL", "INFO"), format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("jax").setLevel(logging.WARNING)
    try:
        config = parse_args(argv)
        from compile_svc.server import build_compile_service

        server, _ = build_compile_service(config)
    except errors.AccelmeshError as exc:
        print(f"accelmesh-compile: {exc}", file=sys.stderr)
        return 2
    server.start()
    print(ready_line("compile", config.listen.rsplit(":", 1)[0], server.port), flush=True)
    serve_until_signal(server)
    return 0


if __name__ == "__main__":
    sys.exit(main())
