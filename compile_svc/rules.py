"""Compile rules (requirements A4): an ordered table, read from TOML, that picks BuildOptions per device.

The table is data an operator edits (deploy/rules/compile_rules.toml); this module only reads,
validates and applies it. First match wins and the last rule must match every device.

A job's precision narrows the table: a rule whose compute_dtype the precision does not allow is
passed over, so a device gets the first allowed rule that matches (an A100 asked for fp32 gets
the catch-all's fp32 build instead of cuda-bf16). fp16 rules are opt-in: only a precision that
names fp16 allows them, because fp16's narrow range is safe for inference only.
"""

from __future__ import annotations

import fnmatch
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from accelmesh.errors import FailedPrecondition, InvalidArgument, quoted
from accelmesh.hardware.capabilities import CAPABILITIES, unknown_capabilities
from accelmesh.hardware.model import PLATFORMS, DeviceSpec
from accelmesh.programs import COMPUTE_DTYPES, MATMUL_PRECISIONS, BuildOptions, TargetType

RULES_ENV = "ACCELMESH_COMPILE_RULES"
# Shipped inside the package so an installed wheel has it; deploy/rules/compile_rules.toml links here.
DEFAULT_RULES_PATH = Path(__file__).resolve().with_name("compile_rules.toml")
RULE_KEYS = ("name", "description", "match", "build")
MATCH_KEYS = ("platform", "requires", "forbids", "min_memory_bytes", "max_memory_bytes", "kind")
BUILD_KEYS = ("compute_dtype", "matmul_precision", "remat", "tolerance", "xla_options")
# Accepted per compilation but only honoured process-wide (measured, ARCHITECTURE.md), so a rule
# setting it would silently build the same code for every device.
PROCESS_WIDE_XLA_OPTIONS = ("xla_cpu_max_isa",)
# A job's precision: the least precise compute dtype its builds may use, and what each allows.
# "" (not given) is the table as written, fp16 rules excepted: the same as "bf16".
PRECISIONS = ("", "fp32", "bf16", "fp16")
ALLOWED_COMPUTE_DTYPES: Mapping[str, frozenset[str]] = MappingProxyType({
    "": frozenset({"fp32", "bf16"}),
    "fp32": frozenset({"fp32"}),
    "bf16": frozenset({"fp32", "bf16"}),
    "fp16": frozenset({"fp32", "bf16", "fp16"}),
})


@dataclass(frozen=True)
class Rule:
    """One [[rule]]: a device matches when every condition that is set holds (None/empty = not checked)."""

    name: str
    description: str
    platform: str | None
    requires: frozenset[str]
    forbids: frozenset[str]
    min_memory_bytes: int | None
    max_memory_bytes: int | None
    kind_pattern: str | None
    build: BuildOptions
    line: int  # line of the rule's [[rule]] header in its file; 0 if unknown

    @property
    def is_catch_all(self) -> bool:
        return (self.platform, self.requires, self.forbids, self.min_memory_bytes,
                self.max_memory_bytes, self.kind_pattern) == (None, frozenset(), frozenset(), None, None, None)

    def mismatches(self, device: DeviceSpec) -> list[str]:
        """Why the rule does not apply to ``device``: empty when it does."""
        memory = device.performance.memory_bytes
        reasons = []
        if self.platform is not None and device.platform != self.platform:
            reasons.append(f"platform {self.platform} wanted, device is {device.platform}")
        if missing := sorted(self.requires - device.capabilities):
            reasons.append(f"requires {', '.join(missing)}, device lacks {_them(missing)}")
        if present := sorted(self.forbids & device.capabilities):
            reasons.append(f"forbids {', '.join(present)}, device has {_them(present)}")
        if self.min_memory_bytes is not None and memory < self.min_memory_bytes:
            reasons.append(f"needs memory >= {_gb(self.min_memory_bytes)}, device has {_gb(memory)}")
        if self.max_memory_bytes is not None and memory > self.max_memory_bytes:
            reasons.append(f"needs memory <= {_gb(self.max_memory_bytes)}, device has {_gb(memory)}")
        if self.kind_pattern is not None and not fnmatch.fnmatchcase(device.kind.lower(), self.kind_pattern.lower()):
            reasons.append(f"kind {quoted(device.kind)} does not fit {self.kind_pattern!r}")
        return reasons

    def matched_because(self, device: DeviceSpec) -> str:
        memory = device.performance.memory_bytes
        parts = [f"platform is {device.platform}"] if self.platform else []
        parts += [f"has {flag}" for flag in sorted(self.requires)]
        parts += [f"lacks {flag}" for flag in sorted(self.forbids)]
        if self.min_memory_bytes is not None:
            parts.append(f"memory {_gb(memory)} >= {_gb(self.min_memory_bytes)}")
        if self.max_memory_bytes is not None:
            parts.append(f"memory {_gb(memory)} <= {_gb(self.max_memory_bytes)}")
        if self.kind_pattern is not None:
            parts.append(f"kind {quoted(device.kind)} fits {self.kind_pattern!r}")
        return "; ".join(parts) if parts else "catch-all: matches every device"


