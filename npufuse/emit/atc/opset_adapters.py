"""Per-op adapters that move a default-domain node between ai.onnx opsets, and decompositions of the ops CANN's
ONNX parser has no key for (Gelu, GroupNormalization, RMSNormalization; LayerNormalization below 17).

`lower.convert_default_opset` drives them: for each node it compares the op's schema `since_version` at the model's
opset and at the target. Where they are equal the node is kept; where they differ, `HANDLERS[op]` (if any) rewrites
the node for the version boundaries it knows, and every other boundary crossed must be a change of the type lists
only (checked against `onnx.defs`: same attributes, defaults, inputs and outputs), which needs no rewrite.

Each adapter is `fn(node, ctx) -> list[NodeProto]`: `node` is the caller's own copy (free to edit); the list
replaces it. An op that cannot be expressed at the target raises `Unsupported` with the reason and the fix;
the driver collects those and raises one `LoweringError` naming the first node and the count.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import lru_cache
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from npufuse.errors import InputError

MIN_TARGET, MAX_TARGET = 14, 18
DEFAULT_DOMAINS = ("", "ai.onnx")
_FLOAT = TensorProto.FLOAT
_INT64_MAX = 2**63 - 1


class LoweringError(InputError):
    """The model cannot be lowered to what ATC accepts: names the first node, the count and the fix (one line)."""


class Unsupported(Exception):
    """One node cannot be adapted; `fix` says what the user can do. Collected by the driver."""

    def __init__(self, reason: str, fix: str) -> None:
        super().__init__(reason)
        self.reason, self.fix = reason, fix


# ---- schema facts ---------------------------------------------------------------------------------------------

@lru_cache(maxsize=4096)
def since_version(op: str, version: int) -> int | None:
    """The since_version of the default-domain schema of `op` in force at `version`; None if none exists."""
    try:
        return onnx.defs.get_schema(op, max_inclusive_version=version, domain="").since_version
    except onnx.defs.SchemaError:
        return None


def schema_versions(op: str) -> tuple[int, ...]:
    """Every since_version of `op` in the default domain, ascending."""
    return _VERSIONS.get(op, ())


def _build_versions() -> dict[str, tuple[int, ...]]:
    acc: dict[str, set[int]] = {}
    for s in onnx.defs.get_all_schemas_with_history():
        if s.domain == "":
            acc.setdefault(s.name, set()).add(s.since_version)
    return {k: tuple(sorted(v)) for k, v in acc.items()}


_VERSIONS = _build_versions()


def _signature(op: str, version: int) -> tuple:
    s = onnx.defs.get_schema(op, max_inclusive_version=version, domain="")
    attrs = tuple(sorted((a.name, a.required, a.default_value.SerializeToString()) for a in s.attributes.values()))
    return (attrs, tuple((i.name, i.option) for i in s.inputs), tuple((o.name, o.option) for o in s.outputs))


# Boundaries whose signature is unchanged but whose meaning changed for some attribute value: never relabel
# these blindly (a handler checks the value). Pad-19 adds mode "wrap", Resize-19 "half_pixel_symmetric".
_VALUE_SEMANTIC = {("Pad", 19), ("Resize", 19)}


@lru_cache(maxsize=4096)
def types_only(op: str, version: int) -> bool:
    """True when the schema introduced at `version` differs from the previous one only in its type lists."""
    vs = schema_versions(op)
    i = vs.index(version)
    if i == 0 or (op, version) in _VALUE_SEMANTIC:
        return False
    return _signature(op, vs[i - 1]) == _signature(op, version)


@lru_cache(maxsize=4096)
def crossed(op: str, src: int, dst: int) -> tuple[int, ...]:
    """The schema versions of `op` crossed moving from opset `src` to `dst` (either direction)."""
    lo, hi = min(src, dst), max(src, dst)
    return tuple(v for v in schema_versions(op) if lo < v <= hi)


# Types a later opset added to Cast/CastLike: casting to them cannot be expressed before that opset.
_NEW_TYPES = {getattr(TensorProto, n): v for n, v in (
    ("FLOAT8E4M3FN", 19), ("FLOAT8E4M3FNUZ", 19), ("FLOAT8E5M2", 19), ("FLOAT8E5M2FNUZ", 19),
    ("UINT4", 21), ("INT4", 21), ("FLOAT4E2M1", 23), ("FLOAT8E8M0", 24), ("UINT2", 25), ("INT2", 25))
    if hasattr(TensorProto, n)}


# ---- node helpers -------------------------------------------------------------------------------------------

def get_attr(node: onnx.NodeProto, name: str, default: Any = None) -> Any:
    """The value of attribute `name` of `node`, or `default`."""
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def drop_attr(node: onnx.NodeProto, *names: str) -> None:
    """Remove the attributes `names` from `node` (those present)."""
    keep = [a for a in node.attribute if a.name not in names]
    if len(keep) != len(node.attribute):
        del node.attribute[:]
        node.attribute.extend(keep)


def set_attr(node: onnx.NodeProto, name: str, value: Any) -> None:
    """Set attribute `name` of `node` to `value` (replacing any)."""
    drop_attr(node, name)
    node.attribute.append(helper.make_attribute(name, value))


def _decoded(value: Any) -> Any:
    return value.decode() if isinstance(value, bytes) else value


class Context:
    """What an adapter needs: source and target opsets, fresh names, dtypes and shapes, small constants.

    `names` and `types` come from the driver (lower.py); constants are shared by value so that thousands of
    decomposed Gelu nodes reuse one `0.5`."""

    def __init__(self, src: int, dst: int, names: Any, types: Any, constants: Callable[[str], np.ndarray | None]):
        self.src, self.dst = src, dst
        self.names = names
        self.types = types
        self.constant_value = constants      # name -> its value when it is a small constant, else None
        self.initializers: list[onnx.TensorProto] = []
        self.released: set[str] = set()       # inputs an adapter stopped reading (initializers maybe now unused)
        self._const_cache: dict[tuple, str] = {}

    # constants ---------------------------------------------------------------------------------------------
    def const(self, values: Any, elem_type: int, hint: str) -> str:
        """A (shared) initializer holding `values` as `elem_type`: fp16/bf16 are converted by onnx.helper."""
        arr = np.asarray(values)
        key = (elem_type, arr.shape, arr.astype(np.float64 if arr.dtype.kind == "f" else arr.dtype).tobytes())
        name = self._const_cache.get(key)
        if name is None:
            name = self.names.value(f"npufuse_lower/{hint}")
            self.initializers.append(helper.make_tensor(name, elem_type, list(arr.shape), arr.flatten().tolist()))
            self._const_cache[key] = name
        return name

    def ints(self, values: list[int], hint: str = "ints") -> str:
        """An int64 1-D constant."""
        return self.const(np.asarray(values, dtype=np.int64), TensorProto.INT64, hint)

    def node(self, base: onnx.NodeProto, op: str, inputs: list[str], outputs: list[str] | None = None,
             **attrs: Any) -> onnx.NodeProto:
        """A default-domain node named `<base's name>/<op>`, with fresh output names unless given."""
        prefix = base.name or base.op_type
        outs = outputs if outputs is not None else [self.names.value(f"{prefix}/{op}_out")]
        return helper.make_node(op, inputs, outs, name=self.names.node(f"{prefix}/{op}"), **attrs)

    def elem_type(self, value: str, node: onnx.NodeProto) -> int:
        """The element type of `value`, or Unsupported: decompositions need dtype-correct constants."""
        t = self.types.elem_type(value)
        if not t:
            raise Unsupported(f"the element type of '{value}' is unknown",
                              "add value_info for it (onnx.shape_inference.infer_shapes) and lower again")
        return t

    def reduce_mean(self, base: onnx.NodeProto, x: str, axes: list[int], out: str | None = None) -> onnx.NodeProto:
        """ReduceMean over `axes` (keepdims=1), with axes as attribute below opset 18 and as input from 18."""
        outs = [out] if out else None
        if self.dst >= 18:
            return self.node(base, "ReduceMean", [x, self.ints(axes, "axes")], outs, keepdims=1)
        return self.node(base, "ReduceMean", [x], outs, axes=axes, keepdims=1)


# ---- adapters: structural changes ------------------------------------------------------------------------

_REDUCE_OPS = ("ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2", "ReduceLogSum",
               "ReduceLogSumExp", "ReduceSumSquare", "ReduceSum")


def adapt_reduce(node: onnx.NodeProto, ctx: Context) -> list[onnx.NodeProto]:
    """Reduce*: axes moved from attribute to optional input (ReduceSum at 13, the others at 18), together with
    `noop_with_empty_axes`. Later boundaries (ReduceMax/Min-20: bool) only add types."""
    pivot = 13 if node.op_type == "ReduceSum" else 18
    src_input, dst_input = ctx.src >= pivot, ctx.dst >= pivot
    if src_input == dst_input:
        return [node]
    if src_input:   # input -> attribute
        axes_name = node.input[1] if len(node.input) > 1 else ""
        axes: list[int] | None = None
        if axes_name:
            value = ctx.constant_value(axes_name)
            if value is None:
                raise Unsupported("its axes input is computed at run time",
                                  f"use opset >= {pivot}, or make the axes a constant")
            axes = [int(a) for a in value.reshape(-1)]
        noop = get_attr(node, "noop_with_empty_axes", 0)
        drop_attr(node, "noop_with_empty_axes")
        if axes_name:
            ctx.released.add(axes_name)
        del node.input[1:]
        if not axes:
            if noop:   # no axes and noop: the op is the identity
                return [helper.make_node("Identity", [node.input[0]], list(node.output), name=node.name)]
            return [node]           # no axes attribute = reduce over all axes, as before
        set_attr(node, "axes", axes)
        return [node]
    axes = get_attr(node, "axes")    # attribute -> input
    drop_attr(node, "axes")
    if axes:
        node.input.append(ctx.ints(list(axes), "axes"))
    return [node]


def adapt_split(node: onnx.NodeProto, ctx: Context) -> list[onnx.NodeProto]:
    """Split: `split` attribute -> input at 13; `num_outputs` attribute at 18 (the last chunk may be smaller,
    where Split-13 without sizes needs an even split, so sizes are made explicit unless provably even)."""
    out: list[onnx.NodeProto] = []
    if ctx.src < 13 <= ctx.dst:
        sizes = get_attr(node, "split")
        drop_attr(node, "split")
        if sizes:
            node.input.append(ctx.ints(list(sizes), "split"))
    num = get_attr(node, "num_outputs")
    if num is not None and ctx.dst < 18:
        drop_attr(node, "num_outputs")
        if len(node.input) < 2 or not node.input[1]:
            axis = get_attr(node, "axis", 0)
            dim = ctx.types.dim(node.input[0], axis)
            if isinstance(dim, int):
                if dim % num:       # static and uneven: the sizes torch.chunk would give
                    chunk = -(-dim // num)
                    node.input[1:] = [ctx.ints([chunk] * (num - 1) + [dim - chunk * (num - 1)], "split")]
            else:
                out, split = _dynamic_split_sizes(node, ctx, axis, num)
                node.input[1:] = [split]
    elif ctx.dst >= 18 > ctx.src and (len(node.input) < 2 or not node.input[1]):
        set_attr(node, "num_outputs", len(node.output))   # Split-18 needs sizes or num_outputs
    return out + [node]


def _dynamic_split_sizes(node: onnx.NodeProto, ctx: Context, axis: int, num: int) -> tuple[list, str]:
    """Nodes computing Split-18's sizes for `num_outputs` at run time: ceil(d/n) repeated n-1 times, then the rest."""
    shape = ctx.node(node, "Shape", [node.input[0]])
    dim = ctx.node(node, "Gather", [shape.output[0], ctx.ints([axis], "axis")], axis=0)
    plus = ctx.node(node, "Add", [dim.output[0], ctx.ints([num - 1], "n_minus_1")])
    chunk = ctx.node(node, "Div", [plus.output[0], ctx.ints([num], "n")])
    if num == 1:
        return [shape, dim], dim.output[0]
    firsts = ctx.node(node, "Expand", [chunk.output[0], ctx.ints([num - 1], "n_minus_1")])
    used = ctx.node(node, "Mul", [chunk.output[0], ctx.ints([num - 1], "n_minus_1")])
    last = ctx.node(node, "Sub", [dim.output[0], used.output[0]])
    sizes = ctx.node(node, "Concat", [firsts.output[0], last.output[0]], axis=0)
    return [shape, dim, plus, chunk, firsts, used, last, sizes], sizes.output[0]


