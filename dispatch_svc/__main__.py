"""`python -m dispatch_svc`: run the dispatch service."""

import sys

from accelmesh.runtime.server import run_service
from dispatch_svc.config import parse_args


def build(config):
    from dispatch_svc.server import build_dispatch  # after logging is configured: building imports the heavy parts

    return build_dispatch(config)[0]


if __name__ == "__main__":
    # One malloc arena: a relay holds less in it at no cost in speed (accelmesh/runtime/memory.py).
    sys.exit(run_service("dispatch", parse_args, build, malloc_arenas=1))
