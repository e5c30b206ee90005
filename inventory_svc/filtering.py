"""AIP-160-style filter strings for ListDevices and ScoreDevices.

Grammar (a deliberately small subset of AIP-160)::

    filter := ""  |  term ( " AND " term )*
    term   := field op value        e.g.  platform = "cuda",  free_memory_bytes >= 1000000000
            | "capabilities:" name  e.g.  capabilities:bf16
    value  := "double quoted"  |  bare word of letters, digits and _ . : / + -

Strings compare with = and !=; numbers also with < <= > >=. ``AND`` is upper case, as in
AIP-160. Lost devices are left out unless a term names ``health``, because a scheduler
asking "what can I use" should not have to remember to exclude dead hardware.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from accelmesh.errors import InvalidArgument
from accelmesh.hardware.capabilities import CAPABILITIES, unknown_capabilities
from accelmesh.hardware.model import PLATFORMS
from inventory_svc.records import DeviceRecord

HEALTH_STATES = ("healthy", "lost")
STRING_FIELDS = ("platform", "type", "kind", "node", "health")
BOOL_FIELDS = ("emulated",)
NUMBER_FIELDS = ("free_memory_bytes",)
HAS_FIELDS = ("capabilities",)
KNOWN_FIELDS = tuple(sorted(STRING_FIELDS + BOOL_FIELDS + NUMBER_FIELDS + HAS_FIELDS))

MAX_FILTER_CHARS = 4096  # far beyond any useful conjunction; bounds parsing work per request
EXAMPLE = 'platform = "cuda" AND capabilities:bf16 AND free_memory_bytes >= 1000000000'

_TERM = re.compile(
    r"""\s*(?P<field>[A-Za-z_][A-Za-z0-9_]*)\s*
        (?: (?P<has>:)\s*(?P<name>[A-Za-z0-9_]+|"[^"]*")
          | (?P<op>!=|<=|>=|=|<|>)\s*(?P<value>"(?:[^"\\]|\\.)*"|[A-Za-z0-9_.:/+\-]+)
        )\s*""",
    re.VERBOSE,
)
_AND = re.compile(r"AND(?:\s+|$)")
_NEXT_AND = re.compile(r"\s+AND\s")


@dataclass(frozen=True)
class Term:
    """One parsed comparison; ``value`` is already typed (str, bool or float)."""

    field: str
    op: str  # "=", "!=", "<", "<=", ">", ">=", or ":" for capabilities
    value: str | bool | float


@dataclass(frozen=True)
class DeviceFilter:
    """A conjunction of terms. ``include_lost`` is True when a term names ``health``."""

    terms: tuple[Term, ...] = ()
    include_lost: bool = False

    def matches(self, record: DeviceRecord) -> bool:
        if not self.include_lost and record.health != "healthy":
            return False
        return all(_term_matches(term, record) for term in self.terms)


def parse_filter(text: str) -> DeviceFilter:
    """Parse ``text``; raise InvalidArgument naming ``filter`` and the bad term."""
    text = text or ""
    if len(text) > MAX_FILTER_CHARS:
        raise InvalidArgument(f"filter is {len(text)} characters; keep it under {MAX_FILTER_CHARS}")
    if not text.strip():
        return DeviceFilter()
    terms: list[Term] = []
    pos = 0
    while True:
        match = _TERM.match(text, pos)
        if match is None:
            raise _bad_term(text, pos, "is not of the form field op value")
        terms.append(_typed_term(match, _snippet(text, match.start(), match.end())))
        pos = match.end()
        if pos == len(text):
            break
        joiner = _AND.match(text, pos)
        if joiner is None:
            raise _bad_term(text, pos, "follows a term without 'AND' (upper case) between them")
        pos = joiner.end()
        if pos == len(text):
            raise InvalidArgument(f"filter: {text.strip()!r} ends with 'AND'; add a term after it, e.g. {EXAMPLE}")
    return DeviceFilter(tuple(terms), include_lost=any(t.field == "health" for t in terms))


def _typed_term(match: re.Match[str], snippet: str) -> Term:
    field = match["field"]
    if field not in KNOWN_FIELDS:
        raise InvalidArgument(
            f"filter: unknown field {field!r} in term {snippet!r}; known fields: {', '.join(KNOWN_FIELDS)}"
        )
    if match["has"]:
        if field not in HAS_FIELDS:
            raise InvalidArgument(
                f"filter: ':' (has) applies only to capabilities, not {field!r} in term {snippet!r}; "
                f'compare with = instead, e.g. {field} = "..."'
            )
        name = match["name"].strip('"')
        if unknown_capabilities([name]):
            raise InvalidArgument(
                f"filter: unknown capability {name!r} in term {snippet!r}; "
                f"known capabilities: {', '.join(sorted(CAPABILITIES))}"
            )
        return Term(field, ":", name)
    op, raw = match["op"], match["value"]
    if field in HAS_FIELDS:
        raise InvalidArgument(f"filter: test capabilities with ':' as in 'capabilities:bf16', not {snippet!r}")
    quoted = raw.startswith('"')
    text = re.sub(r"\\(.)", r"\1", raw[1:-1]) if quoted else raw
    if field in NUMBER_FIELDS:
        return Term(field, op, _number(field, text, snippet))
    if op not in ("=", "!="):
        raise InvalidArgument(f"filter: {field} compares only with = or !=, not {op!r} in term {snippet!r}")
    if field in BOOL_FIELDS:
        if text not in ("true", "false"):
            raise InvalidArgument(f"filter: {field} is true or false, not {text!r} in term {snippet!r}")
        return Term(field, op, text == "true")
    allowed = {"platform": PLATFORMS, "health": HEALTH_STATES}.get(field)
    if allowed is not None and text not in allowed:
        raise InvalidArgument(
            f"filter: {field} must be one of {', '.join(allowed)}, not {text!r} in term {snippet!r}"
        )
    return Term(field, op, text)


def _number(field: str, text: str, snippet: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise InvalidArgument(
            f"filter: {field} needs a finite number, not {text!r} in term {snippet!r}; e.g. {field} >= 1000000000"
        )
    return value


def _term_matches(term: Term, record: DeviceRecord) -> bool:
    spec = record.spec
    if term.op == ":":
        return term.value in spec.capabilities
    actual: str | bool | float
    if term.field == "free_memory_bytes":
        actual = float(record.free_memory_bytes)
    else:
        actual = {
            "platform": spec.platform,
            "type": spec.type,
            "kind": spec.kind,
            "node": record.node_address,
            "health": record.health,
            "emulated": spec.emulated,
        }[term.field]
    return _compare(actual, term.op, term.value)


def _compare(actual: str | bool | float, op: str, expected: str | bool | float) -> bool:
    if op == "=":
        return actual == expected
    if op == "!=":
        return actual != expected
    if op == "<":
        return actual < expected
    if op == "<=":
        return actual <= expected
    if op == ">":
        return actual > expected
    return actual >= expected


def _snippet(text: str, start: int, end: int | None = None) -> str:
    """The term around ``start``: up to ``end`` or the next ' AND ', so errors quote just it."""
    if end is None:
        following = _NEXT_AND.search(text, start)
        end = following.start() if following else len(text)
    return text[start:end].strip()


def _bad_term(text: str, pos: int, problem: str) -> InvalidArgument:
    return InvalidArgument(
        f"filter: term {_snippet(text, pos) or text!r} {problem}; "
        f"write terms as field op value joined by AND, e.g. {EXAMPLE}"
    )