def adapt_squeeze(node: onnx.NodeProto, ctx: Context) -> list[onnx.NodeProto]:
    """Squeeze/Unsqueeze: axes attribute -> input at 13 (later boundaries only add types)."""
    if ctx.src < 13 <= ctx.dst:
        axes = get_attr(node, "axes")
        drop_attr(node, "axes")
        if axes is not None:
            node.input.append(ctx.ints(list(axes), "axes"))
    elif ctx.dst < 13 <= ctx.src:
        raise Unsupported("axes moved to an input at opset 13", "use a target opset >= 13")
    return [node]


def adapt_pad(node: onnx.NodeProto, ctx: Context) -> list[onnx.NodeProto]:
    """Pad: the `axes` input (18) is folded into full-rank pads where pads, axes and the rank are known;
    mode "wrap" (19) has no earlier form."""
    if ctx.dst < 19 and _decoded(get_attr(node, "mode", "constant")) == "wrap":
        raise Unsupported("mode 'wrap' exists from opset 19", "use another pad mode or keep the Pad out of ATC")
    if ctx.dst < 18 and len(node.input) > 3 and node.input[3]:
        pads, axes = ctx.constant_value(node.input[1]), ctx.constant_value(node.input[3])
        rank = ctx.types.rank(node.input[0])
        if pads is None or axes is None or rank is None:
            raise Unsupported("its 'axes' input (opset 18) needs constant pads, axes and a known rank",
                              "make pads/axes constants or give the input a static rank")
        axes_l = [int(a) % rank for a in axes.reshape(-1)]
        full = [0] * (2 * rank)
        for i, a in enumerate(axes_l):
            full[a], full[a + rank] = int(pads[i]), int(pads[i + len(axes_l)])
        ctx.released.update((node.input[1], node.input[3]))
        node.input[1] = ctx.ints(full, "pads")
        del node.input[3:]
    return [node]


