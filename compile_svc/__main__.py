"""`python -m compile_svc`: run the compile service."""

import sys

from accelmesh.runtime.server import run_service
from compile_svc.config import parse_args


def build(config):
    from compile_svc.server import (
        build_compile_service,  # after logging is configured: building imports the heavy parts
    )

    return build_compile_service(config)[0]


if __name__ == "__main__":
    sys.exit(run_service("compile", parse_args, build))
