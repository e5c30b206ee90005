"""Dispatch configuration: its own variables, each with one meaning."""

from __future__ import annotations

import dataclasses
import re

import pytest

from accelmesh.errors import InvalidArgument
from accelmesh.security.identity import Role
from dispatch_svc.config import parse_args
from dispatch_svc.jobs.limits import LIMIT_VARIABLES, JobLimits

from conftest import CREDENTIALS

CREDENTIAL_ENV = CREDENTIALS.env(Role.DISPATCH)  # a dispatcher starts only with its credentials


def test_dispatch_reads_its_client_parameter_limit_not_the_compile_services():
    env = {**CREDENTIAL_ENV, "ACCELMESH_MAX_CLIENT_PARAMETER_BYTES": "4096"}
    assert parse_args([], env=env).max_client_parameter_bytes == 4096
    env = {**CREDENTIAL_ENV, "ACCELMESH_MAX_PARAMETER_BYTES": "4096"}
    assert parse_args([], env=env).max_client_parameter_bytes == 1024**3


def test_a_client_parameter_limit_below_the_minimum_is_refused_naming_the_variable():
    with pytest.raises(InvalidArgument, match="ACCELMESH_MAX_CLIENT_PARAMETER_BYTES=10 is below the minimum"):
        parse_args([], env={**CREDENTIAL_ENV, "ACCELMESH_MAX_CLIENT_PARAMETER_BYTES": "10"})


def test_the_stream_idle_limit_is_a_minute_unless_its_variable_says_otherwise():
    assert parse_args([], env=CREDENTIAL_ENV).stream_idle_s == 60.0
    assert parse_args([], env={**CREDENTIAL_ENV, "ACCELMESH_STREAM_IDLE_S": "2.5"}).stream_idle_s == 2.5
    with pytest.raises(InvalidArgument, match="ACCELMESH_STREAM_IDLE_S=0.0 is below the minimum"):
        parse_args([], env={**CREDENTIAL_ENV, "ACCELMESH_STREAM_IDLE_S": "0"})


def test_the_job_limits_are_read_from_their_variables():
    env = {**CREDENTIAL_ENV, "ACCELMESH_MAX_JOB_ROWS": "5000", "ACCELMESH_MAX_JOB_SHARDS": "16",
           "ACCELMESH_MAX_NAME_CHARS": "64"}
    limits = parse_args([], env=env).limits
    assert (limits.max_rows, limits.max_shards, limits.max_name_chars) == (5000, 16, 64)
    assert limits.max_bytes == JobLimits.max_bytes  # the others keep their defaults


def test_every_job_limit_has_its_own_variable():
    names = {f.name for f in dataclasses.fields(JobLimits)}
    assert names == set(LIMIT_VARIABLES) and len(set(LIMIT_VARIABLES.values())) == len(names)
    for name in names:
        value = getattr(JobLimits, name) - 1
        limits = parse_args([], env={**CREDENTIAL_ENV, JobLimits.variable(name): str(value)}).limits
        assert getattr(limits, name) == value


@pytest.mark.parametrize("variable, value, words", [
    ("ACCELMESH_MAX_JOB_ROWS", "0", "ACCELMESH_MAX_JOB_ROWS=0 is below the minimum 1"),
    ("ACCELMESH_MAX_NAME_CHARS", "8", "ACCELMESH_MAX_NAME_CHARS=8 is below the minimum 32"),
    ("ACCELMESH_MAX_JOB_BYTES", "lots", "ACCELMESH_MAX_JOB_BYTES='lots' is not an integer"),
    ("ACCELMESH_MAX_MODEL_LAYERS", "5000", "ACCELMESH_MAX_MODEL_LAYERS=5000 is above"),
])
def test_a_bad_job_limit_is_refused_naming_its_variable(variable, value, words):
    with pytest.raises(InvalidArgument, match=re.escape(words)):
        parse_args([], env={**CREDENTIAL_ENV, variable: value})