def adapt_resize(node: onnx.NodeProto, ctx: Context) -> list[onnx.NodeProto]:
    """Resize: 18 adds antialias/axes/keep_aspect_ratio_policy, 19 the half_pixel_symmetric mode; the node
    moves down only where it uses none of them (their defaults are dropped)."""
    if ctx.src < 13:
        raise Unsupported("Resize before opset 13 has other coordinate modes", "export the model at opset >= 13")
    if ctx.dst < 19 and _decoded(get_attr(node, "coordinate_transformation_mode", "")) == "half_pixel_symmetric":
        raise Unsupported("coordinate mode half_pixel_symmetric exists from opset 19", "use half_pixel")
    if ctx.dst < 18:
        if get_attr(node, "antialias", 0) or get_attr(node, "axes") is not None or \
                _decoded(get_attr(node, "keep_aspect_ratio_policy", "stretch")) != "stretch":
            raise Unsupported("it uses antialias/axes/keep_aspect_ratio_policy (opset 18)",
                              "resize without them or use target opset 18")
        drop_attr(node, "antialias", "axes", "keep_aspect_ratio_policy")
    return [node]


def adapt_average_pool(node: onnx.NodeProto, ctx: Context) -> list[onnx.NodeProto]:
    """AveragePool-19 adds dilations: all-ones (or absent) is the earlier op."""
    if ctx.dst < 19:
        dil = get_attr(node, "dilations")
        if dil and any(d != 1 for d in dil):
            raise Unsupported("dilated average pooling exists from opset 19", "use target 19 or undilated pooling")
        drop_attr(node, "dilations")
    return [node]