@dataclass(frozen=True)
class Verdict:
    """One rule tried for a device: whether it matched and why (ExplainRule)."""

    rule: str
    matched: bool
    reason: str


@dataclass(frozen=True)
class Explanation:
    """The rule a device gets, with the reason every earlier rule was passed over."""

    rule: Rule  # the rule the device gets
    verdicts: tuple[Verdict, ...]  # every rule tried, in order, up to and including the chosen one
    target_type: TargetType
    precision: str = ""  # the precision the rule was chosen under (one of PRECISIONS)


class PrecisionUnmet(FailedPrecondition):
    """No rule that matches a device computes in a dtype the job's precision allows."""

    def __init__(self, device: DeviceSpec, target_type: TargetType, precision: str, matched: list[Rule]):
        self.device, self.target_type, self.matched = device, target_type, tuple(matched)
        rules = ", ".join(f"{r.name} ({r.build.compute_dtype})" for r in matched)
        super().__init__(f"device {device.id} ({target_type.key}) matches only rules computing in dtypes "
                         f"{describe_precision(precision)} does not allow: {rules}", field="precision")


@dataclass(frozen=True)
class RuleTable:
    """Rules in file order (first match wins) and where they were read from."""

    rules: tuple[Rule, ...]
    origin: str

    def match(self, device: DeviceSpec, precision: str = "") -> Rule:
        return self.explain(device, precision).rule

    def explain(self, device: DeviceSpec, precision: str = "") -> Explanation:
        """The first rule that matches ``device`` and computes in a dtype ``precision`` allows;
        PrecisionUnmet when rules match but none is allowed."""
        allowed = allowed_compute_dtypes(precision)
        verdicts, passed_over = [], []
        for rule in self.rules:
            if reasons := rule.mismatches(device):
                verdicts.append(Verdict(rule.name, False, "; ".join(reasons)))
                continue
            if rule.build.compute_dtype not in allowed:
                passed_over.append(rule)
                verdicts.append(Verdict(rule.name, False, f"matches ({rule.matched_because(device)}) but computes in "
                                        f"{rule.build.compute_dtype}, which {describe_precision(precision)} does not "
                                        "allow"))
                continue
            verdicts.append(Verdict(rule.name, True, rule.matched_because(device)))
            return Explanation(rule, tuple(verdicts), self.target_type(device), precision)
        if passed_over:
            raise PrecisionUnmet(device, self.target_type(device), precision, passed_over)
        # Only reachable for a table built by hand: loading enforces a final catch-all.
        raise FailedPrecondition(f"no compile rule in {self.origin} matches device {device.id}; add a catch-all")

    def read_flags(self) -> frozenset[str]:
        """Every capability flag some rule reads: only these can split devices into target types."""
        return frozenset().union(*(rule.requires | rule.forbids for rule in self.rules))

    def target_type(self, device: DeviceSpec) -> TargetType:
        return TargetType(device.platform, device.execution_platform, device.type,
                          device.capabilities & self.read_flags())


def allowed_compute_dtypes(precision: str) -> frozenset[str]:
    if precision not in ALLOWED_COMPUTE_DTYPES:
        raise InvalidArgument(f"precision {precision!r} is not one of {', '.join(repr(p) for p in PRECISIONS)}",
                              field="precision")
    return ALLOWED_COMPUTE_DTYPES[precision]


def describe_precision(precision: str) -> str:
    return f"precision {precision}" if precision else "a job that names no precision (fp16 rules are opt-in)"


