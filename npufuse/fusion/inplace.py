"""Concats and Splits that ATC turns into no kernel at all: GE's concat/split optimize.

GE (hicann/ge compiler/engines/nn_engine/fusion/graph_optimizer/graph_fusion/fusion_pass_manager/builtin_pass/
node_optimize/checker/concat_optimize_checker.cc and split_optimize_checker.cc) lays the inputs of a Concat along
the channel axis of 4-D NCHW tensors out back to back in one buffer, so their producers write the result in place
and the Concat launches nothing; a Split along C likewise hands out views. Its conditions, as `ConcatOptimizeChecker
::Check` states them: the concat axis is C; every input but the last has C a multiple of 16 (fp16/fp32; 32 for
int8, `IsDimCOfInputAligned`); the inputs do not all come from one node; no input is a graph input; no producer is
itself laid out that way (no-task, continuous or reference nodes); the result is not a graph output in NC1HWC0;
shapes are static. A Split needs several outputs, each with C aligned, and an input that is not a graph input.

Where a condition reads something pricing cannot see (a producer's memory attributes), the node is kept as a
kernel: views (Reshape, ...) and other in-place nodes as producers disqualify it.
"""

from __future__ import annotations

from collections.abc import Callable

import onnx

from npufuse.cost_model.recipes import VIEWS
from npufuse.ir.graph import Graph, attributes

_ALIGN = {"float16": 16, "float32": 16, "bfloat16": 16, "int8": 32, "uint8": 32}
ShapeOf = Callable[[str], "tuple[int, ...] | None"]
DtypeOf = Callable[[str], "str | None"]


def inplace_nodes(g: Graph, shape_of: ShapeOf, dtype_of: DtypeOf) -> frozenset[str]:
    """The names of the Concat / Split nodes of `g` that GE's concat/split optimize makes kernel-free, judged on
    the priced shapes (`shape_of(value)`: concrete dims) and dtypes (`dtype_of(value)`: the dtype ATC runs)."""
    found: set[str] = set()
    for n in g.nodes:
        if n.domain not in ("", "ai.onnx"):
            continue
        concat = n.op_type == "Concat" and _concat_ok(g, n, shape_of, dtype_of, found)
        if concat or (n.op_type == "Split" and _split_ok(g, n, shape_of, dtype_of)):
            found.add(n.name)
    return frozenset(found)


def _aligned(v: str, shape_of: ShapeOf, dtype_of: DtypeOf) -> bool:
    s, dt = shape_of(v), dtype_of(v)
    return s is not None and len(s) == 4 and dt in _ALIGN and s[1] % _ALIGN[dt] == 0


def _produced(g: Graph, v: str, found: set[str]) -> onnx.NodeProto | None:
    """The producer of `v` where it is a kernel GE can have write into the buffer: not a graph input or constant,
    not a view, not a node laid out in place itself."""
    p = g.producer_of(v)
    if p is None or g.is_constant(v) or p.op_type in VIEWS or p.name in found:
        return None
    return p


def _concat_ok(g: Graph, n: onnx.NodeProto, shape_of: ShapeOf, dtype_of: DtypeOf, found: set[str]) -> bool:
    ins = [v for v in n.input if v]
    if len(ins) < 2 or int(attributes(n).get("axis", 0)) not in (1, -3):
        return False
    if any(shape_of(v) is None or len(shape_of(v)) != 4 for v in ins):
        return False
    if not all(_aligned(v, shape_of, dtype_of) for v in ins[:-1]):
        return False
    producers = [_produced(g, v, found) for v in ins]
    if any(p is None for p in producers) or len({p.name for p in producers}) == 1:
        return False
    return not any(o in g.graph_outputs for o in n.output)


def _split_ok(g: Graph, n: onnx.NodeProto, shape_of: ShapeOf, dtype_of: DtypeOf) -> bool:
    outs = [o for o in n.output if o]
    if len(outs) < 2 or int(attributes(n).get("axis", 0)) not in (1, -3) or not n.input:
        return False
    if g.producer_of(n.input[0]) is None or g.is_constant(n.input[0]):
        return False
    return all(_aligned(o, shape_of, dtype_of) for o in outs)
