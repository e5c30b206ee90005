"""`python -m dispatch_svc`: run the dispatch service."""

import sys

from accelmesh.runtime.server import run_service
from dispatch_svc.config import parse_args


def build(config):
    from dispatch_svc.server import build_dispatch  # after logging is configured: building imports the heavy parts

    return build_dispatch(config)[0]


if __name__ == "__main__":
    sys.exit(run_service("dispatch", parse_args, build))
