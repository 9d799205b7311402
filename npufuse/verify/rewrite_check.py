"""Check one rewrite on its own: the matched subgraph on onnxruntime vs the replacement's reference kernels."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import numpy as np
import onnx
from onnx import helper, numpy_helper

from npufuse.errors import first_line
from npufuse.ir.candidates import Match, Replacement
from npufuse.ir.graph import Graph
from npufuse.ir.runtime import IR_VERSION, run
from npufuse.verify.compare import Verdict, compare
from npufuse.verify.reference import run_reference
from npufuse.ir.widen import is_bfloat16, widen_feed
from npufuse.ir.weights import is_external

# The verdict on one rewrite.
RewriteCheck = Verdict


def subgraph_model(g: Graph, m: Match, feeds: Mapping[str, np.ndarray]) -> onnx.ModelProto:
    """The matched nodes as a model of their own: dynamic boundary inputs as inputs, constants inside (weights
    stored on disk stay references, read by onnxruntime from the model's folder)."""
    dynamic = [v for v in m.inputs if not g.is_constant(v)]
    inits = []
    for v in m.inputs:
        if not g.is_constant(v):
            continue
        t = g.initializers.get(v)
        inits.append(t if t is not None and is_external(t) else numpy_helper.from_array(np.asarray(g.constant(v)), v))
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
        want = run(subgraph_model(g, m, feeds), feeds, list(m.outputs), base_dir=g.base_dir)
    except Exception as exc:
        return RewriteCheck(False, reason=f"onnxruntime could not run the original subgraph: {first_line(exc)}")
    env: dict[str, np.ndarray] = {v: feeds[v] for v in m.inputs if v in feeds}
    for v in m.inputs:
        if v not in env:
            env[v] = np.asarray(g.constant(v))
    for t in rep.initializers:
        env[t.name] = numpy_helper.to_array(t)
    # bf16: the reference kernels compute in fp32 (numpy has no bf16 arithmetic of its own; onnxruntime's side ran
    # an fp32 copy too, see verify.widen) and their outputs are rounded to bf16 like onnxruntime's
    bf16 = any(isinstance(a, np.ndarray) and is_bfloat16(a.dtype) for a in env.values())
    if bf16:
        env = {k: widen_feed(v) for k, v in env.items()}
    try:
        got = run_reference(rep.nodes, env, g.opset.get("", 1), list(m.outputs))
    except Exception as exc:
        return RewriteCheck(False, reason=f"the reference kernel failed: {first_line(exc)}")
    if bf16:
        got = {o: np.asarray(got[o]).astype(want[o].dtype) if is_bfloat16(want[o].dtype) else got[o]
               for o in m.outputs}
    # An inconclusive check (the subgraph's output NaN/inf or empty on its real inputs) is not ok: the rewrite
    # is rolled back, the conservative choice for a rewrite nothing could check.
    return RewriteCheck.of([compare(o, got[o], want[o]) for o in m.outputs])


# A constant input with at most this many elements is part of a check's signature by value (epsilons, scales,
# shapes, axes); a larger one (a weight) by type and shape only.
_SIGNATURE_VALUE_ELEMENTS = 64


def check_signature(g: Graph, m: Match, rep: Replacement, feeds: Mapping[str, np.ndarray]) -> str | None:
    """A digest of everything a rewrite's check depends on but the values of weights passed through unchanged:
    the matched nodes and the replacement (op types, attributes, wiring, with value names numbered by first
    use), the type and shape of each dynamic input, small constants by value, and any tensor the rewrite
    computed (folded weights) in full. Two rewrites with the same signature run the same kernels on the same
    kinds of data, so one check stands for both (the repeated layers of a transformer); the whole-model check
    still runs every one. None when a constant cannot be read (no sharing)."""
    h = hashlib.sha256(m.pattern.encode())
    ids: dict[str, int] = {}

    def vid(name: str) -> str:
        return "" if not name else str(ids.setdefault(name, len(ids)))

    for v in m.inputs:
        h.update(f"in{vid(v)}:".encode())
        if g.is_constant(v):
            arr = g.constant(v)
            if arr is None:
                return None
            h.update(f"c{arr.dtype}{arr.shape}".encode())
            if arr.size <= _SIGNATURE_VALUE_ELEMENTS:
                h.update(np.ascontiguousarray(arr).tobytes())
        else:
            arr = feeds.get(v)
            h.update(f"d{arr.dtype}{arr.shape}".encode() if arr is not None else b"?")
    for node in [g.node(n) for n in m.nodes] + list(rep.nodes):
        h.update(f"|{node.domain}.{node.op_type}({','.join(vid(v) for v in node.input)})->"
                 f"({','.join(vid(v) for v in node.output)})".encode())
        for a in sorted(node.attribute, key=lambda a: a.name):
            h.update(a.SerializeToString(deterministic=True))
    for t in rep.initializers:
        h.update(f"init{vid(t.name)}".encode())
        h.update(numpy_helper.to_array(t).tobytes())
    h.update(("out" + ",".join(vid(v) for v in m.outputs)).encode())
    return h.hexdigest()
