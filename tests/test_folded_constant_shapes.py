"""A constant folded into an initializer carries its tensor's shape, not the one shape inference could not find.

TorchScript exports of ViT-style models (DINOv2, YOLOS, CaiT) write the class token as `cls_token.expand(B, -1, -1)`
with the target shape computed from constants: onnx shape inference leaves the Expand's dims unknown, normalisation
folds it into a [1, 1, D] initializer, and with the stale unknown dims the embedding Add (class token and patches,
plus position embeddings) could not be proven to match the LayerNorm's other operand, so AddLayerNorm was refused."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import npufuse

D, PATCHES = 8, 4


def _vit_embeddings(shape_from_input: bool) -> onnx.ModelProto:
    """[cls_token.expand(...), patches] + pos -> LayerNorm -> MatMul, as the TorchScript exporter writes it. The Expand's
    shape is TorchScript's Where/Equal/ConstantOfShape arithmetic (constant, not evaluated by shape inference) or,
    for the near miss, read from the input's symbolic batch (a run-time value: nothing to fold)."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((1, 1, D)).astype(np.float32), "cls"),
             numpy_helper.from_array(rng.standard_normal((1, PATCHES + 1, D)).astype(np.float32), "pos"),
             numpy_helper.from_array((1 + 0.1 * rng.standard_normal(D)).astype(np.float32), "gamma"),
             numpy_helper.from_array((0.1 * rng.standard_normal(D)).astype(np.float32), "beta"),
             numpy_helper.from_array(rng.standard_normal((D, D)).astype(np.float32), "w")]
    if shape_from_input:
        shape_nodes = [helper.make_node("Shape", ["x"], ["xs"], start=0, end=1),
                       helper.make_node("Concat", ["xs", "ones_tail"], ["s"], axis=0)]
        inits.append(numpy_helper.from_array(np.array([1, D], np.int64), "ones_tail"))
    else:   # TorchScript's expand(1, -1, -1): Where(Equal(sizes, -1 * ones), ones, sizes), all Constant nodes
        def const(name, values):
            return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.array(values, np.int64)))
        shape_nodes = [const("sizes", [1, -1, -1]), const("rank", [3]), const("minus_one", -1),
                       helper.make_node("ConstantOfShape", ["rank"], ["ones_of_rank"],
                                        value=numpy_helper.from_array(np.array([1], np.int64))),
                       helper.make_node("Mul", ["ones_of_rank", "minus_one"], ["minus_ones"]),
                       helper.make_node("Equal", ["sizes", "minus_ones"], ["keep"]),
                       helper.make_node("Where", ["keep", "ones_of_rank", "sizes"], ["s"])]
    nodes = shape_nodes + [
        helper.make_node("Expand", ["cls", "s"], ["cls_b"]),
        helper.make_node("Concat", ["cls_b", "x"], ["tokens"], axis=1),
        helper.make_node("Add", ["tokens", "pos"], ["emb"]),
        helper.make_node("LayerNormalization", ["emb", "gamma", "beta"], ["ln"], axis=-1, epsilon=1e-6),
        helper.make_node("MatMul", ["ln", "w"], ["y"]),
        helper.make_node("Add", ["y", "emb"], ["out"])]
    batch = "batch" if shape_from_input else 1
    g = helper.make_graph(nodes, "vit_embeddings", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                                  [batch, PATCHES, D])],
                          [helper.make_tensor_value_info("out", TensorProto.FLOAT, [batch, PATCHES + 1, D])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _inferred_dims(model: onnx.ModelProto, name: str) -> list:
    inferred = onnx.shape_inference.infer_shapes(model)
    vi = next(v for v in inferred.graph.value_info if v.name == name)
    return [d.dim_value if d.HasField("dim_value") else None for d in vi.type.tensor_type.shape.dim]


def test_the_folded_class_token_lets_the_embedding_add_fuse_with_its_layernorm(tmp_path):
    model = _vit_embeddings(shape_from_input=False)
    assert _inferred_dims(model, "cls_b")[:2] == [None, None]   # what the exporter's graph leaves to npufuse
    src = tmp_path / "emb.onnx"
    onnx.save(model, str(src))
    r = npufuse.optimize(str(src), output=str(tmp_path / "o.onnx"))
    fused = sum(n for kind, n in r.fused.items() if kind.startswith("AddLayerNorm"))
    assert r.ok and fused == 1, (r.fused, r.near_misses)
    assert not [m for m in r.near_misses if m["reason"] == "residual-shape-unproven"]


def test_a_class_token_expanded_to_the_input_batch_is_not_folded():
    # near miss: the Expand reads the input's batch, so the token is computed at run time (no initializer, no shape
    # made for it), and the position table then broadcasts over the batch: Ascend's AddLayerNorm takes one shape
    model = _vit_embeddings(shape_from_input=True)
    r = npufuse.optimize(model, verify=False)
    assert not [t for t in r.details.model.graph.initializer if t.name == "cls_b"]
    assert not [k for k in r.fused if k.startswith("AddLayerNorm")], r.fused
    assert [m for m in r.near_misses if m["pattern"] == "add_layernorm" and m["reason"] == "operand-broadcast"], \
        r.near_misses
