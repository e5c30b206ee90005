"""Argument types the commands share."""

from __future__ import annotations

import argparse


def at_least(minimum: int):
    """An argparse type: a whole number >= `minimum`."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is below {minimum}")
        return value
    return parse
