"""The layout's one rule: services talk through protobuf contracts, so no service package imports
another and the shared `accelmesh` package imports none of them (ARCHITECTURE.md, Packages)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("inventory_svc", "compile_svc", "dispatch_svc", "worker_svc")


def imported_packages(path: Path) -> set[str]:
    """Top-level packages a module imports, at any depth (function-local imports too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def crossings(package: str, allowed: set[str]) -> list[str]:
    """`file: package` for every import of a service package outside `allowed`."""
    return [f"{path.relative_to(ROOT)}: {name}" for path in sorted((ROOT / package).rglob("*.py"))
            for name in sorted(imported_packages(path) & set(SERVICES) - allowed)]


@pytest.mark.parametrize("service", SERVICES)
def test_no_service_imports_another_service(service):
    assert crossings(service, {service}) == []


def test_the_shared_package_and_the_cli_import_no_service():
    assert crossings("accelmesh", set()) == []


def test_every_service_has_the_same_rooms():
    """The dispatcher, grown into sub-packages, keeps its proto adapter with the rest of its edge (api/)."""
    for service in SERVICES:
        rooms = {str(p.relative_to(ROOT / service)) for p in (ROOT / service).rglob("*.py")}
        servicer = "api/servicer.py" if service == "dispatch_svc" else "servicer.py"
        assert {"__main__.py", "config.py", "server.py", servicer} <= rooms, service


def test_the_check_sees_a_crossing_however_it_is_written(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("import os\nfrom compile_svc.programs import x\n\ndef f():\n    import worker_svc.probes\n"
                      "from . import sibling\n")
    assert imported_packages(module) == {"os", "compile_svc", "worker_svc"}


# Variables every service that reads them reads with one meaning: the gRPC message limit, where
# the inventory and the compile service are, and how a process proves who it is and whom it
# trusts (accelmesh/security/config.py).
SECURITY_VARIABLES = {
    "ACCELMESH_CA_FILE", "ACCELMESH_CERT_FILE", "ACCELMESH_KEY_FILE", "ACCELMESH_TOKEN_FILE", "ACCELMESH_TOKENS_FILE",
    "ACCELMESH_JWT_KEYS_FILE", "ACCELMESH_JWT_ISSUER", "ACCELMESH_JWT_AUDIENCE", "ACCELMESH_JWT_ROLE_CLAIM",
    "ACCELMESH_CREDENTIALS_DIR", "ACCELMESH_INSECURE", "ACCELMESH_HEALTH_LISTEN",
}
SHARED_VARIABLES = {"ACCELMESH_MAX_MESSAGE_BYTES", "ACCELMESH_INVENTORY", "ACCELMESH_COMPILE", *SECURITY_VARIABLES}


def test_no_two_services_read_one_variable_with_two_meanings():
    read = {service: set(re.findall(r'"(ACCELMESH_[A-Z_]+)"', (ROOT / service / "config.py").read_text()))
            for service in SERVICES}
    clashes = {(a, b): sorted(read[a] & read[b] - SHARED_VARIABLES)
               for i, a in enumerate(SERVICES) for b in SERVICES[i + 1:]}
    assert {pair: names for pair, names in clashes.items() if names} == {}


UNPICKLERS = {"pickle", "dill", "cloudpickle", "marshal", "shelve", "joblib"}


@pytest.mark.parametrize("package", ("accelmesh", *SERVICES))
def test_no_product_code_can_unpickle(package):
    """Nothing received over the network is executed or unpickled (MISSION D1)."""
    found = [f"{path.relative_to(ROOT)}: {name}" for path in sorted((ROOT / package).rglob("*.py"))
             for name in sorted(imported_packages(path) & UNPICKLERS)]
    found += [str(path.relative_to(ROOT)) for path in sorted((ROOT / package).rglob("*.py"))
              if re.search(r"allow_pickle\s*=\s*True", path.read_text())]
    assert found == []
