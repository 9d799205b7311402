"""ATC's fusion switch file (`atc --fusion_switch_file`): read one into the npufuse patterns to run, and write one
that tells ATC which of its passes npufuse already did.

Two forms, as CANN documents them:

- JSON: `{"Switch": {"GraphFusion": {"ALL": "off", "ConvBatchnormFusionPass": "on"}, "UBFusion": {...}}}`;
- lines: `PassName:off` / `PassName:on`, one a line (blank lines and `#` comments allowed here).

A name is a CANN pass listed in `fusion_switch.tsv` (beside this module, with the source of each) or an npufuse
pattern name. `ALL` (in either section, or as a line) sets every pattern; the named entries then override it, and
where two entries disagree about one pattern, `off` wins. Bad files are an InputError naming file:line.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from npufuse.errors import InputError

if TYPE_CHECKING:
    import onnx

    from npufuse.emit.atc.emitter import AtcForm
    from npufuse.fusion.engine import OptimizeResult
    from npufuse.patterns.base import Pattern

SECTIONS = ("GraphFusion", "UBFusion")
_MAX_FILE_BYTES = 1 << 20   # switch files are a few hundred bytes; a bigger one is the wrong file
DOC = "docs/fusion-switch.md"


@dataclass(frozen=True)
class CannPass:
    name: str
    section: str                  # GraphFusion or UBFusion
    patterns: tuple[str, ...]     # npufuse patterns doing the same work; () where npufuse has none
    written: str                  # done | folded | on | - (see the table's header)
    source: str


@lru_cache(maxsize=1)
def cann_passes() -> dict[str, CannPass]:
    """The table in fusion_switch.tsv, by pass name."""
    text = resources.files("npufuse.emit").joinpath("fusion_switch.tsv").read_text(encoding="utf-8")
    out = {}
    for line in text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        name, section, patterns, written, source = line.split("\t")
        out[name] = CannPass(name, section, () if patterns == "-" else tuple(patterns.split(",")), written, source)
    return out


def pattern_names() -> tuple[str, ...]:
    from npufuse.patterns import PATTERNS

    return tuple(p.name for p in PATTERNS)


@dataclass(frozen=True)
class SwitchEntry:
    name: str
    on: bool
    line: int


@dataclass(frozen=True)
class FusionSwitch:
    """A parsed switch file: the patterns it leaves on, and the entries it was made of."""

    path: str
    enabled: frozenset[str]
    entries: tuple[SwitchEntry, ...]


def read_fusion_switch(path: str | os.PathLike) -> FusionSwitch:
    """Parse a switch file in either form; InputError (one line, file:line) on anything wrong with it."""
    p = Path(path)
    if not p.is_file():
        what = "does not exist" if not p.exists() else "is not a regular file"
        raise InputError(f"{p}: --fusion-switch file {what}; pass ATC's fusion switch file (JSON or PassName:off lines)")
    try:
        if p.stat().st_size > _MAX_FILE_BYTES:
            raise InputError(f"{p}: --fusion-switch file is over 1 MiB; a fusion switch file is a few lines of "
                             "PassName:off or a small JSON object")
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise InputError(f"{p}: --fusion-switch file is not UTF-8 text; save it as UTF-8") from None
    except OSError as exc:
        raise InputError(f"{p}: cannot read the --fusion-switch file ({exc.strerror or exc})") from None
    text = text.removeprefix("\ufeff")   # an editor's byte-order mark
    entries = _parse_json(p, text) if text.lstrip().startswith("{") else _parse_lines(p, text)
    return FusionSwitch(str(p), _resolve(p, entries), tuple(entries))


def _parse_json(p: Path, text: str) -> list[SwitchEntry]:
    try:
        doc = json.loads(text, object_pairs_hook=_no_duplicates)
    except _DuplicateKey as exc:
        raise InputError(f"{p}:{_line_of(text, exc.key)}: {exc.key!r} appears twice in one object; keep one") from None
    except RecursionError:   # '[[[[...' nested past Python's stack
        raise InputError(f"{p}:1: malformed JSON (nested too deeply); expected "
                         '{"Switch": {"GraphFusion": {"PassName": "off"}, "UBFusion": {...}}}') from None
    except json.JSONDecodeError as exc:
        raise InputError(f"{p}:{exc.lineno}: malformed JSON ({exc.msg}); expected "
                         '{"Switch": {"GraphFusion": {"PassName": "off"}, "UBFusion": {...}}}') from None
    if not isinstance(doc, dict) or set(doc) != {"Switch"} or not isinstance(doc["Switch"], dict):
        raise InputError(f"{p}:1: expected one top-level key \"Switch\" holding an object, as in "
                         '{"Switch": {"GraphFusion": {"PassName": "off"}}}')
    entries = []
    for section, passes in doc["Switch"].items():
        at = _line_of(text, section)
        if section not in SECTIONS:
            raise InputError(f"{p}:{at}: unknown section {section!r} under \"Switch\"; "
                             f"expected {' or '.join(SECTIONS)}")
        if not isinstance(passes, dict):
            raise InputError(f"{p}:{at}: {section} must be an object of "
                             '"PassName": "on" | "off"')
        for name, value in passes.items():
            line = _line_of(text, name, after_line=at)   # "ALL" may be in both sections
            entries.append(SwitchEntry(name, _on_off(p, line, name, value), line))
    return entries


def _parse_lines(p: Path, text: str) -> list[SwitchEntry]:
    entries = []
    for i, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep or not name.strip():
            raise InputError(f"{p}:{i}: expected PassName:on or PassName:off, got {line!r}")
        entries.append(SwitchEntry(name.strip(), _on_off(p, i, name.strip(), value.strip()), i))
    return entries


def _on_off(p: Path, line: int, name: str, value: object) -> bool:
    # ATC's own files say "on"/"off" in lower case; the same file must also work for ATC, so nothing else is taken
    if value not in ("on", "off"):
        raise InputError(f"{p}:{line}: {name}: value {value!r} is neither \"on\" nor \"off\"")
    return value == "on"


def _resolve(p: Path, entries: list[SwitchEntry]) -> frozenset[str]:
    """The patterns left on: ALL first, then the named entries; `off` wins where two disagree."""
    known_patterns = pattern_names()
    passes = cann_passes()
    enabled = set(known_patterns)
    alls = [e for e in entries if e.name == "ALL"]
    if any(not e.on for e in alls):
        enabled.clear()
    turned_on: set[str] = set()
    turned_off: set[str] = set()
    for e in entries:
        if e.name == "ALL":
            continue
        if e.name in known_patterns:
            targets: tuple[str, ...] = (e.name,)
        elif e.name in passes:
            targets = passes[e.name].patterns
        else:
            raise InputError(
                f"{p}:{e.line}: unknown fusion pass or pattern {e.name!r}; known npufuse patterns: "
                f"{', '.join(known_patterns)}; and {len(passes)} CANN passes (ConvBatchnormFusionPass, "
                f"LayerNormFusionPass, ...), listed in {DOC}")
        (turned_on if e.on else turned_off).update(targets)
    return frozenset((enabled | turned_on) - turned_off)


def select_patterns(switch: str | os.PathLike | None, only: Sequence[str] = (),
                    disable: Sequence[str] = ()) -> list[Pattern]:
    """The patterns a run uses: the switch file's set, replaced by --only where given, less --disable."""
    from npufuse.fusion.engine import require_patterns

    chosen = require_patterns(only, disable)     # checks the names first
    if switch is None:
        return chosen
    enabled = read_fusion_switch(switch).enabled   # read even under --only: a broken file is never passed over
    return chosen if only else [p for p in chosen if p.name in enabled]


