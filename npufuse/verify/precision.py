"""A float16 model's whole-model check, settled against an fp32 run of the original where plain tolerance is too
tight to tell rounding from drift.

An fp16 network rounds every intermediate value to 11 bits. Two correct graphs of it that add or multiply in a
different order (a fused kernel's body against the ops it replaces) round differently, and through a deep network
those differences reach the output at the scale of the largest intermediate values, which may be far larger than the
output's own: a VAE decoder's features reach the hundreds and its output lies in [-1, 1]. The whole-model tolerance
(`compare.DEFAULT_TOLERANCES`, scaled by the output's magnitude) then fails a correct rewrite on some seeds.

What settles it is the exact result: the original model run in float32 (`fp32_copy`: its fp16 weights read through
a Cast, every fp16 type and type attribute made float32). Where the optimized model's largest error against that is
within `SPREAD` times the original fp16 model's own plus `STEPS` fp16 steps at the output's magnitude (`settle`),
the difference is rounding, not drift. A wrong rewrite (a dropped bias, a wrong scale) moves the output much further
from the exact result than rounding does and still fails, with both distances in its reason.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from npufuse.ir.walk import graphs_below
from npufuse.verify.compare import Comparison, Verdict, flush_subnormals

FP16 = TensorProto.FLOAT16
# How much further from the exact (fp32) result than the original the optimized fp16 model may be. onnxruntime's
# CPU kernels compute fp16 ops in fp32 and round once, so the original is within about half an fp16 step of the
# exact result; a fused op's function body rounds between its own ops too, and the ATC form's reference kernels
# (onnx's evaluator, numpy in fp16) round after every op. Measured on diffusers VAE decoders exported in fp16
# (GroupNorm+SiLU, attention, Conv epilogues fused; seeds 0-9): the original is 5e-4 from the exact result at most,
# the optimized model on onnxruntime 1.5e-3 to 1.9e-3 (about two fp16 steps at the output's magnitude, ~1.3), the
# ATC form under the reference evaluator up to 3.2e-3 (about three). A wrong scale of 1% is fifteen steps.
SPREAD = 2.0
STEPS = 4
_TYPE_ATTRS = frozenset({"to", "dtype"})
_SUFFIX = "__npufuse_fp16"
SETTLED = "float16 rounding, not drift"   # how a settled comparison's detail begins


def is_low_precision(dtype: np.dtype) -> bool:
    return np.dtype(dtype).name == "float16"


def fp32_copy(model: onnx.ModelProto) -> onnx.ModelProto | None:
    """`model` computing in float32, or None where it holds a float16 value this cannot widen (a sparse or sequence
    value, an fp16 initializer that is also a graph input). fp16 initializers keep their bytes (external data
    stays where it is) and are read through a Cast to float under their own name; fp16 graph inputs become float32
    (feed them widened: `widen_feeds`)."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    inputs = {i.name for i in m.graph.input}
    taken = {n.name for g in graphs_below(m.graph) for n in g.node}
    for g in graphs_below(m.graph, *_function_graphs(m)):
        casts = []
        for t in g.initializer:
            if t.data_type != FP16:
                continue
            if t.name in inputs:
                return None
            name = t.name
            t.name = name + _SUFFIX
            node_name = _fresh(f"{name}_to_fp32", taken)
            casts.append(onnx.helper.make_node("Cast", [t.name], [name], to=TensorProto.FLOAT, name=node_name))
        if any(t.values.data_type == FP16 for t in g.sparse_initializer):
            return None
        for vi in (*g.input, *g.output, *g.value_info):
            if not _widen_type(vi.type):
                return None
        for n in g.node:
            _widen_attrs(n)
        if casts:
            nodes = casts + list(g.node)
            del g.node[:]
            g.node.extend(nodes)
    for f in m.functions:
        for n in f.node:
            _widen_attrs(n)
    return m


def widen_feeds(feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: (v.astype(np.float32) if isinstance(v, np.ndarray) and is_low_precision(v.dtype) else v)
            for k, v in feeds.items()}