def _check_cast_to(node: onnx.NodeProto, to: int, ctx: Context) -> None:
    need = _NEW_TYPES.get(to, 0)
    if need > ctx.dst:
        raise Unsupported(f"it casts to {TensorProto.DataType.Name(to)}, a type of opset {need}",
                          "keep that cast out of the ATC model")


def _drop_cast_attrs(node: onnx.NodeProto, ctx: Context) -> None:
    """Cast/CastLike: `saturate` (19) only acts on float8 targets; `round_mode` (24) only on float8e8m0."""
    if ctx.dst < 19:
        drop_attr(node, "saturate")
    if ctx.dst < 24:
        if _decoded(get_attr(node, "round_mode", "up")) != "up":
            raise Unsupported("round_mode exists from opset 24", "drop the round_mode attribute")
        drop_attr(node, "round_mode")


def adapt_cast(node: onnx.NodeProto, ctx: Context) -> list[onnx.NodeProto]:
    """Cast: later opsets add saturate/round_mode (float8 only) and types."""
    _check_cast_to(node, get_attr(node, "to"), ctx)
    _drop_cast_attrs(node, ctx)
    return [node]


def adapt_cast_like(node: onnx.NodeProto, ctx: Context) -> list[onnx.NodeProto]:
    """CastLike (15): below 15 a Cast to the second input's element type."""
    _drop_cast_attrs(node, ctx)
    if ctx.dst < 15:
        to = ctx.elem_type(node.input[1], node)
        _check_cast_to(node, to, ctx)
        return [helper.make_node("Cast", [node.input[0]], list(node.output), name=node.name, to=to)]
    return [node]


