"""Client-side plumbing shared by every service: the channel pool and downstream errors."""

from __future__ import annotations

import grpc
import pytest

from accelmesh import errors
from accelmesh.runtime.channels import ChannelPool
from accelmesh.runtime.errors import error_from_rpc
from accelmesh.security.identity import Role

from conftest import CREDENTIALS


def test_a_pool_shares_one_channel_per_address_until_it_is_forgotten():
    pool = ChannelPool(CREDENTIALS.service(Role.DISPATCH), Role.WORKER)
    first = pool.get("127.0.0.1:1")
    assert pool.get("127.0.0.1:1") is first and pool.get("127.0.0.1:2") is not first
    pool.forget("127.0.0.1:1")
    again = pool.get("127.0.0.1:1")
    assert again is not first
    pool.close()
    assert pool.get("127.0.0.1:1") is not again  # closed channels are not handed out


class Failed(grpc.RpcError):
    """What a stub raises: an RpcError that is also a Call with a code and details."""

    def __init__(self, code: grpc.StatusCode, details: str):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


@pytest.mark.parametrize("code, kind, message", [
    (grpc.StatusCode.INVALID_ARGUMENT, errors.InvalidArgument, "filter: bad term"),
    (grpc.StatusCode.NOT_FOUND, errors.NotFound, "filter: bad term"),
    (grpc.StatusCode.FAILED_PRECONDITION, errors.FailedPrecondition, "filter: bad term"),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, errors.ResourceExhausted, "filter: bad term"),
    (grpc.StatusCode.ALREADY_EXISTS, errors.AlreadyExists, "filter: bad term"),
    # A service refused this one's own credentials: the mesh's fault, not the caller's.
    (grpc.StatusCode.UNAUTHENTICATED, errors.Unavailable, "inventory: UNAUTHENTICATED: filter: bad term"),
    (grpc.StatusCode.PERMISSION_DENIED, errors.Unavailable, "inventory: PERMISSION_DENIED: filter: bad term"),
    (grpc.StatusCode.UNAVAILABLE, errors.Unavailable, "inventory: UNAVAILABLE: filter: bad term"),
    (grpc.StatusCode.DEADLINE_EXCEEDED, errors.Unavailable, "inventory: DEADLINE_EXCEEDED: filter: bad term"),
    (grpc.StatusCode.INTERNAL, errors.Unavailable, "inventory: INTERNAL: filter: bad term"),
])
def test_a_downstream_status_keeps_its_meaning_or_names_what_was_unavailable(code, kind, message):
    error = error_from_rpc(Failed(code, "filter: bad term"), "inventory")
    assert type(error) is kind and str(error) == message
