"""A whole-model difference that is only a selection's tie-break, told from drift.

TopK, ArgMax, ArgMin and NonMaxSuppression pick by comparing values. Where two candidates are within rounding of each
other (a detector's query scores: RT-DETR ranks 300 of 8400 near-equal logits), a rewrite that moves its input by
1e-7 may swap them, and everything after the selection (the gathered boxes and scores) comes out in another order or
holds another near-tied candidate: an elementwise comparison calls that drift, and disabling the pattern "responsible"
finds nothing, because any rounding does it.

`settle` asks the two questions that separate the cases, on the optimized model with every standalone selection
node cut out: does each selection's input match the original's within tolerance (everything before the selection
is right), and with the original's selections fed in, do the outputs match (everything after it is right)? Both
yes: the outputs differ only in which of a set of values equal within tolerance a selection picked, which no
rewrite can be blamed for. Either no: the verdict stands.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace

import numpy as np
import onnx
from onnx import helper

from npufuse.verify.compare import Verdict, compare

SELECTION_OPS = frozenset({"TopK", "ArgMax", "ArgMin", "NonMaxSuppression"})
SETTLED = "a selection's tie-break, not drift"   # how a settled comparison's detail begins


def selection_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """The main graph's standalone selection nodes (a fused region that holds one is checked by its rewrite)."""
    return [n for n in model.graph.node if _is_selection(n)]


def _is_selection(n: onnx.NodeProto) -> bool:
    return n.op_type in SELECTION_OPS and n.domain in ("", "ai.onnx")


def settle(check: Verdict, optimized: onnx.ModelProto, feeds: Mapping[str, np.ndarray],
           reference_outputs: Mapping[str, np.ndarray], original: Callable[[str], np.ndarray | None],
           run: Callable[[onnx.ModelProto, Mapping[str, np.ndarray]], Mapping[str, np.ndarray]]
           ) -> tuple[Verdict, str]:
    """(`check`, "") where there is nothing to settle, else the verdict with the selections fed in and a note.

    `original(name)`: the original model's value `name` on the same inputs (None where it had none); `run(model,
    feeds)`: the model's outputs (the selections' inputs among them)."""
    if check.ok or check.inconclusive:
        return check, ""
    nodes = selection_nodes(optimized)
    chosen = {o: original(o) for n in nodes for o in n.output if o}
    if not nodes or any(v is None for v in chosen.values()):
        return check, ""
    data_inputs = list(dict.fromkeys(n.input[0] for n in nodes))
    before = {v: original(v) for v in data_inputs}
    if any(v is None for v in before.values()):
        return check, ""
    cut = _with_selections_fed(optimized, chosen, before)
    try:
        got = run(cut, {**feeds, **chosen})
    except Exception:   # noqa: BLE001 - the cut model does not run: the plain verdict stands
        return check, ""
    inputs = [compare(v, np.asarray(got[v]), np.asarray(before[v])) for v in data_inputs]
    outputs = [compare(name, np.asarray(got[name]), np.asarray(want)) for name, want in reference_outputs.items()
               if name in got]
    if not all(c.ok for c in inputs) or len(outputs) != len(reference_outputs) or not all(c.ok for c in outputs):
        return check, ""
    where = ", ".join(f"{n.op_type} {n.name!r}" for n in nodes)
    detail = (f"{SETTLED}: each selection's input matches the original within tolerance ({where}), and with the "
              "original's selections fed in every output does")
    settled = [c if c.ok else replace(c, ok=True, detail=f"{detail}; as computed: {c.detail}")
               for c in check.comparisons]
    note = (f"output(s) {', '.join(c.name for c in check.comparisons if not c.ok)} differ from the original's only in "
            f"which near-tied values {where} picked: {detail.split(': ', 1)[1]} (docs/optimize-report.md)")
    return Verdict.of(settled), note


def _with_selections_fed(model: onnx.ModelProto, chosen: Mapping[str, np.ndarray],
                         before: Mapping[str, np.ndarray]) -> onnx.ModelProto:
    """`model` without its selection nodes: their outputs are graph inputs (fed `chosen`), their data inputs graph
    outputs."""
    cut = onnx.ModelProto()
    cut.CopyFrom(model)
    g = cut.graph
    kept = [n for n in g.node if not _is_selection(n)]
    del g.node[:]
    g.node.extend(kept)
    taken = {i.name for i in g.input}
    for name, value in chosen.items():
        if name not in taken:
            g.input.append(_info(name, value))
    outs = {o.name for o in g.output}
    for name, value in before.items():
        if name not in outs:
            g.output.append(_info(name, value))
    return cut


def _info(name: str, value: np.ndarray) -> onnx.ValueInfoProto:
    arr = np.asarray(value)
    return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(arr.dtype), list(arr.shape))