def adapt_shape(node: onnx.NodeProto, ctx: Context) -> list[onnx.NodeProto]:
    """Shape-15 adds start/end: below 15, Shape then Slice."""
    start, end = get_attr(node, "start"), get_attr(node, "end")
    if ctx.dst >= 15 or (start is None and end is None):
        drop_attr(node, "start", "end")
        return [node]
    drop_attr(node, "start", "end")
    out = node.output[0]
    node.output[0] = ctx.names.value(f"{node.name or 'Shape'}/full")
    sl = ctx.node(node, "Slice", [node.output[0], ctx.ints([start or 0], "start"),
                                  ctx.ints([_INT64_MAX if end is None else end], "end"), ctx.ints([0], "axis")],
                  [out])
    return [node, sl]


def _attribute_new_at_14(node: onnx.NodeProto, ctx: Context, attr: str) -> list[onnx.NodeProto]:
    """An attribute opset 14 added whose default 0 is the earlier op: dropped below 14, refused when set."""
    if ctx.dst < 14:
        if get_attr(node, attr, 0):
            raise Unsupported(f"{attr}=1 exists from opset 14", "use target opset >= 14")
        drop_attr(node, attr)
    return [node]


def adapt_reshape(node: onnx.NodeProto, ctx: Context) -> list[onnx.NodeProto]:
    """Reshape-14 adds allowzero: allowzero=0 is the earlier op."""
    return _attribute_new_at_14(node, ctx, "allowzero")


def adapt_batch_norm(node: onnx.NodeProto, ctx: Context) -> list[onnx.NodeProto]:
    """BatchNormalization-14 adds training_mode; inference form (one output) is unchanged."""
    if ctx.dst < 14:
        if get_attr(node, "training_mode", 0) or len([o for o in node.output if o]) > 1:
            raise Unsupported("training-mode BatchNormalization", "export the model in eval mode")
        drop_attr(node, "training_mode")
    return [node]


def adapt_rnn(node: onnx.NodeProto, ctx: Context) -> list[onnx.NodeProto]:
    """GRU/LSTM/RNN-14 add `layout`; layout 0 is the earlier op."""
    return _attribute_new_at_14(node, ctx, "layout")


def adapt_scatter(node: onnx.NodeProto, ctx: Context) -> list[onnx.NodeProto]:
    """ScatterElements/ScatterND: `reduction` from 16 (add, mul), max/min from 18."""
    red = _decoded(get_attr(node, "reduction", "none"))
    allowed = {"none", "add", "mul", "max", "min"} if ctx.dst >= 18 else \
        {"none", "add", "mul"} if ctx.dst >= 16 else {"none"}
    if red not in allowed:
        raise Unsupported(f"reduction '{red}' needs a later opset", "use target opset 18")
    if ctx.dst < 16:
        drop_attr(node, "reduction")
    return [node]


