"""Dispatch configuration: its own variables, each with one meaning."""

from __future__ import annotations

import pytest

from accelmesh.errors import InvalidArgument
from accelmesh.security.identity import Role
from conftest import CREDENTIALS
from dispatch_svc.config import parse_args

CREDENTIAL_ENV = CREDENTIALS.env(Role.DISPATCH)  # a dispatcher starts only with its credentials


def test_dispatch_reads_its_client_parameter_limit_not_the_compile_services():
    env = {**CREDENTIAL_ENV, "ACCELMESH_MAX_CLIENT_PARAMETER_BYTES": "4096"}
    assert parse_args([], env=env).max_client_parameter_bytes == 4096
    env = {**CREDENTIAL_ENV, "ACCELMESH_MAX_PARAMETER_BYTES": "4096"}
    assert parse_args([], env=env).max_client_parameter_bytes == 1024**3


def test_a_client_parameter_limit_below_the_minimum_is_refused_naming_the_variable():
    with pytest.raises(InvalidArgument, match="ACCELMESH_MAX_CLIENT_PARAMETER_BYTES=10 is below the minimum"):
        parse_args([], env={**CREDENTIAL_ENV, "ACCELMESH_MAX_CLIENT_PARAMETER_BYTES": "10"})
