"""The package reads like the pipeline: no import cycles, lower rooms never import upper ones, no file past 800
lines. Imports inside functions count (a lazy import is still a dependency); those under `if TYPE_CHECKING:` do
not (they never run)."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

PACKAGE = Path(__file__).resolve().parent.parent / "npufuse"

# Rooms from the bottom up: a module may import its own room and any room listed before it. The commands of a
# room (`guard/cli.py`, ...) sit with the command line, at the top: they call the public API.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("npufuse", "npufuse.errors"),
    ("npufuse.console",),        # progress, safe text, units, one-line errors
    ("npufuse.ir",),             # graph view, weights, model I/O, onnxruntime sessions, candidate records
    ("npufuse.algebra",),        # shape and layout algebra
    ("npufuse.prepare",),        # normalisation, canonicalisation
    ("npufuse.npu_model",),      # hardware profiles, kernel catalogue, tiling
    ("npufuse.cost_model",),
    ("npufuse.patterns",),
    ("npufuse.verify",),
    ("npufuse.fusion",),         # match -> cost -> select -> rewrite, with verification
    ("npufuse.emit",),           # the forms written: ONNX functions, ATC form, fusion switch file
    ("npufuse.calibrate",),
    ("npufuse.reporting",),
    ("npufuse.guard",),
    ("npufuse.api",),
    ("npufuse.cli", "npufuse.__main__", "npufuse.guard.cli", "npufuse.calibrate.cli", "npufuse.calibrate.__main__",
     "npufuse.emit.atc.check_cli"),
)
MAX_LINES = 800


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(modules: dict[str, Path]) -> nx.DiGraph:
    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    g = nx.DiGraph()
    for mod, path in modules.items():
        g.add_node(mod)
        tree = ast.parse(path.read_text(encoding="utf-8"))
        type_only = {id(n) for s in ast.walk(tree) if isinstance(s, ast.If) and "TYPE_CHECKING" in ast.unparse(s.test)
                     for n in ast.walk(s)}
        for node in ast.walk(tree):
            if id(node) in type_only:
                continue
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
                    base = ".".join(pkg[:len(pkg) - node.level + 1] + ([base] if base else []))
                if not base.startswith("npufuse"):
                    continue
                for alias in node.names:
                    target = resolve(f"{base}.{alias.name}") if f"{base}.{alias.name}" in modules else resolve(base)
                    if target and target != mod:
                        g.add_edge(mod, target)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    target = resolve(alias.name) if alias.name.startswith("npufuse") else None
                    if target and target != mod:
                        g.add_edge(mod, target)
    return g


def _layer(mod: str) -> int:
    best, depth = None, -1
    for i, rooms in enumerate(LAYERS):
        for room in rooms:
            if (mod == room or mod.startswith(room + ".")) and len(room) > depth:
                best, depth = i, len(room)
    assert best is not None, f"{mod} is in no layer: add its room to LAYERS"
    return best


def test_no_import_cycles():
    g = _imports(_modules())
    cycles = sorted(" -> ".join(c + [c[0]]) for c in nx.simple_cycles(g))
    assert cycles == []


def test_lower_rooms_never_import_upper_ones():
    g = _imports(_modules())
    upward = sorted(f"{a} (layer {_layer(a)}) imports {b} (layer {_layer(b)})" for a, b in g.edges
                    if _layer(b) > _layer(a))
    assert upward == []


def test_the_check_sees_an_upward_import(tmp_path):
    """The walk is not vacuous: the edges it finds include known ones, and a made-up upward one is caught."""
    g = _imports(_modules())
    assert g.has_edge("npufuse.prepare.normalize", "npufuse.prepare.canonicalize")
    assert g.has_edge("npufuse.fusion.engine", "npufuse.verify.segments")
    assert _layer("npufuse.ir.graph") < _layer("npufuse.verify.segments")
    g.add_edge("npufuse.ir.graph", "npufuse.fusion.engine")
    assert any(_layer(b) > _layer(a) for a, b in g.edges)


def test_no_source_file_past_800_lines():
    long = sorted(f"{p.relative_to(PACKAGE.parent)}: {n}" for p in PACKAGE.rglob("*.py")
                  if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES)
    assert long == []