def adapt_softmax(node: onnx.NodeProto, ctx: Context) -> list[onnx.NodeProto]:
    """Softmax/LogSoftmax/Hardmax-13: one axis instead of the flattened [axis:] (default 1 -> -1). Both agree
    where the axis is the last one, which is the only case adapted."""
    old_default = 1 if ctx.src < 13 else -1
    axis = get_attr(node, "axis", old_default)
    rank = ctx.types.rank(node.input[0])
    if axis != -1 and (rank is None or axis != rank - 1):
        raise Unsupported(f"{node.op_type} over axis {axis} changed meaning at opset 13", "export at opset >= 13")
    set_attr(node, "axis", -1)
    return [node]


def adapt_control_flow(node: onnx.NodeProto, ctx: Context) -> list[onnx.NodeProto]:
    """If/Loop/Scan: later versions only add types; their bodies are converted by the driver."""
    return [node]


# ---- decompositions ---------------------------------------------------------------------------------------

def _stash(node: onnx.NodeProto, ctx: Context, x: str, stash: int) -> tuple[list, str, int, int]:
    """`x` cast to the stash type (float32) where the op computes in it: (nodes, name, x's type, compute type)."""
    xt = ctx.elem_type(x, node)
    if stash == _FLOAT and xt != _FLOAT:
        c = ctx.node(node, "Cast", [x], to=_FLOAT)
        return [c], c.output[0], xt, _FLOAT
    return [], x, xt, xt


def _axes_from(node: onnx.NodeProto, ctx: Context, x: str, axis: int) -> list[int]:
    """The axes [axis, rank) of a normalization, negative where possible so no rank is needed."""
    if axis < 0:
        return list(range(axis, 0))
    rank = ctx.types.rank(x)
    if rank is None:
        raise Unsupported(f"axis={axis} of an input of unknown rank", "add shape information (value_info)")
    return list(range(axis, rank))


def decompose_layer_norm(node: onnx.NodeProto, ctx: Context) -> list[onnx.NodeProto]:
    """LayerNormalization (17) as ReduceMean/Sub/Mul/ReduceMean/Add/Sqrt/Div/Mul/Add, computed in the stash type
    (float32 by default, as the op does); Mean and InvStdDev outputs kept where used."""
    x, scale = node.input[0], node.input[1]
    bias = node.input[2] if len(node.input) > 2 else ""
    eps = float(get_attr(node, "epsilon", 1e-5))
    axes = _axes_from(node, ctx, x, int(get_attr(node, "axis", -1)))
    nodes, xs, xt, ct = _stash(node, ctx, x, int(get_attr(node, "stash_type", 1)))
    outs = list(node.output) + [""] * (3 - len(node.output))
    mean = ctx.reduce_mean(node, xs, axes, outs[1] or None)
    d = ctx.node(node, "Sub", [xs, mean.output[0]])
    sq = ctx.node(node, "Mul", [d.output[0], d.output[0]])
    var = ctx.reduce_mean(node, sq.output[0], axes)
    ve = ctx.node(node, "Add", [var.output[0], ctx.const(eps, ct, "epsilon")])
    std = ctx.node(node, "Sqrt", [ve.output[0]])
    norm = ctx.node(node, "Div", [d.output[0], std.output[0]])
    nodes += [mean, d, sq, var, ve, std, norm]
    if outs[2]:
        nodes.append(ctx.node(node, "Reciprocal", [std.output[0]], [outs[2]]))
    y = norm.output[0]
    if ct != xt:
        c = ctx.node(node, "Cast", [y], to=xt)
        nodes.append(c)
        y = c.output[0]
    scaled = ctx.node(node, "Mul", [y, scale], None if bias else [outs[0]])
    nodes.append(scaled)
    if bias:
        nodes.append(ctx.node(node, "Add", [scaled.output[0], bias], [outs[0]]))
    return nodes


