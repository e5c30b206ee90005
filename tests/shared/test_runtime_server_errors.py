"""The server bootstrap's error mapping, through a real in-process server on port 0: what a
caller sees when the handler returns, raises a typed accelmesh error (with or without a reason
and a field), hits a bug, or aborts the call itself, and how a message quoting a huge request value is cut
so the status still reaches the caller. The scripted servicer and fixtures are in
_server_helpers.py.
"""

from __future__ import annotations

import logging
import re

import grpc
import pytest
from _server_helpers import (  # noqa: F401  (fixtures)
    ABORT_TEXT,
    BUG_TEXT,
    NODE_IP,
    ScriptedWorker,
    assert_serves,
    channel_fixture,
    describe,
    message_for,
    server_fixture,
    servicer_fixture,
    start_server,
)
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from accelmesh import errors
from accelmesh.errors import quoted
from accelmesh.runtime.channels import open_channel
from accelmesh.runtime.errors import MAX_FIELD_BYTES, MAX_MESSAGE_BYTES, bounded, error_reason, status_details


def test_ok_call_returns_the_servicer_response(channel):
    response = describe(channel, "ok")
    assert (response.node_ip, response.hostname) == (NODE_IP, "ok")


@pytest.mark.parametrize(
    ("error_name", "code"),
    [
        ("InvalidArgument", grpc.StatusCode.INVALID_ARGUMENT),
        ("NotFound", grpc.StatusCode.NOT_FOUND),
        ("FailedPrecondition", grpc.StatusCode.FAILED_PRECONDITION),
        ("ResourceExhausted", grpc.StatusCode.RESOURCE_EXHAUSTED),
        ("Unavailable", grpc.StatusCode.UNAVAILABLE),
        ("AlreadyExists", grpc.StatusCode.ALREADY_EXISTS),
        ("Unauthenticated", grpc.StatusCode.UNAUTHENTICATED),
        ("PermissionDenied", grpc.StatusCode.PERMISSION_DENIED),
        ("Cancelled", grpc.StatusCode.CANCELLED),
        ("DeadlineExceeded", grpc.StatusCode.DEADLINE_EXCEEDED),
    ],
)
def test_typed_error_maps_to_status_with_its_message(channel, error_name, code):
    with pytest.raises(grpc.RpcError) as info:
        describe(channel, error_name)
    assert info.value.code() == code
    assert info.value.details() == message_for(error_name)
    assert_serves(channel)


def details_of(error: grpc.RpcError) -> tuple[list, list]:
    """The ErrorInfo and BadRequest details a failed call carries."""
    status = rpc_status.from_call(error)
    infos, requests = [], []
    for detail in status.details:
        for message, found in ((error_details_pb2.ErrorInfo(), infos), (error_details_pb2.BadRequest(), requests)):
            if detail.Unpack(message):
                found.append(message)
    return infos, requests


def test_an_error_with_a_reason_and_a_field_carries_them_as_google_rpc_details(channel):
    with pytest.raises(grpc.RpcError) as info:
        describe(channel, "reasoned")
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    (reason,), (bad_request,) = details_of(info.value)
    assert (reason.reason, reason.domain) == (errors.TENSOR_NOT_HELD, "accelmesh")
    assert [(v.field, v.description) for v in bad_request.field_violations] == [
        ("held[x].key", message_for("reasoned"))]
    assert error_reason(info.value) == errors.TENSOR_NOT_HELD


def test_a_refusal_past_a_quota_carries_its_reason_metadata_and_a_quota_failure():
    exc = errors.ResourceExhausted("over", reason=errors.STREAM_SHARE, metadata={"limit": "4", "variable": "V"},
                                   quota=errors.QuotaViolation("principal:user:ann", "at most 4 open streams"))
    status = status_details(grpc.StatusCode.RESOURCE_EXHAUSTED, "over", exc)
    info, quota = error_details_pb2.ErrorInfo(), error_details_pb2.QuotaFailure()
    assert status.details[0].Unpack(info) and status.details[1].Unpack(quota)
    assert (info.reason, dict(info.metadata)) == (errors.STREAM_SHARE, {"limit": "4", "variable": "V"})
    assert [(v.subject, v.description) for v in quota.violations] == [("principal:user:ann", "at most 4 open streams")]


def test_an_error_without_a_reason_carries_no_error_info(channel):
    with pytest.raises(grpc.RpcError) as info:
        describe(channel, "NotFound")
    assert details_of(info.value) == ([], []) and error_reason(info.value) == ""


def test_every_error_type_has_a_row_above():
    # A new accelmesh.errors type must get a status mapping and a row in the table above.
    declared = {cls.__name__ for cls in errors.AccelmeshError.__subclasses__()}
    assert declared == set(ScriptedWorker.ERRORS)


