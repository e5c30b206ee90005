"""ListDevices' pages: the store's page of devices after an id, and the page tokens that carry
that id from one call to the next, bound to the filter they were issued for.

A page is read in batches (SQL narrows the rows to what the filter may accept, ``rows.pushdown``;
``DeviceFilter.matches`` stays the one definition of what it does accept) until one row more than
the page is found, which tells that another page follows.
"""

from __future__ import annotations

import base64
import hashlib
import json

from sqlalchemy.engine import Connection

from accelmesh.errors import InvalidArgument
from accelmesh.runtime.database import is_postgres
from inventory_svc.filtering import DeviceFilter
from inventory_svc.records import DeviceRecord
from inventory_svc.rows import device_record, pushdown

DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 1000


def device_page(
    conn: Connection, flt: DeviceFilter, page_size: int, after_id: str, now: float,
) -> tuple[list[DeviceRecord], str]:
    """One page ordered by id, starting after ``after_id``; the second value is the next ``after_id`` or ""."""
    if page_size < 0:
        raise InvalidArgument(f"page_size must be >= 0 (0 means {DEFAULT_PAGE_SIZE}), got {page_size}")
    page_size = min(page_size or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)
    batch = page_size + 1  # one extra row tells whether another page follows
    query, params = pushdown(flt)
    found: list[DeviceRecord] = []
    cursor = after_id or ""
    if is_postgres(conn.engine):  # one snapshot across batches, as SQLite's read transaction gives
        conn = conn.execution_options(isolation_level="REPEATABLE READ")
    while len(found) <= page_size:
        rows = conn.execute(query, {**params, "now": now, "limit": batch, "after": cursor}).all()
        for row in rows:
            record = device_record(row)
            if flt.matches(record):
                found.append(record)
                if len(found) > page_size:
                    break
        if len(rows) < batch:
            break
        cursor = rows[-1][0]
    if len(found) > page_size:
        return found[:page_size], found[page_size - 1].id
    return found, ""


def encode_page_token(after_id: str, filter_text: str) -> str:
    payload = {"after": after_id, "filter": _digest(filter_text)}
    return base64.urlsafe_b64encode(json.dumps(payload).encode()).decode()


def decode_page_token(token: str, filter_text: str) -> str:
    """The id a token names; refused when this service did not issue it, or issued it for another filter."""
    if not token:
        return ""
    try:
        payload = json.loads(base64.urlsafe_b64decode(token.encode()))
        after, digest = payload["after"], payload["filter"]
    except (ValueError, KeyError, TypeError):
        raise InvalidArgument("page_token is not a token this service issued; omit it to start over") from None
    if digest != _digest(filter_text):
        raise InvalidArgument("page_token was issued for a different filter; repeat the same filter or start over")
    if not isinstance(after, str):  # crafted: the tokens this service issues name the last id of a page
        raise InvalidArgument("page_token is not a token this service issued; omit it to start over")
    return after


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]