def decompose_gelu(node: onnx.NodeProto, ctx: Context) -> list[onnx.NodeProto]:
    """Gelu (20): exact 0.5*x*(1+erf(x/sqrt(2))); tanh 0.5*x*(1+tanh(sqrt(2/pi)*(x+0.044715*x^3)))."""
    x, y = node.input[0], node.output[0]
    t = ctx.elem_type(x, node)
    approx = _decoded(get_attr(node, "approximate", "none"))
    if approx == "tanh":
        x2 = ctx.node(node, "Mul", [x, x])
        x3 = ctx.node(node, "Mul", [x2.output[0], x])
        cx3 = ctx.node(node, "Mul", [x3.output[0], ctx.const(0.044715, t, "gelu_c")])
        inner = ctx.node(node, "Add", [x, cx3.output[0]])
        scaled = ctx.node(node, "Mul", [inner.output[0], ctx.const(math.sqrt(2 / math.pi), t, "sqrt_2_over_pi")])
        f = ctx.node(node, "Tanh", [scaled.output[0]])
        head = [x2, x3, cx3, inner, scaled, f]
    elif approx == "none":
        scaled = ctx.node(node, "Div", [x, ctx.const(math.sqrt(2.0), t, "sqrt2")])
        f = ctx.node(node, "Erf", [scaled.output[0]])
        head = [scaled, f]
    else:
        raise Unsupported(f"unknown approximate='{approx}'", "use 'none' or 'tanh'")
    one = ctx.node(node, "Add", [head[-1].output[0], ctx.const(1.0, t, "one")])
    xm = ctx.node(node, "Mul", [x, one.output[0]])
    half = ctx.node(node, "Mul", [xm.output[0], ctx.const(0.5, t, "half")], [y])
    return head + [one, xm, half]


def decompose_group_norm(node: onnx.NodeProto, ctx: Context) -> list[onnx.NodeProto]:
    """GroupNormalization as Reshape(N,G,-1) + InstanceNormalization + affine + Reshape back.

    Opset 18's scale/bias are per group (applied on the (N,G,-1) view); opset 21's are per channel (applied on
    the (N,C,-1) view) and 21 computes in `stash_type` (float32 by default)."""
    version = since_version("GroupNormalization", ctx.src)
    x, scale, bias = node.input[0], node.input[1], node.input[2]
    groups = int(get_attr(node, "num_groups"))
    eps = float(get_attr(node, "epsilon", 1e-5))
    stash = int(get_attr(node, "stash_type", 1)) if version == 21 else 0
    nodes, xs, xt, ct = _stash(node, ctx, x, stash)
    shape = ctx.node(node, "Shape", [x])
    grouped = ctx.node(node, "Reshape", [xs, ctx.ints([0, groups, -1], "group_shape")])
    inorm = ctx.node(node, "InstanceNormalization",
                     [grouped.output[0], ctx.const(np.ones(groups), ct, "ones"),
                      ctx.const(np.zeros(groups), ct, "zeros")], epsilon=eps)
    nodes += [shape, grouped, inorm]
    y = inorm.output[0]
    if ct != xt:
        c = ctx.node(node, "Cast", [y], to=xt)
        nodes.append(c)
        y = c.output[0]
    if version != 21:       # per group: affine on the (N, G, -1) view
        view = y
    else:                   # per channel: affine on the (N, C, -1) view
        back = ctx.node(node, "Reshape", [y, shape.output[0]])
        flat = ctx.node(node, "Reshape", [back.output[0], ctx.ints([0, 0, -1], "channel_shape")])
        nodes += [back, flat]
        view = flat.output[0]
    col = ctx.ints([-1, 1], "column")
    s = ctx.node(node, "Reshape", [scale, col])
    b = ctx.node(node, "Reshape", [bias, col])
    mul = ctx.node(node, "Mul", [view, s.output[0]])
    add = ctx.node(node, "Add", [mul.output[0], b.output[0]])
    out = ctx.node(node, "Reshape", [add.output[0], shape.output[0]], [node.output[0]])
    return nodes + [s, b, mul, add, out]


