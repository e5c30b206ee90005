"""Device catalog: datasheet figures per canonical accelerator type, read from ``catalog.toml``."""

from __future__ import annotations

import functools
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from types import MappingProxyType

from accelmesh.errors import InvalidArgument, NotFound
from accelmesh.hardware.capabilities import CAPABILITIES
from accelmesh.hardware.model import PRECISIONS, DeviceSpec, Performance, device_id

CATALOG_PLATFORMS = ("cuda", "rocm", "tpu")

# A numeric-format capability must come with a rate for it and vice versa, so a data-entry
# slip (a bf16 flag without a bf16 figure) fails at load time rather than in a planner.
_RATED_CAPABILITIES = ("fp64", "tf32", "bf16", "fp16", "fp8", "int8")

_TEXT = ((str,), "a string")
_NUMBER = ((int, float), "a number")
_LIST = ((list,), "a list")
_FIELDS: dict[str, tuple[tuple[type, ...], str]] = {
    "kind": _TEXT,
    "platform": _TEXT,
    "compute_capability": _TEXT,
    "peak_tflops": ((dict,), "a table"),
    "memory_bytes": ((int,), "a whole number of bytes"),
    "memory_bandwidth_gbps": _NUMBER,
    "interconnect": _TEXT,
    "interconnect_bandwidth_gbps": _NUMBER,
    "capabilities": _LIST,
    "aliases": _LIST,
    "source": _TEXT,
}


@dataclass(frozen=True)
class CatalogEntry:
    """Datasheet description of one device type (one JAX device: a die, chip or GCD)."""

    type: str
    kind: str
    platform: str
    compute_capability: str
    peak_tflops: Mapping[str, float]
    memory_bytes: int
    memory_bandwidth_gbps: float
    interconnect: str
    interconnect_bandwidth_gbps: float
    capabilities: frozenset[str]
    aliases: tuple[str, ...]
    source: str

    def device_spec(self, node_ip: str, local_index: int, *, emulated_on: str = "") -> DeviceSpec:
        """A device of this type; `emulated_on` names the local CPU device that stands in for it."""
        return DeviceSpec(
            id=device_id(node_ip, self.platform, local_index),
            node_ip=node_ip,
            local_index=local_index,
            platform=self.platform,
            kind=f"{self.kind} (emulated on {emulated_on})" if emulated_on else self.kind,
            type=self.type,
            capabilities=self.capabilities,
            compute_capability=self.compute_capability,
            performance=self.performance(),
            emulated=bool(emulated_on),
            execution_device=emulated_on,
        )

    def performance(self) -> Performance:
        return Performance(
            peak_tflops=dict(self.peak_tflops),
            memory_bytes=self.memory_bytes,
            memory_bandwidth_gbps=self.memory_bandwidth_gbps,
            interconnect=self.interconnect,
            interconnect_bandwidth_gbps=self.interconnect_bandwidth_gbps,
        )


def load_catalog(path: str | Path | None = None) -> dict[str, CatalogEntry]:
    """Read and validate a catalog; ``None`` means the one packaged with accelmesh."""
    if path is None:
        return dict(_packaged_catalog())
    return _load(Path(path).read_bytes(), str(path))


def resolve_type(name: str, catalog: Mapping[str, CatalogEntry] | None = None) -> CatalogEntry:
    """The entry called ``name``: a canonical type or an alias, in any letter case."""
    entries = _packaged_catalog() if catalog is None else catalog
    wanted = name.strip().lower()
    for entry in entries.values():
        if wanted == entry.type or wanted in (alias.lower() for alias in entry.aliases):
            return entry
    raise NotFound(
        f"device type {name!r} is not in the catalog; known types: {', '.join(sorted(entries))}"
    )


def find_by_kind(kind: str, catalog: Mapping[str, CatalogEntry]) -> CatalogEntry | None:
    """The entry whose vendor name is ``kind`` (as NVML or JAX report it), if any."""
    wanted = " ".join(kind.split()).lower()
    for entry in catalog.values():
        if " ".join(entry.kind.split()).lower() == wanted:
            return entry
    return None