def load_rules(path: str | Path | None = None, *, env: Mapping[str, str] | None = None) -> RuleTable:
    """Read a rule file: ``path``, else $ACCELMESH_COMPILE_RULES, else the shipped table."""
    env = os.environ if env is None else env
    chosen = Path(path or env.get(RULES_ENV) or DEFAULT_RULES_PATH)
    if not chosen.is_file():
        raise FailedPrecondition(
            f"compile rule file {chosen} does not exist; set {RULES_ENV} to a rule file "
            f"(see deploy/rules/compile_rules.toml for the format)"
        )
    return loads_rules(chosen.read_text(encoding="utf-8"), str(chosen))


def loads_rules(text: str, origin: str = "<rules>") -> RuleTable:
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise InvalidArgument(f"{origin}: not valid TOML: {error}") from error
    if extra := sorted(document.keys() - {"rule"}):
        raise InvalidArgument(f"{origin}: unknown top-level key {extra[0]!r}; the file holds only [[rule]] tables")
    tables = document.get("rule", [])
    if not isinstance(tables, list) or not tables:
        raise InvalidArgument(f"{origin}: no rules; write each rule as a [[rule]] table")
    locator = _Locator(text, origin, len(tables))
    rules: list[Rule] = []
    positions: dict[str, int] = {}
    for index, table in enumerate(tables):
        rule = _parse_rule(table, index, locator)
        if (first := positions.setdefault(rule.name, index)) != index:
            raise locator.error(index, rule.name, "name", f"duplicates the name of rule[{first + 1}]")
        rules.append(rule)
    for index, rule in enumerate(rules[:-1]):
        if rule.is_catch_all:
            dead = ", ".join(r.name for r in rules[index + 1:])
            raise locator.error(index, rule.name, "match", f"is empty (a catch-all), so these rules are dead: {dead}; "
                                "move the catch-all to the end")
    if not rules[-1].is_catch_all:
        raise locator.error(len(rules) - 1, rules[-1].name, "match", "is not empty, but the last rule must be a "
                            "catch-all (no [rule.match] keys) so every device gets a rule")
    return RuleTable(tuple(rules), origin)


def _parse_rule(table: object, index: int, locator: _Locator) -> Rule:
    """One [[rule]] table checked key by key, each refusal naming the rule, the key and its line.
    Long because the table has that many keys; each check is two lines and reads in file order."""
    if not isinstance(table, dict):
        raise locator.error(index, "?", "(rule)", "must be a table; write each rule as a [[rule]] table")
    name = table.get("name")
    label = name if isinstance(name, str) else "?"

    def fail(field: str, problem: str) -> InvalidArgument:
        return locator.error(index, label, field, problem)

    def section(key: str, known: tuple[str, ...]) -> dict:
        value = table.get(key, {})
        if not isinstance(value, dict):
            raise fail(key, f"must be a table ([rule.{key}])")
        if extra := sorted(value.keys() - set(known)):
            raise fail(f"{key}.{extra[0]}", f"is not a known key; known keys: {', '.join(known)}")
        return value

    def typed(field: str, value: object, types: tuple[type, ...], wanted: str) -> None:
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise fail(field, f"is {value!r}, it must be {wanted}")

    if extra := sorted(table.keys() - set(RULE_KEYS)):
        raise fail(extra[0], f"is not a known key; known keys: {', '.join(RULE_KEYS)}")
    for key in ("name", "description"):
        if not isinstance(table.get(key), str) or not table[key].strip():
            raise fail(key, "must be a non-empty string; every rule needs a name and a description of why it exists")
    match, build = section("match", MATCH_KEYS), section("build", BUILD_KEYS)

    if (platform := match.get("platform")) is not None and platform not in PLATFORMS:
        raise fail("match.platform", f"{platform!r} is not one of {', '.join(PLATFORMS)}")
    flags: dict[str, frozenset[str]] = {}
    for key in ("requires", "forbids"):
        value = match.get(key, [])
        if not isinstance(value, list) or not all(isinstance(flag, str) for flag in value):
            raise fail(f"match.{key}", f"is {value!r}, it must be a list of capability names")
        if unknown := unknown_capabilities(value):
            raise fail(f"match.{key}",
                       f"names unknown capabilities {unknown}; known: {', '.join(sorted(CAPABILITIES))}")
        flags[key] = frozenset(value)
    if both := sorted(flags["requires"] & flags["forbids"]):
        raise fail("match.forbids", f"also requires {', '.join(both)}, so the rule can never match")
    for key in ("min_memory_bytes", "max_memory_bytes"):
        if key in match:
            typed(f"match.{key}", match[key], (int,), "a whole number of bytes")
    if match.get("min_memory_bytes", 0) > match.get("max_memory_bytes", float("inf")):
        raise fail("match.min_memory_bytes", "is larger than max_memory_bytes, so the rule can never match")
    if "kind" in match:
        typed("match.kind", match["kind"], (str,), "a pattern like '*A100*'")

    options = build.get("compute_dtype", "fp32"), build.get("matmul_precision", "default")
    for key, value, allowed in zip(("compute_dtype", "matmul_precision"), options, (COMPUTE_DTYPES, MATMUL_PRECISIONS)):
        if value not in allowed:
            raise fail(f"build.{key}", f"{value!r} is not one of {', '.join(allowed)}")
    typed("build.remat", remat := build.get("remat", False), (bool,), "true or false")
    typed("build.tolerance", tolerance := build.get("tolerance", BuildOptions.tolerance), (int, float), "a number")
    if not 0 < tolerance <= 1:
        raise fail("build.tolerance", f"is {tolerance!r}; a relative error bound must be in (0, 1]")
    xla = build.get("xla_options", {})
    typed("build.xla_options", xla, (dict,), "a table ([rule.build.xla_options])")
    for key, value in xla.items():
        field = f"build.xla_options.{key}"
        if key in PROCESS_WIDE_XLA_OPTIONS:
            raise fail(field, "only takes effect process-wide through XLA_FLAGS, not per compilation; "
                       "set it in the worker's XLA_FLAGS environment instead")
        if not key.startswith("xla_"):
            raise fail(field, "is not an XLA option; XLA option names start with 'xla_'")
        if key.startswith("xla_cpu_") and platform != "cpu":
            raise fail(field, "exists only on the CPU backend; add platform = \"cpu\" to [rule.match]")
        typed(field, value, (str, int, float, bool), "a string, number or boolean")

    return Rule(
        name=table["name"], description=table["description"], platform=platform,
        requires=flags["requires"], forbids=flags["forbids"],
        min_memory_bytes=match.get("min_memory_bytes"), max_memory_bytes=match.get("max_memory_bytes"),
        kind_pattern=match.get("kind"),
        build=BuildOptions(compute_dtype=options[0], matmul_precision=options[1], remat=remat,
                           xla_options=MappingProxyType(dict(xla)), tolerance=float(tolerance)),
        line=locator.headers[index],
    )


