"""Fuzzing with credentials, small: every method of every mesh process gets 20 mutated requests
from a caller its server's access table admits, and no service answers INTERNAL or UNKNOWN, no
status is lost on the way, and every process still serves afterwards. The same code as
bench/fuzz.py (bench/fuzzing.py), which runs 1,000 a method and checks memory too."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from accelmesh.embedded import start_embedded_mesh

# bench/ is no package: its scripts import each other by path, as this test does.
sys.path.append(str(Path(__file__).resolve().parents[2] / "bench"))
import fuzzing

pytestmark = pytest.mark.slow

PER_METHOD = 20
SEED = 7


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    with start_embedded_mesh(tmp_path_factory.mktemp("mesh"), devices=2, emulate=("v100-32gb",)) as mesh:
        yield fuzzing.fuzz(mesh, PER_METHOD, seed=SEED, measure_memory=False)


def test_every_method_is_fuzzed_by_a_caller_its_server_admits(result):
    assert result["uncovered_methods"] == []
    assert result["refused_by_access"] == {}
    assert result["methods"] == len(fuzzing.methods()) >= 29
    assert result["calls"] == result["methods"] * PER_METHOD
    methods = {f"{name}.{m}": s for name, p in result["processes"].items() for m, s in p["methods"].items()}
    assert not [label for label, s in methods.items() if not s["decoded"]], "some method got no decodable request"


def test_no_service_answers_internal_or_unknown(result):
    assert result["finding_count"] == 0, json.dumps(result["findings"], indent=1)[:20_000]
    assert result["status_lost_count"] == 0, json.dumps(result["findings"], indent=1)[:20_000]


def test_every_process_serves_after_the_fuzz(result):
    assert result["healthy"], {name: (p["alive"], p["health"], p.get("output_tail"))
                               for name, p in result["processes"].items()}
