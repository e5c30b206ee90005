"""`python -m inventory_svc`: run the inventory service."""

import sys

from accelmesh.runtime.server import run_service
from inventory_svc.config import parse_args


def build(config):
    from inventory_svc.server import build_inventory  # after logging is configured: building imports the heavy parts

    return build_inventory(config)[0]


if __name__ == "__main__":
    sys.exit(run_service("inventory", parse_args, build))