_HEADER = re.compile(r"^\s*(\[\[?)\s*([^\[\]]+?)\s*\]\]?\s*(#.*)?$")
_KEY = re.compile(r"^\s*([A-Za-z0-9_.\-\"' ]+?)\s*=")


class _Locator:
    """Line numbers for messages: tomllib gives none, so scan the text for headers and keys."""

    def __init__(self, text: str, origin: str, count: int):
        self.lines, self.origin = text.splitlines(), origin
        found = [n for n, line in enumerate(self.lines, 1) if (m := _HEADER.match(line)) and m[1] == "[["
                 and m[2] == "rule"]
        # Rules written as an inline array have no headers; messages then carry no line.
        self.headers = found if len(found) == count else [0] * count

    def error(self, index: int, name: str, field: str, problem: str) -> InvalidArgument:
        line = self.field_line(index, field)
        where = f"{self.origin}:{line}" if line else self.origin
        return InvalidArgument(f"{where}: rule[{index + 1}] {name!r}: {field} {problem}")

    def field_line(self, index: int, field: str) -> int:
        """Line of ``field`` (e.g. "build.compute_dtype") within rule ``index``, else its header line."""
        start = self.headers[index]
        if not start:
            return 0
        end = self.headers[index + 1] - 1 if index + 1 < len(self.headers) else len(self.lines)
        section, best, best_key = "", start, ""
        for number in range(start + 1, end + 1):
            line = self.lines[number - 1]
            if header := _HEADER.match(line):
                section = header[2].removeprefix("rule").lstrip(".")
                key = section
            elif found := _KEY.match(line):
                key = ".".join(filter(None, (section, re.sub(r"[\"'\s]", "", found[1]))))
            else:
                continue
            if key == field:
                return number
            if field.startswith(key + ".") and len(key) > len(best_key):
                best, best_key = number, key  # the innermost section or inline table holding the field
        return best


def _gb(size: int) -> str:
    return f"{size / 1e9:g} GB"


def _them(flags: list[str]) -> str:
    return "it" if len(flags) == 1 else "them"
