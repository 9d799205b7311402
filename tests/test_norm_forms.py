"""LayerNorm / RMSNorm forms beyond the plain residual block (issue 9): embedding LayerNorms after an Add of a
position / token-type table, the residual sum reshaped before the norm, operands whose shapes are equal only
symbolically, fp16 decompositions with Casts around them; and the near-misses: every norm start that is not
fused ends in a Refusal naming the node where matching stopped.

Each positive runs the original and the optimized model on the same inputs (a wrong rewrite changes the outputs)
besides the engine's own per-rewrite and whole-model checks."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from builders import with_output_shapes
from onnx import TensorProto, helper, numpy_helper

from npufuse.fusion.engine import OptimizeOptions, optimize
from npufuse.ir.graph import Graph
from npufuse.algebra.dims import value_dims as _dims
from npufuse.ir.runtime import IR_VERSION, run
from npufuse.verify.compare import compare

H = 16
EPS = 1e-5


class _B:
    """A small graph: nodes in order, constants as initializers."""

    def __init__(self, opset: int = 17, dtype=np.float32, seed: int = 0) -> None:
        self.opset, self.dtype = opset, np.dtype(dtype)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.value_info: list[onnx.ValueInfoProto] = []
        self.rng = np.random.default_rng(seed)
        self.k = 0

    def name(self, base: str) -> str:
        self.k += 1
        return f"{base}{self.k}"

    def input(self, name: str, shape, elem: int | None = None) -> str:
        self.inputs.append(helper.make_tensor_value_info(
            name, elem or helper.np_dtype_to_tensor_dtype(self.dtype), shape))
        return name

    def const(self, value, dtype=None, name: str | None = None) -> str:
        name = name or self.name("c")
        self.inits.append(numpy_helper.from_array(np.asarray(value, dtype=dtype or self.dtype), name))
        return name

    def op(self, op_type: str, *inputs: str, out: str | None = None, **attrs) -> str:
        out = out or self.name(op_type.lower())
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], name=out + "_node", **attrs))
        return out

    def reduce_mean(self, x: str) -> str:
        if self.opset < 18:
            return self.op("ReduceMean", x, axes=[-1], keepdims=1)
        return self.op("ReduceMean", x, self.const(np.array([-1], np.int64), np.int64), keepdims=1)

    def layernorm(self, x: str, exponent: float = 2.0, stats=None, hidden: int = H) -> str:
        """The TorchScript decomposition; with `stats`, x is cast up to it and the normalised value back."""
        t = self.dtype
        if stats is not None:
            x = self.op("Cast", x, to=helper.np_dtype_to_tensor_dtype(np.dtype(stats)))
        sdt = np.dtype(stats) if stats is not None else t
        m = self.reduce_mean(x)
        d = self.op("Sub", x, m)
        v = self.reduce_mean(self.op("Pow", d, self.const(exponent, sdt)))
        n = self.op("Div", d, self.op("Sqrt", self.op("Add", v, self.const(EPS, sdt))))
        if stats is not None:
            n = self.op("Cast", n, to=helper.np_dtype_to_tensor_dtype(t))
        gamma = self.const(1 + 0.3 * self.rng.standard_normal(hidden))
        beta = self.const(0.3 * self.rng.standard_normal(hidden))
        return self.op("Add", self.op("Mul", n, gamma), beta)

    def rmsnorm(self, x: str) -> str:
        s = self.reduce_mean(self.op("Pow", x, self.const(2.0)))
        r = self.op("Sqrt", self.op("Add", s, self.const(EPS)))
        return self.op("Mul", self.op("Div", x, r), self.const(1 + 0.3 * self.rng.standard_normal(H)))

    def model(self, *outputs: str) -> onnx.ModelProto:
        outs = [helper.make_tensor_value_info(o, helper.np_dtype_to_tensor_dtype(self.dtype), None) for o in outputs]
        g = helper.make_graph(self.nodes, "forms", self.inputs, outs, self.inits, value_info=self.value_info)
        return with_output_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", self.opset)],
                                                    ir_version=IR_VERSION))


def _feeds(model: onnx.ModelProto, dims: dict[str, int], seed: int = 3) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {}
    for i in model.graph.input:
        shape = [d.dim_value if d.HasField("dim_value") else dims[d.dim_param] for d in i.type.tensor_type.shape.dim]
        elem = i.type.tensor_type.elem_type
        if elem == TensorProto.INT64:
            feeds[i.name] = rng.integers(0, 7, shape).astype(np.int64)
        else:
            feeds[i.name] = (rng.standard_normal(shape) * 2 + 0.5).astype(helper.tensor_dtype_to_np_dtype(elem))
    return feeds


def _optimize(model: onnx.ModelProto, dims: dict[str, int] | None = None):
    res = optimize(model, options=OptimizeOptions(dims=dims))
    assert not res.rolled_back, res.rolled_back
    assert all(r.check is not None and r.check.ok for r in res.applied)
    assert not res.applied or (res.model_check is not None and res.model_check.ok), res.model_check
    onnx.checker.check_model(res.model, full_check=True)
    feeds = _feeds(model, dims or {})
    want, got = run(model, feeds), run(res.model, feeds)
    for name in want:
        c = compare(name, got[name], want[name])
        assert c.ok, f"{name}: {c.detail}"
    return res


def _ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


def _refusals(res, pattern: str) -> list:
    return [f for f in res.refusals if f.pattern == pattern]


# ---- 1. embedding LayerNorms ----------------------------------------------------------------------------------

def _embedding(pos: str, batch="batch", seq=5) -> tuple[onnx.ModelProto, str]:
    """Gather(word_emb, ids) + position embeddings -> LayerNorm; pos: "table" (a constant [S, H]), "table3" (a
    constant [1, S, H]), "gather" (Gather(pos_emb, position_ids) with position_ids [B, S]), "full" (a constant of
    the sum's own shape, static batch 2)."""
    b = _B()
    ids = b.input("ids", [batch, seq], TensorProto.INT64)
    words = b.op("Gather", b.const(b.rng.standard_normal((7, H)), name="word_emb"), ids)
    if pos == "gather":
        p = b.op("Gather", b.const(b.rng.standard_normal((7, H)), name="pos_emb"),
                 b.input("position_ids", [batch, seq], TensorProto.INT64))
    elif pos == "full":
        p = b.const(b.rng.standard_normal((2, seq, H)), name="pos_table")
    else:
        shape = (seq, H) if pos == "table" else (1, seq, H)
        p = b.const(b.rng.standard_normal(shape), name="pos_table")
    s = b.op("Add", words, p, out="emb_sum")
    return b.model(b.layernorm(s)), s


@pytest.mark.parametrize("pos", ["table", "table3"])
def test_embedding_layernorm_after_a_broadcast_table_fuses_the_norm_and_reports_the_add(pos: str) -> None:
    """A position table that broadcasts over the batch: Ascend's AddLayerNorm takes x2 of x1's shape only, so the
    Add stays, the LayerNorm fuses alone, and the add_layernorm near-miss says why, at the Add."""
    model, s = _embedding(pos)
    res = _optimize(model, {"batch": 2})
    assert _ops(res.model).count("LayerNormalization") == 1 and "ReduceMean" not in _ops(res.model)
    assert "Add" in _ops(res.model) and "AddLayerNorm" not in _ops(res.model)
    (ref,) = _refusals(res, "add_layernorm")
    assert ref.reason == "operand-broadcast" and ref.node == s + "_node"
    assert "pos_table" in ref.detail and "fused alone" in ref.detail


@pytest.mark.parametrize("pos", ["gather", "full"])
def test_embedding_layernorm_with_a_same_shape_operand_is_an_add_layernorm(pos: str) -> None:
    """Gather(pos_emb, position_ids) of the ids' shape, or a constant table of the sum's whole (static) shape:
    x1 and x2 have one shape, so the embedding sum and its LayerNorm are one AddLayerNorm."""
    model, _ = _embedding(pos, batch=2 if pos == "full" else "batch")
    res = _optimize(model, None if pos == "full" else {"batch": 2})
    assert _ops(res.model).count("AddLayerNorm") == 1
    assert "LayerNormalization" not in _ops(res.model) and "Add" not in _ops(res.model)
    assert not _refusals(res, "add_layernorm")


# ---- 2. the residual sum reshaped before the norm -------------------------------------------------------------

def _reshaped(sum_read: str = "none", target=(2, 3, H)) -> onnx.ModelProto:
    """[6, H] + [6, H] -> Reshape [2, 3, H] -> LayerNorm; sum_read: "none", "add" (the [6, H] sum is read by a
    later node), "reshaped" (the [2, 3, H] sum is read), "both" (both are: OPT's TorchScript export reads the Add's
    Shape and feeds the reshaped sum to the next residual)."""
    b = _B()
    a, c = b.input("a", [6, H]), b.input("b", [6, H])
    s = b.op("Add", a, c, out="sum")
    r = b.op("Reshape", s, b.const(np.array(target, np.int64), np.int64), out="sum3")
    y = b.layernorm(r, hidden=target[-1])
    outs = [y]
    if sum_read in ("add", "both"):
        outs.append(b.op("Neg", s, out="side"))
    if sum_read in ("reshaped", "both"):
        outs.append(b.op("Add", r, y, out="side2"))
    return b.model(*outs)


@pytest.mark.parametrize("sum_read", ["none", "add", "reshaped", "both"])
def test_add_reshape_layernorm_fuses_with_the_reshape_after(sum_read: str) -> None:
    res = _optimize(_reshaped(sum_read))
    fused = [n for n in res.model.graph.node if n.op_type == "AddLayerNorm"]
    assert len(fused) == 1 and len(fused[0].output) == (1 if sum_read == "none" else 2)
    assert "LayerNormalization" not in _ops(res.model)
    # Y (and the reshaped sum where it is read) is reshaped after the fused op; a [6, H] sum is its output as is
    assert _ops(res.model).count("Reshape") == (2 if sum_read in ("reshaped", "both") else 1)
    if sum_read in ("add", "both"):
        assert fused[0].output[1] == "sum"
    assert not _refusals(res, "add_layernorm")
    model = _reshaped(sum_read)
    feeds = {i.name: np.random.default_rng(1).standard_normal([6, H]).astype(np.float32) for i in model.graph.input}
    want, got = run(model, feeds), run(res.model, feeds)
    for name in want:
        assert compare(name, got[name], want[name]).ok, name


def test_reshape_that_splits_the_normalised_axis_is_a_near_miss() -> None:
    """[6, H] -> [6, H/2, 2]: the norm is over pairs, not rows of the sum; the norm fuses, the Add is refused."""
    res = _optimize(_reshaped(target=(6, H // 2, 2)))
    assert "AddLayerNorm" not in _ops(res.model) and _ops(res.model).count("LayerNormalization") == 1
    (ref,) = _refusals(res, "add_layernorm")
    assert ref.reason == "reshape-changes-last-axis" and ref.node == "sum3_node" and ref.node in ref.detail


# ---- 3. operands equal only symbolically -------------------------------------------------------------------------

def _symbolic(declared: bool = True, other_input: bool = False) -> onnx.ModelProto:
    """A [batch, seq, H] + B -> LayerNorm, where B = Reshape(MatMul(Reshape(A, [-1, H]), W), Concat(Shape(A)[0],
    Shape(A)[1], H)) is declared with shape inference's made-up names ['unk__3', 'unk__4', H]; or (other_input) B a
    second input with its own names."""
    b = _B()
    a = b.input("A", ["batch", "seq", H])
    if other_input:
        y = b.input("B", ["b2", "s2", H])
    else:
        flat = b.op("Reshape", a, b.const(np.array([-1, H], np.int64), np.int64))
        mm = b.op("MatMul", flat, b.const(b.rng.standard_normal((H, H)) * 0.3))
        shape = b.op("Shape", a)
        dims = [b.op("Unsqueeze", b.op("Gather", shape, b.const(np.array(i, np.int64), np.int64), axis=0),
                     b.const(np.array([0], np.int64), np.int64)) for i in (0, 1)]
        target = b.op("Concat", *dims, b.const(np.array([H], np.int64), np.int64), axis=0)
        y = b.op("Reshape", mm, target, out="B")
        if declared:
            b.value_info.append(helper.make_tensor_value_info("B", TensorProto.FLOAT, ["unk__3", "unk__4", H]))
    s = b.op("Add", a, y, out="residual")
    return b.model(b.layernorm(s))


def test_operands_named_differently_are_proven_equal_through_the_shape_arithmetic() -> None:
    model = _symbolic()
    res = _optimize(model, {"batch": 2, "seq": 3})
    assert _ops(res.model).count("AddLayerNorm") == 1 and not _refusals(res, "add_layernorm")


def test_dims_follow_the_shape_arithmetic() -> None:
    from npufuse.prepare.normalize import normalize

    model, types = normalize(_symbolic())
    g = Graph(model, value_types=types)
    assert g.shape("B") == ("unk__3", "unk__4", H)                    # what shape inference says
    assert _dims(g, "B") == _dims(g, "A") == (("sym", "batch"), ("sym", "seq"), H)


def test_graph_inputs_with_different_dim_names_are_a_near_miss() -> None:
    """'batch' and 'b2' may differ (one of them 1) at run time: not provably one shape; refused, named."""
    res = _optimize(_symbolic(other_input=True), {"batch": 2, "seq": 3, "b2": 2, "s2": 3})
    assert "AddLayerNorm" not in _ops(res.model) and _ops(res.model).count("LayerNormalization") == 1
    (ref,) = _refusals(res, "add_layernorm")
    assert ref.reason == "residual-shape-unproven" and "'batch'" in ref.detail and "'b2'" in ref.detail


# ---- 4. fp16 decompositions with Casts around them --------------------------------------------------------------

@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_fp16_decomposition_fuses(kind: str) -> None:
    b = _B(dtype=np.float16)
    x = b.input("x", [2, 3, H])
    y = b.layernorm(x, stats=np.float32) if kind == "layernorm" else b.rmsnorm(x)
    res = _optimize(b.model(y))
    assert "ReduceMean" not in _ops(res.model) and "Cast" not in _ops(res.model)
    assert not [f for f in res.refusals if f.pattern in ("layernorm", "rmsnorm")]


def test_fp16_wrong_exponent_is_a_near_miss() -> None:
    b = _B(dtype=np.float16)
    y = b.layernorm(b.input("x", [2, 3, H]), exponent=4.0, stats=np.float32)
    res = _optimize(b.model(y))
    assert "ReduceMean" in _ops(res.model)
    ref = next(f for f in _refusals(res, "layernorm") if f.reason == "pow-exponent")
    assert ref.node in ref.detail and "exponent 4" in ref.detail


# ---- coverage: every norm start ends fused or refused -------------------------------------------------------------

def test_centred_value_never_squared_is_a_near_miss() -> None:
    b = _B()
    x = b.input("x", [2, 3, H])
    d = b.op("Sub", x, b.reduce_mean(x))
    y = b.op("Mul", d, b.const(2.0))
    res = _optimize(b.model(y))
    (ref,) = _refusals(res, "layernorm")
    assert ref.reason == "incomplete-chain" and d in ref.detail


def test_rms_without_the_division_is_a_near_miss() -> None:
    b = _B()
    x = b.input("x", [2, 3, H])
    s = b.reduce_mean(b.op("Pow", x, b.const(2.0)))
    r = b.op("Sqrt", b.op("Add", s, b.const(EPS)))
    y = b.op("Add", x, r)                  # x + rms: not a normalisation
    res = _optimize(b.model(y))
    (ref,) = _refusals(res, "rmsnorm")
    assert ref.reason == "incomplete-chain" and ref.node == r + "_node" and "RMSNorm" in ref.detail
