"""The suite's markers say what a test needs, so the tiers can be chosen by them: ``slow`` on every
module that starts a mesh (``make test-fast`` leaves them out), ``fixture_cpu`` on every module
whose outcome depends on the fixture CPU the workers describe (CI's second run, on a bf16 CPU,
runs only those). The rules read each module's source: a module that starts a mesh calls
``small_mesh`` (or lives in tests/e2e, which holds the scenarios over real processes); a module
reads the fixture CPU when it names it, its /proc, or a worker describing it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
MODULES = sorted(p for p in TESTS.rglob("test_*.py"))
STARTS_A_MESH = re.compile(r"\bsmall_mesh\(")
# The fixture CPU by name, its /proc, a worker made on it, or a test taking the `worker` fixture;
# in tests/e2e, a mesh whose jobs choose a bf16 rule from the CPU it describes.
READS_THE_CPU = re.compile(
    r"\b(TEST_CPU|FIXTURE_CPUS|FP32_CPU|BF16_CPU|ARM_CPU|chosen_cpu|proc_root|ACCELMESH_PROC_ROOT|make_worker)\b"
    r"|def test_\w+\([^)]*\bworker\b"
)
E2E_READS_THE_CPU = re.compile(r"\b(bf16|bfloat16|_fault_helpers)\b")


def module_marks(path: Path) -> set[str]:
    """The marks of the module's ``pytestmark``."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in node.targets):
            values = node.value.elts if isinstance(node.value, ast.List | ast.Tuple) else [node.value]
            return {v.attr for v in values if isinstance(v, ast.Attribute)}
    return set()


def marked_anywhere(path: Path, mark: str) -> bool:
    return mark in module_marks(path) or f"pytest.mark.{mark}" in path.read_text()


def reads_the_cpu(path: Path) -> bool:
    source = path.read_text()
    return bool(READS_THE_CPU.search(source) or
                (path.parent.name == "e2e" and E2E_READS_THE_CPU.search(source)))


def rel(path: Path) -> str:
    return str(path.relative_to(TESTS))


def test_a_module_that_starts_a_mesh_is_marked_slow():
    unmarked = [rel(p) for p in MODULES if STARTS_A_MESH.search(p.read_text()) and "slow" not in module_marks(p)]
    assert unmarked == [], "these start a mesh: add `pytestmark = pytest.mark.slow`"
    scenarios = [rel(p) for p in MODULES if p.parent.name == "e2e" and not marked_anywhere(p, "slow")]
    assert scenarios == [], "end-to-end scenarios: mark what starts processes slow"


def test_a_module_that_reads_the_fixture_cpu_is_marked_so():
    unmarked = [rel(p) for p in MODULES if p != Path(__file__) and reads_the_cpu(p)
                and "fixture_cpu" not in module_marks(p)]
    assert unmarked == [], ("these read the fixture CPU: add pytest.mark.fixture_cpu to their pytestmark, or CI's "
                            "run on the other fixture CPUs leaves them out")


def test_the_rules_see_what_they_look_for():
    """The patterns are not vacuous: the modules known to start meshes and read the CPU match."""
    assert STARTS_A_MESH.search((TESTS / "e2e" / "test_queue_e2e.py").read_text())
    assert reads_the_cpu(TESTS / "worker" / "test_probes.py")
    assert not reads_the_cpu(TESTS / "dispatch" / "planner" / "test_planner.py")