def decompose_rms_norm(node: onnx.NodeProto, ctx: Context) -> list[onnx.NodeProto]:
    """RMSNormalization (23): x / sqrt(mean(x^2) + eps) * scale, in the stash type (float32 by default)."""
    x, scale = node.input[0], node.input[1]
    eps = float(get_attr(node, "epsilon", 1e-5))
    axes = _axes_from(node, ctx, x, int(get_attr(node, "axis", -1)))
    nodes, xs, xt, ct = _stash(node, ctx, x, int(get_attr(node, "stash_type", 1)))
    sq = ctx.node(node, "Mul", [xs, xs])
    ms = ctx.reduce_mean(node, sq.output[0], axes)
    me = ctx.node(node, "Add", [ms.output[0], ctx.const(eps, ct, "epsilon")])
    rms = ctx.node(node, "Sqrt", [me.output[0]])
    norm = ctx.node(node, "Div", [xs, rms.output[0]])
    nodes += [sq, ms, me, rms, norm]
    y = norm.output[0]
    if ct != xt:
        c = ctx.node(node, "Cast", [y], to=xt)
        nodes.append(c)
        y = c.output[0]
    nodes.append(ctx.node(node, "Mul", [y, scale], [node.output[0]]))
    return nodes


def adapt_layer_norm(node: onnx.NodeProto, ctx: Context) -> list[onnx.NodeProto]:
    """LayerNormalization exists from 17 (and ATC registers it only at 17-18): decompose below."""
    return decompose_layer_norm(node, ctx) if ctx.dst < 17 else [node]


Adapter = Callable[[onnx.NodeProto, Context], list[onnx.NodeProto]]

# op -> (the boundaries the adapter handles, adapter). Boundaries not listed must be types-only.
HANDLERS: dict[str, tuple[tuple[int, ...], Adapter]] = {
    **{op: ((13, 18), adapt_reduce) for op in _REDUCE_OPS},
    "Split": ((13, 18), adapt_split),
    "Squeeze": ((13,), adapt_squeeze),
    "Unsqueeze": ((13,), adapt_squeeze),
    "Pad": ((18, 19), adapt_pad),
    "Resize": ((13, 18, 19), adapt_resize),
    "AveragePool": ((19,), adapt_average_pool),
    "Cast": ((19, 24), adapt_cast),
    "CastLike": ((15, 19, 24), adapt_cast_like),
    "Shape": ((15,), adapt_shape),
    "Reshape": ((14,), adapt_reshape),
    "BatchNormalization": ((14,), adapt_batch_norm),
    "GRU": ((14,), adapt_rnn), "LSTM": ((14,), adapt_rnn), "RNN": ((14,), adapt_rnn),
    "ScatterElements": ((16,), adapt_scatter), "ScatterND": ((16,), adapt_scatter),
    "Softmax": ((13,), adapt_softmax), "LogSoftmax": ((13,), adapt_softmax), "Hardmax": ((13,), adapt_softmax),
    "LayerNormalization": ((17,), adapt_layer_norm),
}

# Ops with no ATC key at any version: always decomposed (also by `lower.decompose_unregistered`).
DECOMPOSE: dict[str, Adapter] = {
    "Gelu": decompose_gelu,
    "GroupNormalization": decompose_group_norm,
    "RMSNormalization": decompose_rms_norm,
}

# What to suggest for ops with no lowering at all.
NO_LOWERING_FIX = {
    "Attention": "let npufuse fuse attention (FusedAttention -> NPU plugin) or export with opset <= 18",
    "RotaryEmbedding": "export with opset <= 18 so rotary embedding stays as standard ops",
    "Loop": "unroll the loop or fold it before export (ATC has no Loop)",
    "Scan": "unroll the scan before export (ATC has no Scan)",
}


def numpy_of(t: onnx.TensorProto) -> np.ndarray | None:
    """The value of a small embedded tensor; None for external data (never read here)."""
    if t.data_location == TensorProto.EXTERNAL:
        return None
    return numpy_helper.to_array(t)
