"""The layout's rules: services talk through protobuf contracts, so no service package imports
another and the shared `accelmesh` package imports none of them, and inside dispatch_svc each
sub-package stays on its floor (ARCHITECTURE.md, Packages): import-linter's contracts in
pyproject.toml. Beside them, what a contract cannot say: the rooms every service has, the
variables services share, no pickle by another name, modules a reader can hold."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("inventory_svc", "compile_svc", "dispatch_svc", "worker_svc")


def test_the_import_contracts_are_kept():
    """The walls between packages are import-linter contracts in pyproject.toml (services
    independent, `accelmesh` below them, no unpickler, the layers inside dispatch_svc); `make
    lint` runs the same check."""
    result = subprocess.run([str(Path(sys.executable).with_name("lint-imports")), "--no-cache"], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout


GENERATED = re.compile(r"_pb2(_grpc)?\.pyi?$")
MAX_MODULE_LINES = 400


@pytest.mark.parametrize("package", ("accelmesh", *SERVICES))
def test_no_product_module_is_over_400_lines(package):
    """A file a reader can hold: split one that grows past this by concern (generated code aside)."""
    long = {str(path.relative_to(ROOT)): lines for path in sorted((ROOT / package).rglob("*.py"))
            if not GENERATED.search(path.name) and (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}


CITATION = re.compile(r"\brequirements\s+([A-D])(\d+)?(?:-([A-D])?(\d+))?\b")
REQUIREMENT = re.compile(r"^### ([A-D]\d+)\. ", re.M)


def test_every_cited_requirement_has_an_entry_in_docs_requirements():
    """Code and docs cite requirements by id (docs/requirements.md); a citation of an id the
    document lacks, or a range over a missing one, is a broken reference."""
    ids = set(REQUIREMENT.findall((ROOT / "docs" / "requirements.md").read_text()))
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    cited, missing = 0, []
    for name in tracked:
        path = ROOT / name
        generated = name.endswith(("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"))
        if generated or not path.is_file() or name == "docs/requirements.md":
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for match in CITATION.finditer(text):
            section, first, last_section, last = match.groups()
            cited += 1
            if first is None:
                wanted = [i for i in ids if i.startswith(section)]
                if not wanted:
                    missing.append(f"{name}: {match.group(0)}")
                continue
            last_section = last_section or section
            numbers = range(int(first), int(last or first) + 1) if last_section == section else [int(first)]
            missing += [f"{name}: {match.group(0)}" for n in numbers if f"{section}{n}" not in ids]
    assert cited > 40 and missing == []


def test_every_service_has_the_same_rooms():
    """The dispatcher, grown into sub-packages, keeps its proto adapter with the rest of its edge (api/)."""
    for service in SERVICES:
        rooms = {str(p.relative_to(ROOT / service)) for p in (ROOT / service).rglob("*.py")}
        servicer = "api/servicer.py" if service == "dispatch_svc" else "servicer.py"
        assert {"__main__.py", "config.py", "server.py", servicer} <= rooms, service


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


@pytest.mark.parametrize("package", ("accelmesh", *SERVICES))
def test_no_product_code_can_unpickle(package):
    """Nothing received over the network is executed or unpickled (requirements D1): importing an
    unpickler is a contract (pyproject.toml); numpy's own unpickling is asked for by a keyword."""
    found = [str(path.relative_to(ROOT)) for path in sorted((ROOT / package).rglob("*.py"))
             if re.search(r"allow_pickle\s*=\s*True", path.read_text())]
    assert found == []