def switch_for_atc(result: OptimizeResult, patterns_run: Sequence[str], atc: AtcForm | None = None) -> dict:
    """ATC's JSON switch file for an optimized model: a CANN pass is "off" where npufuse did its work everywhere
    (it fused candidates of the pass's patterns and left none); "on" where it left work to ATC (a candidate
    skipped by cost, rolled back, refused as a near-miss), did none of it, or did not run the pattern. The UB
    fusions that turn npufuse's own FusedConv/FusedMatMul activation into one kernel are always "on".

    For the ATC form (`atc`), a fused region written back as standard ops is work left to ATC's passes too: a
    "done" pass is off only where every region of its patterns became a plugin node (or a standard op ATC maps to
    one kernel by itself); a "folded" pass (BN and Mul folded into the Conv's weights) stays off, the weights
    already hold its work."""
    from npufuse.fusion.engine import APPLIED, ROLLED_BACK, SKIPPED_COST

    done: set[str] = set()
    left: set[str] = set()
    for r in result.records:
        if r.status == APPLIED:
            done.add(r.match.pattern)
        elif r.status in (SKIPPED_COST, ROLLED_BACK):
            left.add(r.match.pattern)
    left.update(f.pattern for f in result.refusals)
    left.update(set(pattern_names()) - set(patterns_run))
    standard = _left_as_standard_ops(result, atc) if atc is not None else set()
    doc: dict[str, dict[str, str]] = {s: {} for s in SECTIONS}
    for cp in cann_passes().values():
        if cp.written == "-":
            continue   # npufuse has no counterpart: no opinion, ATC keeps its default
        ours = set(cp.patterns)
        did_all = cp.written in ("done", "folded") and ours & done and not ours & left \
            and (cp.written == "folded" or not ours & standard)
        doc[cp.section][cp.name] = "off" if did_all else "on"
    return {"Switch": doc}


