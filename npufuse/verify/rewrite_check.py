"""Check one rewrite on its own: the matched subgraph on onnxruntime vs the replacement's reference kernels."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx
from onnx import helper, numpy_helper

from npufuse.errors import first_line
from npufuse.fusion.types import Match, Replacement
from npufuse.graph import Graph
from npufuse.runtime import IR_VERSION, run
from npufuse.verify.compare import Verdict, compare
from npufuse.verify.reference import run_reference

# The verdict on one rewrite.
RewriteCheck = Verdict


def subgraph_model(g: Graph, m: Match, feeds: Mapping[str, np.ndarray]) -> onnx.ModelProto:
    """The matched nodes as a model of their own: dynamic boundary inputs as inputs, constants inside."""
    dynamic = [v for v in m.inputs if not g.is_constant(v)]
    inits = [numpy_helper.from_array(np.asarray(g.constant(v)), v) for v in m.inputs if g.is_constant(v)]
    inputs = [helper.make_tensor_value_info(v, helper.np_dtype_to_tensor_dtype(feeds[v].dtype), feeds[v].shape)
              for v in dynamic]
    outputs = [g.value_info(v) for v in m.outputs]
    graph = helper.make_graph([g.node(n) for n in m.nodes], f"npufuse_check_{m.pattern}", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=list(g.model.opset_import), ir_version=IR_VERSION,
                             functions=list(g.model.functions))


def check_rewrite(g: Graph, m: Match, rep: Replacement, feeds: Mapping[str, np.ndarray]) -> RewriteCheck:
    """Run the original subgraph (onnxruntime, no graph optimizations) and the replacement (NumPy
    reference kernels) on the same boundary inputs and compare every output."""
    missing = [v for v in m.inputs if not g.is_constant(v) and v not in feeds]
    if missing:
        return RewriteCheck(False, reason=f"no input data for {missing}")
    try:
        want = run(subgraph_model(g, m, feeds), feeds, list(m.outputs))
    except Exception as exc:
        return RewriteCheck(False, reason=f"onnxruntime could not run the original subgraph: {first_line(exc)}")
    env: dict[str, np.ndarray] = {v: feeds[v] for v in m.inputs if v in feeds}
    for v in m.inputs:
        if v not in env:
            env[v] = np.asarray(g.constant(v))
    for t in rep.initializers:
        env[t.name] = numpy_helper.to_array(t)
    try:
        got = run_reference(rep.nodes, env, g.opset.get("", 1), list(m.outputs))
    except Exception as exc:
        return RewriteCheck(False, reason=f"the reference kernel failed: {first_line(exc)}")
    comps = [compare(o, got[o], want[o]) for o in m.outputs]
    bad = [c for c in comps if not c.ok]
    reason = "; ".join(f"{c.name}: {c.detail}" for c in bad)
    return RewriteCheck(not bad, comps, reason)
