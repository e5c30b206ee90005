"""The queue's scheduling round (dispatch_svc/admission/scheduling/rounds.py): which device type, and how many
devices, each of several queued jobs is given, by policy, from the operator's table, measured
rates or the catalog; over the fake mesh's devices, the reserved ones left out."""

from __future__ import annotations

import pytest

from accelmesh import errors
from dispatch_svc.admission.scheduling.rounds import Narrowing, Round, Waiting, check_policy, load_throughputs
from dispatch_svc.jobs import records as m
from dispatch_svc.planner import ThroughputModel

from fakes.ports import AFFINE, FakeMesh

V100, A100 = "v100-32gb", "a100-80gb"
# "gains" runs 10x faster on an A100; "even" barely gains from one. Gavel's point: the A100 should
# go to the job that gains most, whoever came first.
TABLE = {"gains": {V100: 10.0, A100: 100.0}, "even": {V100: 90.0, A100: 100.0}}


def waiting(job_id: str, program: str, since: float, **spec_fields) -> Waiting:
    return Waiting(job_id, m.JobSpec(program=program, **spec_fields), since)


def round_over(types, policy="max_min_fairness", table=TABLE, reserved=frozenset(), throughput=None):
    mesh = FakeMesh(AFFINE, types=types)
    return Round(policy, mesh.inventory, throughput or ThroughputModel(), lambda: reserved, table), mesh


def given(order):
    """job -> the (type, count) pairs it was given, as a tuple; a job given nothing is left out."""
    return {job: n.types[0] if len(n.types) == 1 else n.types for job, n in order if n is not None}


def ids_of(mesh, *indices):
    return frozenset(mesh.devices[i].id for i in indices)


def test_max_min_fairness_gives_the_fast_type_to_the_job_that_gains_most_fifo_to_the_first():
    jobs = [waiting("first", "even", 1.0), waiting("second", "gains", 2.0)]
    fair, _ = round_over((V100, A100))
    assert given(fair.assign(jobs)) == {"first": (V100, 1), "second": (A100, 1)}
    fifo, _ = round_over((V100, A100), policy="fifo")
    assert given(fifo.assign(jobs)) == {"first": (A100, 1), "second": (V100, 1)}


def test_the_end_to_end_tests_pool_fifo_hands_the_a100_to_the_first_max_min_to_the_job_that_gains():
    """The inputs of tests/e2e/test_scheduling_e2e.py: a copy that gains nothing from an A100,
    queued before a model that runs 10x faster there; two V100s and one A100 free."""
    table = {"identity": {V100: 100.0, A100: 100.0}, "mlp_classifier": {V100: 10.0, A100: 100.0}}
    jobs = [waiting("copy", "identity", 1.0), waiting("model", "mlp_classifier", 2.0)]
    fifo, _ = round_over((V100, V100, A100), policy="fifo", table=table)
    assert given(fifo.assign(jobs)) == {"copy": (A100, 1), "model": (V100, 2)}
    fair, _ = round_over((V100, V100, A100), table=table)
    assert given(fair.assign(jobs)) == {"copy": (V100, 2), "model": (A100, 1)}
    greedy, _ = round_over((V100, V100, A100), policy="min_total_time", table=table)
    assert given(greedy.assign(jobs))["model"] == (A100, 1)


def test_spare_devices_go_to_the_jobs_given_their_type_and_unclaimed_types_to_the_first_that_can_use_them():
    jobs = [waiting("first", "even", 1.0), waiting("second", "gains", 2.0)]
    fair, mesh = round_over((V100, V100, V100, A100, A100, A100))
    order = fair.assign(jobs)
    # Each may run on either type; max-min gives both an A100 (the third spare goes to the first in
    # the policy's order), and the V100s, which no job was given, to the first that can use them.
    narrowing = dict(order)
    assert {job: n.device_type for job, n in narrowing.items()} == {"first": A100, "second": A100}
    assert sorted(n.types for n in narrowing.values()) == [((A100, 1),), ((A100, 2), (V100, 3))]
    assert narrowing["first"].device_ids | narrowing["second"].device_ids == ids_of(mesh, *range(6))
    assert not narrowing["first"].device_ids & narrowing["second"].device_ids
    assert all(n.policy == "max_min_fairness" for n in narrowing.values())


def test_reserved_devices_are_not_handed_out_and_a_job_given_nothing_is_tried_last_unnarrowed():
    mesh = FakeMesh(AFFINE, types=(V100, A100))
    busy = frozenset({mesh.devices[1].id})  # the A100
    fair, mesh = round_over((V100, A100), reserved=busy)
    jobs = [waiting("first", "even", 1.0), waiting("second", "gains", 2.0)]
    order = fair.assign(jobs)
    assert len(order) == 2 and order[0][1] is not None and order[1][1] is None
    assert order[0][1].device_ids == ids_of(mesh, 0) and order[0][1].types == ((V100, 1),)