def test_bug_becomes_internal_with_incident_id_and_no_leak(channel, caplog):
    with caplog.at_level(logging.ERROR, logger="accelmesh.runtime.errors"):
        with pytest.raises(grpc.RpcError) as info:
            describe(channel, "bug")
    assert info.value.code() == grpc.StatusCode.INTERNAL
    details = info.value.details()
    assert "incident" in details
    assert BUG_TEXT not in details
    incident = re.search(r"incident ([0-9a-f]+)", details).group(1)
    # The same id leads an operator from the caller's error to the traceback in the log.
    logged = [r for r in caplog.records if incident in r.getMessage()]
    assert len(logged) == 1
    assert logged[0].exc_info and BUG_TEXT in str(logged[0].exc_info[1])
    assert_serves(channel)


def test_explicit_abort_keeps_its_status(channel):
    with pytest.raises(grpc.RpcError) as info:
        describe(channel, "abort")
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert info.value.details() == ABORT_TEXT
    assert_serves(channel)


# --- messages that quote too much -----------------------------------------------------------------

class EchoingWorker(ScriptedWorker):
    """A careless handler: quotes the request's id in full, in its message and its field."""

    def DescribeNode(self, request, context):
        action = request.device_ids[0] if request.device_ids else "ok"
        if action.startswith("echo:"):
            raise errors.InvalidArgument(f"device_ids[0] {action} is not a device", field=f"device_ids[{action}]")
        if action.startswith("abort:"):
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{action} cannot be described")
        return super().DescribeNode(request, context)


@pytest.fixture(name="echoing")
def echoing_fixture():
    server = start_server(EchoingWorker())
    channel = open_channel(f"127.0.0.1:{server.port}")
    yield channel
    channel.close()
    server.stop(0)


# ASCII, and two-byte UTF-8 that grpc-message percent-encodes to six bytes each: the worst case.
LONG_IDS = ["x" * 100_000, "é" * 50_000]


@pytest.mark.parametrize("long_id", LONG_IDS, ids=["ascii", "utf8"])
def test_a_message_quoting_a_hundred_kilobyte_id_is_cut_and_keeps_its_status(echoing, long_id):
    with pytest.raises(grpc.RpcError) as info:
        describe(echoing, f"echo:{long_id}")
    error = info.value
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT  # not RESOURCE_EXHAUSTED "metadata size exceeds"
    assert len(error.details().encode()) <= MAX_MESSAGE_BYTES and error.details().endswith("more bytes)")
    assert error.details().startswith("device_ids[0] echo:")
    _, (bad_request,) = details_of(error)
    (violation,) = bad_request.field_violations
    assert len(violation.field.encode()) <= MAX_FIELD_BYTES and violation.description == error.details()
    assert_serves(echoing)


@pytest.mark.parametrize("long_id", LONG_IDS, ids=["ascii", "utf8"])
def test_a_handlers_own_over_long_abort_is_cut_too(echoing, long_id):
    with pytest.raises(grpc.RpcError) as info:
        describe(echoing, f"abort:{long_id}")
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert info.value.details().startswith("abort:") and info.value.details().endswith("more bytes)")
    assert len(info.value.details().encode()) <= MAX_MESSAGE_BYTES
    assert_serves(echoing)


def test_a_message_within_the_bound_is_sent_whole():
    message = "m" * MAX_MESSAGE_BYTES
    assert bounded(message) == message
    assert bounded(message + "m") == "m" * (MAX_MESSAGE_BYTES - 40) + "... (41 more bytes)"
    assert bounded("x" + "é" * 600) == "x" + "é" * 491 + "... (218 more bytes)"  # never half a character


@pytest.mark.parametrize("value, text", [
    ("abc", "'abc'"),
    ("x" * 80, repr("x" * 80)),
    ("x" * 100_000, f"'{'x' * 80}...' (100000 chars)"),
    ("'" * 81, f'"{chr(39) * 80}..." (81 chars)'),
    (b"z" * 81, f"b'{'z' * 80}...' (81 bytes)"),
    ([1, 2, 3], "[1, 2, 3]"),
    (list(range(1000)), f"{repr(list(range(80)))[:80]}... (1000 items)"),
    (["a" * 1000], f"['{'a' * 78}... (1 items)"),
    (7, "7"),
])
def test_quoted_keeps_a_short_value_whole_and_a_long_one_to_a_prefix_and_its_size(value, text):
    assert quoted(value) == text


def test_quoted_takes_its_limit():
    assert quoted("abcdef", limit=3) == "'abc...' (6 chars)"
