"""The op keys CANN's ONNX parser (ATC) has a plugin for: `<domain>::<opset version>::<op_type>`.

The table, `onnx_keys.tsv` next to this module, lists every key a CANN framework plugin registers
(`REGISTER_CUSTOM_OP(..).FrameworkType(ONNX).OriginOpType({...})` in hicann/ops-nn, ops-math, ops-cv and
mirror-cann/ops-transformer; repositories and commits are in the table's header). The parser looks a node up with
an exact, case-sensitive `std::map` lookup (`OpRegistry::GetOmTypeByOriOpType`, hicann/ge
`parser/parser/common/pre_checker.cc` `PreChecker::CheckTypeSupported`): there is no fallback to a lower or higher
opset, so a key is either in this table or refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

DEFAULT_DOMAIN = "ai.onnx"
_TABLE = "onnx_keys.tsv"
_COLUMNS = ("domain", "version", "op_type", "cann_op", "repo", "path")


@dataclass(frozen=True)
class Registration:
    """One registered key: the CANN op it maps to and the plugin file(s) that register it.

    A key registered by several plugins lists each in `cann_op`/`repo`/`path`, joined by " ; " (CANN keeps the
    first-loaded one: graph_metadef/register/register.cpp `OpRegistry::Register`)."""

    domain: str
    version: int
    op_type: str
    cann_op: str
    repo: str
    path: str

    @property
    def key(self) -> str:
        return make_key(self.domain, self.version, self.op_type)


def make_key(domain: str, version: int, op_type: str) -> str:
    """The key string the parser builds, `ai.onnx::17::Add`; an empty domain is written `ai.onnx`."""
    return f"{domain or DEFAULT_DOMAIN}::{version}::{op_type}"


@lru_cache(maxsize=1)
def _table() -> dict[str, Registration]:
    """Every registered key, read once from the package data."""
    text = resources.files(__package__).joinpath(_TABLE).read_text(encoding="utf-8")
    out: dict[str, Registration] = {}
    for line_no, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        fields = line.split("\t")
        if tuple(fields) == _COLUMNS:
            continue
        if len(fields) != len(_COLUMNS):  # a damaged copy must fail loudly, not drop keys silently
            raise ValueError(f"{_TABLE} line {line_no}: expected {len(_COLUMNS)} tab-separated fields, "
                             f"got {len(fields)}")
        domain, version, op_type, cann_op, repo, path = fields
        reg = Registration(domain, int(version), op_type, cann_op, repo, path)
        out[reg.key] = reg
    return out


@lru_cache(maxsize=1)
def _by_op() -> dict[str, dict[str, tuple[int, ...]]]:
    """op_type -> domain -> the versions registered, ascending."""
    acc: dict[str, dict[str, list[int]]] = {}
    for reg in _table().values():
        acc.setdefault(reg.op_type, {}).setdefault(reg.domain, []).append(reg.version)
    return {op: {d: tuple(sorted(v)) for d, v in per.items()} for op, per in acc.items()}


def lookup(key: str) -> Registration | None:
    """The registration of an exact key string (`npu::1::NPURmsNorm`), or None: the parser's own lookup."""
    return _table().get(key)


def is_registered(domain: str, version: int, op_type: str) -> bool:
    """True if a CANN plugin registers `domain::version::op_type` (domain "" means "ai.onnx")."""
    return make_key(domain, version, op_type) in _table()


def cann_op(domain: str, version: int, op_type: str) -> str | None:
    """The CANN op type a key maps to (`PartitionedCall` for plugins that expand to a subgraph), or None."""
    reg = _table().get(make_key(domain, version, op_type))
    return reg.cann_op if reg else None


def registered_versions(op_type: str, domain: str = DEFAULT_DOMAIN) -> tuple[int, ...]:
    """The opset versions at which `op_type` is registered in `domain` ("" means "ai.onnx"), ascending."""
    return _by_op().get(op_type, {}).get(domain or DEFAULT_DOMAIN, ())


def registered_domains(op_type: str) -> dict[str, tuple[int, ...]]:
    """Every domain that registers `op_type`, with its versions; empty if no plugin registers it at all."""
    return dict(_by_op().get(op_type, {}))


def format_versions(versions: tuple[int, ...]) -> str:
    """`(11, 12, 13, 19)` as `11-13, 19`: how the fixes quote version ranges."""
    parts: list[str] = []
    start = prev = None
    for v in versions:
        if prev is not None and v == prev + 1:
            prev = v
            continue
        if start is not None:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = v
    if start is not None:
        parts.append(str(start) if start == prev else f"{start}-{prev}")
    return ", ".join(parts)