def _left_as_standard_ops(result: OptimizeResult, atc: AtcForm) -> set[str]:
    """Patterns with a region the ATC form writes as standard ops ATC's passes must fuse again: an npufuse op that
    did not become a plugin node, or a standard op the pattern emits that ATC has no key for at the form's opset
    (Gelu, RMSNormalization: decomposed by the lowering)."""
    from npufuse import FUSED_DOMAIN
    from npufuse.emit.atc.keys import is_registered
    from npufuse.patterns import PATTERNS

    pattern_of = {(d.domain, d.op_type): p.name for p in PATTERNS for d in p.fused_ops}
    reached = {r.node for r in atc.regions if r.plugin}
    out = set()
    for node in result.model.graph.node:
        pattern = pattern_of.get((node.domain, node.op_type))
        if pattern is None:
            continue
        if node.domain == FUSED_DOMAIN and node.name not in reached:
            out.add(pattern)
            out.update(_absorbed_patterns(node))
        elif node.domain != FUSED_DOMAIN and not is_registered("", atc.opset, node.op_type):
            out.add(pattern)
    return out


# Steps of a FusedMatMul epilogue / a GatedMLP activation that another pattern fused first: written back as
# standard ops, they are that pattern's pass's work too (BERT's GELU inside FusedMatMul[bias,gelu]).
_STEP_PATTERNS = {"gelu": "gelu", "gelu_tanh": "gelu", "quick_gelu": "gelu", "layernorm": "layernorm",
                  "rmsnorm": "rmsnorm", "Gelu": "gelu"}   # Gelu: a FusedConv's GELU epilogue


def _absorbed_patterns(node: onnx.NodeProto) -> set[str]:
    from npufuse.ir.graph import attributes

    a = attributes(node)
    steps = [*a.get("epilogue", ()), a.get("activation")]
    return {_STEP_PATTERNS[s] for s in steps if s in _STEP_PATTERNS}


def write_fusion_switch(path: str | os.PathLike, result: OptimizeResult, patterns_run: Sequence[str],
                        atc: AtcForm | None = None) -> Path:
    from npufuse.ir.modelio import atomic_write

    text = json.dumps(switch_for_atc(result, patterns_run, atc), indent=4) + "\n"
    return atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"), "the fusion switch file")


class _DuplicateKey(ValueError):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    # json.loads keeps the last of two equal keys silently; a switch file naming a pass twice is a mistake to show
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(k)
        out[k] = v
    return out


def _line_of(text: str, key: str, after_line: int = 1) -> int:
    """The line of the first `"key"` in the JSON text from line `after_line` on (for messages; json.loads keeps
    no positions)."""
    start = 0
    for _ in range(after_line - 1):
        start = text.find("\n", start) + 1
    at = text.find(json.dumps(key), start)
    return text.count("\n", 0, at) + 1 if at >= 0 else after_line