def test_a_lone_job_a_pipeline_and_first_fit_are_never_narrowed():
    fair, _ = round_over((V100, A100))
    assert fair.assign([waiting("only", "gains", 1.0)]) == [("only", None)]
    pipeline = waiting("pipe", "gains", 2.0, placement=m.PlacementSpec(strategy="auto"))
    assert fair.assign([waiting("only", "gains", 1.0), pipeline]) == [("only", None), ("pipe", None)]
    first_fit, _ = round_over((V100, A100), policy="first_fit")
    jobs = [waiting("first", "even", 1.0), waiting("second", "gains", 2.0)]
    assert first_fit.assign(jobs) == [("first", None), ("second", None)]


def test_a_jobs_constraints_limit_the_devices_it_can_be_given():
    fair, mesh = round_over((V100, A100, A100))
    jobs = [waiting("first", "gains", 1.0, constraints=m.Constraints(filter="v100")),
            waiting("second", "gains", 2.0)]
    order = dict(fair.assign(jobs))
    assert (order["first"].types, order["first"].device_ids) == (((V100, 1),), ids_of(mesh, 0))
    assert (order["second"].types, order["second"].device_ids) == (((A100, 2),), ids_of(mesh, 1, 2))


def test_max_devices_is_the_jobs_scale_factor_all_of_one_type_or_nothing():
    jobs = [waiting("first", "gains", 1.0, constraints=m.Constraints(max_devices=2)), waiting("second", "even", 2.0)]
    fair, _ = round_over((V100, V100, A100, A100))
    first = dict(fair.assign(jobs))["first"]
    assert len(first.types) == 1 and first.types[0][1] == 2
    fair, _ = round_over((V100, A100, A100))  # no type has 3 free: it waits this round, tried last
    jobs[0] = waiting("first", "gains", 1.0, constraints=m.Constraints(max_devices=3))
    assert fair.assign(jobs)[-1] == ("first", None)


def test_measured_rates_decide_where_the_table_says_nothing():
    throughput = ThroughputModel()
    for _ in range(3):  # "measured" runs 20x faster on the V100 here than on the A100, against the catalog
        throughput.record("measured@1", f"cuda:{V100}[fp32]", 1000, 0.01, fixed_seconds=0.0, device_type=V100)
        throughput.record("measured@1", f"cuda:{A100}[bf16]", 1000, 0.2, fixed_seconds=0.0, device_type=A100)
    assert throughput.by_device_type("measured") == {V100: ("measured@1", f"cuda:{V100}[fp32]"),
                                                      A100: ("measured@1", f"cuda:{A100}[bf16]")}
    fair, _ = round_over((V100, A100), table={}, throughput=throughput)
    jobs = [waiting("first", "measured", 1.0), waiting("second", "unmeasured", 2.0)]
    assert given(fair.assign(jobs)) == {"first": (V100, 1), "second": (A100, 1)}


def test_a_narrowing_says_what_it_gave():
    narrowing = Narrowing(frozenset({"a", "b", "c"}), ((A100, 2), (V100, 1)), "max_min_fairness")
    assert narrowing.device_type == A100
    assert narrowing.describe() == "the queue's max_min_fairness policy gave it 2 a100-80gb and 1 v100-32gb device(s)"


def test_policies_and_tables_are_checked_naming_the_setting(tmp_path):
    with pytest.raises(errors.InvalidArgument, match="ACCELMESH_SCHEDULING_POLICY"):
        check_policy("round_robin")
    table = tmp_path / "rates.toml"
    table.write_text('[gains]\n"v100-32gb" = 10.0\n"a100-80gb" = 100\n')
    assert load_throughputs(table) == {"gains": {V100: 10.0, A100: 100.0}}
    table.write_text('[gains]\n"v100-32gb" = -1\n')
    with pytest.raises(errors.InvalidArgument, match=r"\[gains\] v100-32gb is -1; give the program's rows/s"):
        load_throughputs(table)
    table.write_text('gains = 3\n')
    with pytest.raises(errors.InvalidArgument, match=r"\[gains\] must be a table of device-type = rows/s"):
        load_throughputs(table)
    table.write_text('[gains\n')
    with pytest.raises(errors.InvalidArgument, match="is not TOML"):
        load_throughputs(table)
    with pytest.raises(errors.InvalidArgument, match="cannot read"):
        load_throughputs(tmp_path / "missing.toml")
