"""Fuzzing with credentials, small: every method of every mesh process gets 20 mutated requests
from a caller its server's access table admits, and no service answers INTERNAL or UNKNOWN, no
status is lost on the way, and every process still serves afterwards. The same code as
bench/fuzz.py (bench/fuzzing.py), which runs 1,000 a method and checks memory too. The worker's
object-store methods are authorised by the ticket each call carries, not by the caller's role:
their seeds carry tickets the fuzz signs as the dispatcher (bench/fuzz_objects.py), and the valid
ones must get past the worker's ticket check, or the fuzz tests nothing beyond it."""

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
def mesh(tmp_path_factory):
    with start_embedded_mesh(tmp_path_factory.mktemp("mesh"), devices=2, emulate=("v100-32gb",)) as mesh:
        yield mesh


@pytest.fixture(scope="module")
def result(mesh):
    return fuzzing.fuzz(mesh, PER_METHOD, seed=SEED, measure_memory=False)


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


# The first seed of each: a valid call whose ticket the worker takes (a put of put/a, a fetch of
# in/x, a create of map/a, the seal of map/pending, a release of put/), in this order.
OBJECT_METHODS = ("PutObjects", "FetchObjects", "MapObjects", "SealObjects", "ReleaseObjects")


def test_the_object_store_seeds_carry_tickets_the_worker_takes(mesh, result):
    fuzzer = fuzzing.Fuzzer(mesh, seed=SEED)  # after the fuzz: its objects were reset (Fuzzer.settle)
    try:
        assert fuzzer.facts.notes == []
        by_label = {m.label: m for m in fuzzer.methods}
        answers = {}
        for name in OBJECT_METHODS:
            method = by_label[f"worker.{name}"]
            seed = fuzzer.seeds[method.label][0]
            payload = [m.SerializeToString() for m in seed] if method.client_streaming else seed.SerializeToString()
            channel = fuzzer.callers.channel("worker", fuzzing.caller_role(method.allowed))
            answers[name] = fuzzing.call_raw(channel, method, payload)
        assert {name: outcome.code for name, outcome in answers.items()} == dict.fromkeys(OBJECT_METHODS, "OK"), answers
    finally:
        fuzzer.close()
    ticketed = result["processes"]["worker"]["methods"]
    assert all(ticketed[name]["refused"] == 0 for name in OBJECT_METHODS)
