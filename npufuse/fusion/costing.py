"""From graph nodes to the cost model's plain workload records, and the fuse/skip decision."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx

from npufuse.cost_model import FusionCandidate, FusionDecision, OpWork, TensorInfo, decide
from npufuse.fusion.types import Match, Replacement
from npufuse.graph import Graph, attributes, np_dtype
from npufuse.npu_model.spec import NpuSpec
from npufuse.verify.inputs import concrete_shape

# Symbolic dims when pricing: the sizes a deployment sees, not the small ones verification runs with.
# `--dim NAME=INT` overrides any of them; a symbol none of these names fits (e.g. shape inference's
# `unk__3`) counts as 1.
COST_DEFAULT_DIMS = {"batch": 1, "seq": 512, "sequence": 512, "len": 512, "past": 0, "height": 224, "width": 224}
COST_OTHER_DIM = 1


def tensor_info(g: Graph, value: str, dims: Mapping[str, int] | None,
                extra: Mapping[str, onnx.TensorProto] | None = None) -> TensorInfo | None:
    """The cost model's view of a value: concrete shape (symbolic dims by default), dtype, constness."""
    if not value:
        return None
    if extra and value in extra:
        t = extra[value]
        return TensorInfo(tuple(int(d) for d in t.dims), np_dtype(t.data_type).name, True)
    shape = g.shape(value)
    dtype = g.dtype(value)
    if shape is None:
        arr = g.constant(value) if g.is_constant(value) else None
        shape = arr.shape if arr is not None else ()
    return TensorInfo(concrete_shape(shape, dims, COST_DEFAULT_DIMS, COST_OTHER_DIM),
                      (dtype or np.dtype(np.float32)).name, g.is_constant(value))


def op_work(g: Graph, node: onnx.NodeProto, dims: Mapping[str, int] | None,
            extra: Mapping[str, onnx.TensorProto] | None = None) -> OpWork:
    ins = tuple(tensor_info(g, v, dims, extra) for v in node.input)
    outs = tuple(tensor_info(g, v, dims, extra) or TensorInfo((), "float32") for v in node.output if v)
    return OpWork(node.name, node.op_type, node.domain, ins, outs, attributes(node))


def fusion_candidate(g: Graph, m: Match, rep: Replacement, dims: Mapping[str, int] | None) -> FusionCandidate:
    extra = {t.name: t for t in rep.initializers}
    unfused = tuple(op_work(g, g.node(n), dims) for n in m.nodes)
    fused = tuple(op_work(g, n, dims, extra) for n in rep.nodes)
    return FusionCandidate(m.pattern, unfused, fused)


def price(g: Graph, m: Match, rep: Replacement, spec: NpuSpec, force: bool,
          dims: Mapping[str, int] | None) -> FusionDecision:
    """The cost model's decision for one candidate on `spec`."""
    return decide(fusion_candidate(g, m, rep, dims), spec, force=force)


def model_ops(g: Graph, dims: Mapping[str, int] | None) -> Sequence[OpWork]:
    """Every compute node of the model as cost-model work (constant-only subgraphs excluded)."""
    return [op_work(g, n, dims) for n in g.nodes
            if not all(g.is_constant(o) for o in n.output if o)]
