"""Kernel briefs (`npufuse report MODEL --kernel-briefs DIR`): one folder per kernel opportunity, what a kernel
author needs to start writing and testing the kernel.

    DIR/01-fusedmatmul-bias-gelu-layernorm-float32/
        brief.json       the fused op (schema, attributes the model uses, dtypes, the shapes of every region), the
                         tile the cost model chose and what bounds it, modeled unfused/fused times and GM bytes
                         (the report's own numbers), why no shipped kernel covers it
        README.md        the same, to read, with the NumPy reference kernel's source
        check.py         feeds the test vectors back to the reference kernel: `python check.py` (npufuse installed)
        vectors/region_0/inputs/00_<name>.npy ...     the fused node's inputs: the model's real activations on
        vectors/region_0/outputs/00_<name>.npy ...    seeded inputs (and its weights); the outputs are the reference
                                                      kernel's on them, bit for bit
        vectors/region_0/model_outputs/00_<name>.npy  what the unfused model computed there (the reference's
                                                      distance to it is in brief.json)

Vectors are written for the first region of each kernel (the others differ in names and, where listed, shapes),
unless they would pass 256 MiB. The folder is written next to DIR and renamed into place, so a failed run leaves
nothing half written.
"""

from __future__ import annotations

import inspect
import json
import re
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from npufuse.errors import InputError
from npufuse.fusion.engine import OptimizeResult
from npufuse.ir.graph import Graph, attributes
from npufuse.patterns import fused_op_defs
from npufuse.prepare.normalize import normalize
from npufuse.verify.inputs import model_inputs
from npufuse.verify.whole import capture

VECTOR_BUDGET_BYTES = 256 << 20
DOC = "docs/kernels.md"


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:60]


def _definition(domain: str, op_type: str) -> dict[str, Any]:
    d = fused_op_defs()[(domain, op_type)]
    return {"domain": d.domain, "op_type": d.op_type, "doc": d.doc, "inputs": list(d.inputs),
            "outputs": list(d.outputs), "attributes": list(d.attributes)}


def check_output_dir(out: str | Path) -> Path:
    """DIR must not exist, or be an empty folder; its parent must exist."""
    p = Path(out)
    if p.exists() and (not p.is_dir() or any(p.iterdir())):
        raise InputError(f"{p}: --kernel-briefs needs a new or empty folder; choose another path")
    if not p.parent.is_dir():
        raise InputError(f"{p}: its folder {p.parent} does not exist; create it or choose another path")
    return p