@functools.cache
def _packaged_catalog() -> Mapping[str, CatalogEntry]:
    resource = resources.files("accelmesh.hardware") / "catalog.toml"
    return MappingProxyType(_load(resource.read_bytes(), "accelmesh/hardware/catalog.toml"))


def _load(data: bytes, origin: str) -> dict[str, CatalogEntry]:
    try:
        document = tomllib.loads(data.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise InvalidArgument(f"catalog {origin}: not valid TOML: {error}") from error
    catalog = {name: _entry(name, table, origin) for name, table in document.items()}
    _check_aliases(catalog, origin)
    return catalog


def _entry(name: str, table: object, origin: str) -> CatalogEntry:
    def fail(field: str, problem: str) -> InvalidArgument:
        return InvalidArgument(f"catalog {origin}: entry {name!r} field {field!r}: {problem}")

    if not isinstance(table, dict):
        raise fail("(table)", "must be a table like [a100-80gb] followed by its fields")
    if name != name.lower():
        raise fail("(name)", "type names are lower case; put other spellings in aliases")
    unknown_fields = sorted(table.keys() - _FIELDS.keys())
    if unknown_fields:
        raise fail(unknown_fields[0], f"unknown field; known fields: {', '.join(_FIELDS)}")
    for field, (types, wanted) in _FIELDS.items():
        if field not in table:
            raise fail(field, f"missing; it must be {wanted}")
        value = table[field]
        if not isinstance(value, types) or isinstance(value, bool):
            raise fail(field, f"is {value!r}, it must be {wanted}")

    if table["platform"] not in CATALOG_PLATFORMS:
        raise fail("platform", f"{table['platform']!r} is not one of {', '.join(CATALOG_PLATFORMS)}")
    for field in ("memory_bytes", "memory_bandwidth_gbps"):
        if table[field] <= 0:
            raise fail(field, f"must be positive, got {table[field]!r}")
    if table["interconnect_bandwidth_gbps"] < 0:
        raise fail("interconnect_bandwidth_gbps", "must not be negative")

    rates = table["peak_tflops"]
    for precision, rate in rates.items():
        if precision not in PRECISIONS:
            raise fail("peak_tflops", f"unknown precision {precision!r}; use {', '.join(PRECISIONS)}")
        if not isinstance(rate, (int, float)) or isinstance(rate, bool) or rate <= 0:
            raise fail("peak_tflops", f"{precision} must be a positive number, got {rate!r}")
    if not rates:
        raise fail("peak_tflops", "lists no precision")

    capabilities = frozenset(table["capabilities"])
    unknown = sorted(capabilities - CAPABILITIES.keys())
    if unknown:
        raise fail("capabilities", f"unknown {unknown}; add them to accelmesh/hardware/capabilities.py")
    for flag in _RATED_CAPABILITIES:
        if (flag in capabilities) != (flag in rates):
            raise fail("capabilities", f"{flag!r} must be listed exactly when peak_tflops has {flag}")
    if not all(isinstance(alias, str) and alias.strip() for alias in table["aliases"]):
        raise fail("aliases", "must be non-empty strings")

    return CatalogEntry(
        type=name,
        kind=table["kind"],
        platform=table["platform"],
        compute_capability=table["compute_capability"],
        peak_tflops=MappingProxyType({p: float(r) for p, r in rates.items()}),
        memory_bytes=table["memory_bytes"],
        memory_bandwidth_gbps=float(table["memory_bandwidth_gbps"]),
        interconnect=table["interconnect"],
        interconnect_bandwidth_gbps=float(table["interconnect_bandwidth_gbps"]),
        capabilities=capabilities,
        aliases=tuple(table["aliases"]),
        source=table["source"],
    )


def _check_aliases(catalog: dict[str, CatalogEntry], origin: str) -> None:
    # An alias may restate its own type in another case ("T4" for t4) but must not name another.
    owner: dict[str, str] = {name: name for name in catalog}
    for entry in catalog.values():
        for alias in entry.aliases:
            key = alias.lower()
            if owner.setdefault(key, entry.type) != entry.type:
                raise InvalidArgument(
                    f"catalog {origin}: entry {entry.type!r} field 'aliases': {alias!r} "
                    f"already names {owner[key]!r}"
                )

