"""The layer a node lies in, from the names exporters give (reporting.layers): TorchScript scopes, dynamo's
flattened names and its `namespace` metadata; topological blocks where nothing names a layer."""

from __future__ import annotations

import pytest
from onnx import helper

from npufuse.reporting.layers import assign_layers, layer_label, layer_order, region_layer, split_label


@pytest.mark.parametrize("scope, want", [
    ("/m/encoder/layer.3/attention/self/MatMul", ("m.encoder.layer.3", 3)),           # TorchScript BERT
    ("/model/layers.11/self_attn/q_proj/MatMul", ("model.layers.11", 11)),            # TorchScript Llama
    ("/transformer/h.7/mlp/c_fc/Gemm", ("transformer.h.7", 7)),                       # GPT-2
    ("/m/decoder/block.1/layer.2/DenseReluDense/wi/MatMul", ("m.decoder.block.1", 1)),  # T5: the block, not its sublayer
    ("/m/encoder/stages.3/layers.0/layer/layer.1/convolution/Conv", ("m.encoder.stages.3.layers.0", 0)),
    ("node_layers_3_self_attn_q_proj_MatMul", ("layers.3", 3)),                      # dynamo, flattened
    ("node_model_layers_12_mlp_down_proj_MatMul", ("model.layers.12", 12)),
    ("m.encoder.layer.0.attention.self.value", ("m.encoder.layer.0", 0)),            # dynamo namespace scope
])
def test_layer_label(scope: str, want: tuple[str, int]) -> None:
    assert layer_label(scope) == want


@pytest.mark.parametrize("scope", ["/m/embeddings/LayerNormalization", "node_layer_norm_2", "/m/Mul_1",
                                   "/lm_head/MatMul", "node_linear_3", "/m/pooler/dense/Gemm"])
def test_no_layer(scope: str) -> None:
    assert layer_label(scope) is None


def test_dynamo_namespace_metadata_names_the_layer() -> None:
    n = helper.make_node("MatMul", ["a", "b"], ["c"], name="node_MatMul_68")
    p = n.metadata_props.add()
    p.key, p.value = "namespace", (": W/m: BertModel/m.encoder: BertEncoder/m.encoder.layer.1: BertLayer/"
                                   "m.encoder.layer.1.attention.self.value: Linear/linear_2: aten.linear.default")
    labels, source = assign_layers([n], [["node_MatMul_68"]])
    assert (labels, source) == (["m.encoder.layer.1"], "names")


def test_region_layer_by_majority_first_node_on_a_tie() -> None:
    layers = {"a": ("L.layers.3", 3), "b": ("L.layers.4", 4), "c": ("L.layers.4", 4)}
    assert region_layer(["a", "b", "c"], layers) == "L.layers.4"
    assert region_layer(["a", "b"], layers) == "L.layers.3"   # a residual Add of layer 3 + the norm opening 4
    assert region_layer(["x"], layers) is None


def test_layer_order_stacks_then_indices() -> None:
    labelled = [("m.decoder.block.1", 90), ("m.encoder.block.10", 40), ("m.encoder.block.2", 10),
                ("m.decoder.block.0", 60), ("m.encoder.block.2", 5), (None, 0)]
    assert layer_order(labelled) == ["m.encoder.block.2", "m.encoder.block.10", "m.decoder.block.0",
                                     "m.decoder.block.1"]
    assert split_label("m.encoder.block.10") == ("m.encoder.block", 10)
    assert split_label("nodes 000-099") == ("nodes 000-099", None)


def test_topological_blocks_where_no_name_carries_a_layer() -> None:
    nodes = [helper.make_node("Relu", [f"v{i}"], [f"v{i + 1}"], name=f"Relu_{i}") for i in range(120)]
    labels, source = assign_layers(nodes, [["Relu_0", "Relu_1"], ["Relu_119"], ["elsewhere"]])
    assert source == "topological-blocks"
    assert labels == ["nodes 000-009", "nodes 110-119", None]