def settle(check: Verdict, got: Mapping[str, np.ndarray], want: Mapping[str, np.ndarray],
           exact: Callable[[], Mapping[str, np.ndarray] | None]) -> Verdict:
    """`check` (optimized `got` against original `want`), with each float16 output it failed on judged again against
    the exact result (`exact()`: the original's outputs in float32, None where they cannot be had): passed where the
    optimized output is no further from it than the original's, else failed with both distances in its reason.
    `exact` is called only when a float16 output failed."""
    failed = [c for c in check.comparisons if not c.ok and not c.inconclusive and c.name in got and
              is_low_precision(np.asarray(want[c.name]).dtype) and np.asarray(got[c.name]).dtype ==
              np.asarray(want[c.name]).dtype and np.shape(got[c.name]) == np.shape(want[c.name])]
    if check.ok or not failed:
        return check
    try:
        ref = exact()
    except Exception:   # noqa: BLE001 - no exact result: the plain verdict stands
        ref = None
    if not ref:
        return check
    settled = {}
    for c in failed:
        exact_out = ref.get(c.name)
        if exact_out is None or np.shape(exact_out) != np.shape(want[c.name]):
            continue
        settled[c.name] = _judge(c, np.asarray(got[c.name]), np.asarray(want[c.name]), np.asarray(exact_out))
    comps = [settled.get(c.name, c) for c in check.comparisons]
    return Verdict.of(comps)


def _judge(c: Comparison, got: np.ndarray, want: np.ndarray, exact: np.ndarray) -> Comparison:
    dtype = want.dtype
    e = flush_subnormals(exact.astype(np.float64), dtype)
    fin = np.isfinite(e) & np.isfinite(want.astype(np.float64)) & np.isfinite(got.astype(np.float64))
    if not fin.any():
        return c
    e_orig = np.abs(flush_subnormals(want.astype(np.float64), dtype) - e)[fin]
    e_opt = np.abs(flush_subnormals(got.astype(np.float64), dtype) - e)[fin]
    step = float(np.spacing(np.float16(np.abs(e[fin]).max())))   # one fp16 step at the output's magnitude
    bound = SPREAD * float(e_orig.max()) + STEPS * step
    figures = (f"against an fp32 run of the original: {e_opt.max():.3g} at most, the original {e_orig.max():.3g}; "
               f"allowed {bound:.3g} ({SPREAD:g}x the original's + {STEPS} fp16 steps)")
    if e_opt.max() <= bound:
        return replace(c, ok=True, detail=f"{SETTLED}: {c.detail}; {figures}")
    return replace(c, detail=f"{c.detail}; further from the exact result than the original ({figures})")


def _fresh(name: str, taken: set[str]) -> str:
    out, i = name, 1
    while out in taken:
        out, i = f"{name}_{i}", i + 1
    taken.add(out)
    return out


def _function_graphs(model: onnx.ModelProto) -> list[onnx.GraphProto]:
    return [a.g for f in model.functions for n in f.node for a in n.attribute if a.type == onnx.AttributeProto.GRAPH]


def _widen_type(t: onnx.TypeProto) -> bool:
    """Make a tensor type's fp16 float32; False for an fp16 type inside anything but a plain tensor."""
    kind = t.WhichOneof("value")
    if kind == "tensor_type":
        if t.tensor_type.elem_type == FP16:
            t.tensor_type.elem_type = TensorProto.FLOAT
        return True
    if kind == "sparse_tensor_type":
        return t.sparse_tensor_type.elem_type != FP16
    if kind in ("sequence_type", "optional_type"):
        inner = getattr(t, kind).elem_type
        return not (inner.WhichOneof("value") == "tensor_type" and inner.tensor_type.elem_type == FP16)
    return True


def _widen_attrs(n: onnx.NodeProto) -> None:
    for a in n.attribute:
        if a.type == onnx.AttributeProto.INT and a.name in _TYPE_ATTRS and a.i == FP16:
            a.i = TensorProto.FLOAT
        elif a.type == onnx.AttributeProto.TENSOR and a.t.data_type == FP16:
            arr = numpy_helper.to_array(a.t).astype(np.float32)
            a.t.CopyFrom(numpy_helper.from_array(arr, a.t.name))