def write_kernel_briefs(out: str | Path, doc: Mapping[str, Any], result: OptimizeResult, original: onnx.ModelProto,
                        base_dir: str | None = None, seed: int = 0, dims: Mapping[str, int] | None = None
                        ) -> list[Path]:
    """Write a brief per opportunity of the report document `doc` (the report of `result`, an optimize run of
    `original`) into the folder `out`; the folders written. Test vectors come from `original`, normalised as the
    run saw it, on seeded inputs (`seed`, `dims`)."""
    out = check_output_dir(out)
    kernels = (doc.get("opportunities") or {}).get("kernels") or []
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        before = None
        feeds: dict[str, np.ndarray] = {}
        if kernels:
            model, types = normalize(original, base_dir)
            before = Graph(model, base_dir, types)
            feeds = model_inputs(before, seed, dims)
        made = [_brief(tmp / f"{i:02d}-{_slug(o['signature'])}", o, result, before, feeds, doc)
                for i, o in enumerate(kernels, 1)]
        if out.exists():
            out.rmdir()
        tmp.replace(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return [out / p.name for p in made]


def _brief(folder: Path, opp: Mapping[str, Any], result: OptimizeResult, before: Graph,
           feeds: Mapping[str, np.ndarray], doc: Mapping[str, Any]) -> Path:
    folder.mkdir(parents=True)
    regions = []
    definition = None
    for k, r in enumerate(opp["regions"]):
        rec = result.records[r["candidate"]]
        node = rec.replacement.nodes[0] if rec.replacement is not None else None
        entry = {"candidate": r["candidate"], "nodes": r["nodes"], "values": r.get("values"),
                 "modeled": {key: r[key] for key in ("t_unfused_us", "t_fused_us", "gain_us", "gm_bytes_saved",
                                                     "launches_saved", "tile", "bound_by")}}
        if node is not None:
            entry["fused_node"] = {"inputs": list(node.input), "outputs": list(node.output), "attributes": attributes(node)}
            definition = definition or _definition(node.domain, node.op_type)
        if k == 0 and node is not None:
            entry["vectors"] = _vectors(folder / "vectors" / "region_0", rec, node, before, feeds)
        regions.append(entry)
    brief = {"signature": opp["signature"], "kind": opp["kind"], "dtype": opp["dtype"],
             "why_no_kernel": opp["unsupported"], "model": doc.get("model"), "target": doc["target"]["name"],
             "fused_op": definition, "regions": regions, "count": opp["count"], "gain_us": opp["gain_us"],
             "gain_pct_of_model": opp.get("gain_pct_of_model")}
    (folder / "brief.json").write_text(json.dumps(brief, indent=1, default=str) + "\n", encoding="utf-8")
    (folder / "README.md").write_text(_readme(brief), encoding="utf-8")
    (folder / "check.py").write_text(_CHECK, encoding="utf-8")
    return folder


def _vectors(folder: Path, rec: Any, node: onnx.NodeProto, before: Graph, feeds: Mapping[str, np.ndarray]
             ) -> dict[str, Any]:
    """The fused node's inputs on the model's real activations, the reference kernel's outputs on them, and what
    the unfused model computed there."""
    made = {t.name: onnx.numpy_helper.to_array(t) for t in rec.replacement.initializers}
    names = [v for v in node.input if v]
    sizes = 0
    for v in names + [o for o in node.output if o]:
        shape = before.shape(v)
        if shape is not None and all(isinstance(d, int) for d in shape):
            sizes += int(np.prod(shape, dtype=np.int64)) * 4
    if sizes > VECTOR_BUDGET_BYTES:
        return {"written": False, "why": f"the region's tensors take about {sizes >> 20} MiB, over the "
                                         f"{VECTOR_BUDGET_BYTES >> 20} MiB budget of a brief"}
    values: dict[str, np.ndarray] = {}
    runtime = []
    for v in names:
        if v in made:
            values[v] = made[v]
        elif before.is_constant(v):
            values[v] = np.asarray(before.constant(v))
        else:
            runtime.append(v)
    outs = [o for o in node.output if o]
    got = capture(before, feeds, runtime + outs)
    values.update({v: got[v] for v in runtime})
    d = fused_op_defs()[(node.domain, node.op_type)]
    inputs = [values.get(v) if v else None for v in node.input]
    expected = d.reference(inputs, attributes(node))
    for sub in ("inputs", "outputs", "model_outputs"):
        (folder / sub).mkdir(parents=True)
    for i, v in enumerate(node.input):
        if v:
            np.save(folder / "inputs" / f"{i:02d}_{_slug(v) or 'x'}.npy", values[v])
    worst = 0.0
    for i, (o, arr) in enumerate(zip(outs, expected)):
        np.save(folder / "outputs" / f"{i:02d}_{_slug(o) or 'y'}.npy", arr)
        np.save(folder / "model_outputs" / f"{i:02d}_{_slug(o) or 'y'}.npy", got[o])
        worst = max(worst, float(np.max(np.abs(arr.astype(np.float64) - got[o].astype(np.float64)))) if arr.size
                    else 0.0)
    return {"written": True, "folder": str(folder.relative_to(folder.parent.parent)),
            "input_slots": [i for i, v in enumerate(node.input) if v],
            "reference_vs_model_max_abs": worst}


def _readme(brief: Mapping[str, Any]) -> str:
    d = brief["fused_op"] or {}
    first = brief["regions"][0]
    m = first["modeled"]
    lines = [f"# Kernel brief: {brief['signature']}", "",
             f"Model `{brief['model']}` on {brief['target']}: {brief['count']} region(s) would run as this kernel; "
             f"modeled gain {brief['gain_us']:.2f} µs"
             + (f" ({brief['gain_pct_of_model']:.1f}% of the model)" if brief.get("gain_pct_of_model") else "") + ".",
             "", f"Why no shipped kernel: {brief['why_no_kernel']}", "",
             f"## The op: `{d.get('domain')}.{d.get('op_type')}`", "", d.get("doc", ""), "",
             f"- inputs: {', '.join(d.get('inputs', []))}", f"- outputs: {', '.join(d.get('outputs', []))}",
             f"- attributes (this model): `{json.dumps((first.get('fused_node') or {}).get('attributes', {}))}`",
             "", "## The regions", "", "| nodes | unfused µs | fused µs | gain µs | GM saved | tile | bound by |",
             "|---|---|---|---|---|---|---|"]
    for r in brief["regions"]:
        mm = r["modeled"]
        lines.append(f"| {r['nodes'][0]} … ({len(r['nodes'])}) | {mm['t_unfused_us']:.2f} | {mm['t_fused_us']:.2f} | "
                     f"{mm['gain_us']:.2f} | {mm['gm_bytes_saved']} B | {mm['tile']} | {mm['bound_by']} |")
    lines += ["", "Shapes of the first region (the model's own dim names where symbolic; `priced_shape`: the size "
              "the cost model priced):", "", "```json", json.dumps(first.get("values"), indent=1), "```", "",
              f"The tile the cost model chose for the first region: {m['tile']} (bound by {m['bound_by']}).", "",
              "## Test vectors", ""]
    vec = first.get("vectors") or {}
    if vec.get("written"):
        lines += [f"`{vec['folder']}`: the fused node's inputs (the model's real activations on seeded inputs, its "
                  "weights), the reference kernel's outputs on them, and what the unfused model computed there "
                  f"(max abs difference {vec['reference_vs_model_max_abs']:.3g}). `python check.py` feeds the "
                  "inputs back to the reference kernel and compares bit for bit."]
    else:
        lines.append(f"Not written: {vec.get('why', 'no fused node was kept for this region')}.")
    op = fused_op_defs().get((d.get("domain"), d.get("op_type"))) if d else None
    if op is not None:
        lines += ["", "## The NumPy reference kernel", "", "```python", inspect.getsource(op.reference).rstrip(),
                  "```", "", f"(from `{inspect.getsourcefile(op.reference)}`; see {DOC})"]
    return "\n".join(lines) + "\n"


_CHECK = '''"""Feed this brief's test vectors back to npufuse's NumPy reference kernel and compare bit for bit."""
import json
import sys
from pathlib import Path

import numpy as np

from npufuse.patterns import fused_op_defs

here = Path(__file__).parent
brief = json.loads((here / "brief.json").read_text())
region = brief["regions"][0]
if not (region.get("vectors") or {}).get("written"):
    sys.exit("no test vectors in this brief")
folder = here / region["vectors"]["folder"]
node = region["fused_node"]
op = fused_op_defs()[(brief["fused_op"]["domain"], brief["fused_op"]["op_type"])]
files = sorted((folder / "inputs").glob("*.npy"))
by_slot = {int(f.name[:2]): np.load(f) for f in files}
inputs = [by_slot.get(i) for i in range(len(node["inputs"]))]
got = op.reference(inputs, node["attributes"])
want = [np.load(f) for f in sorted((folder / "outputs").glob("*.npy"))]
same = len(got) == len(want) and all(g.dtype == w.dtype and g.shape == w.shape and np.array_equal(g, w)
                                     for g, w in zip(got, want))
print("bit for bit" if same else "DIFFERENT")
sys.exit(0 if same else 1)
'''
