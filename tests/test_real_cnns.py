"""Conv+BN+activation on real exported CNNs: the onnx model zoo's light models and transformers exports."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from npufuse.fusion.engine import OptimizeOptions, optimize
from npufuse.ir.graph import Graph
from npufuse.ir.modelio import load_model
from npufuse.ir.runtime import run

FIXTURES = Path(__file__).parent / "fixtures"


def _counts(model: onnx.ModelProto) -> Counter:
    return Counter(n.op_type for n in model.graph.node)


def _fused_activations(model: onnx.ModelProto) -> Counter:
    return Counter(helper.get_attribute_value(a).decode() for n in model.graph.node if n.op_type == "FusedConv"
                   for a in n.attribute if a.name == "activation")


# FusedConv with a Relu: since issue 9 the residual Sum/Add -> Relu of each block joins its conv too (ResNet-50: 33
# Conv->BN->Relu + 16 Conv->BN->Sum->Relu; ShuffleNet: 17 + 13 stride-1 units), so only the convs with nothing after
# their BN (the other operand of a downsample Add, ShuffleNet's group convs) stay plain Convs.
@pytest.mark.parametrize("name,bn,fused_relu", [("light_resnet50", 53, 49), ("light_shufflenet", 49, 30)])
def test_light_models_fuse_every_batchnorm(light_dir: Path, name: str, bn: int, fused_relu: int) -> None:
    """Structure only: these models' weights are all 0.02, so their outputs cannot tell a right fold from a
    wrong one; the numerics are proven on the same graphs with random weights below."""
    path = light_dir / f"{name}.onnx"
    model = load_model(path)
    assert _counts(model)["BatchNormalization"] == bn
    res = optimize(model, str(light_dir), OptimizeOptions())
    after = _counts(res.model)
    assert after["BatchNormalization"] == 0
    assert _fused_activations(res.model) == Counter({"Relu": fused_relu})
    assert after["Conv"] == bn - fused_relu  # Conv->BN with no activation after it: folded, plain Conv
    assert all(r.check.ok for r in res.applied) and len(res.applied) == bn


def _randomize_weights(model: onnx.ModelProto, seed: int = 0) -> onnx.ModelProto:
    """The light models' weights are all 0.02 (ConstantOfShape), so their outputs are flat and would hide
    a wrong fold. Give every ConstantOfShape weight seeded random values of a sensible scale instead."""
    rng = np.random.default_rng(seed)
    g = Graph(model)
    new_inits, keep = [], []
    for n in model.graph.node:
        if n.op_type != "ConstantOfShape":
            keep.append(n)
            continue
        shape = tuple(int(d) for d in g.constant(n.input[0]))
        out = n.output[0]
        if out.endswith("_riv_0"):
            arr = rng.uniform(0.5, 1.5, shape)
        elif out.endswith("_s_0") or out.endswith("sc_w_0") or out.endswith("_scale_0"):
            arr = rng.uniform(0.5, 1.0, shape)
        elif out.endswith("_var_0"):
            arr = rng.uniform(0.5, 1.5, shape)
        elif out.endswith("_w_0") and len(shape) == 4:
            arr = rng.standard_normal(shape) * np.sqrt(1.0 / np.prod(shape[1:]))
        else:
            arr = rng.standard_normal(shape) * 0.1
        new_inits.append(numpy_helper.from_array(arr.astype(np.float32), out))
    del model.graph.node[:]
    model.graph.node.extend(keep)
    model.graph.initializer.extend(new_inits)
    return model


@pytest.mark.parametrize("name", ["light_resnet50", "light_shufflenet", "light_inception_v2"])
def test_light_models_with_random_weights_match_before_softmax(light_dir: Path, name: str) -> None:
    model = _randomize_weights(load_model(light_dir / f"{name}.onnx"))
    gemm = next(n for n in model.graph.node if n.op_type == "Gemm")
    model.graph.output.append(helper.make_tensor_value_info(gemm.output[0], onnx.TensorProto.FLOAT, [1, 1000]))
    res = optimize(model, str(light_dir), OptimizeOptions())
    assert _counts(res.model)["BatchNormalization"] == 0
    assert res.model_check.ok, res.model_check.reason
    logits = next(c for c in res.model_check.comparisons if c.name == gemm.output[0])
    assert logits.max_abs_err > 0  # real arithmetic happened: a fold that changed nothing would be 0
    assert logits.min_passing_rtol <= 1e-4
    # Independently of npufuse's own check: the logits agree within 1e-4 relative to their scale, and a
    # wrong fold would not (the logits vary with the input: they are not a constant vector).
    inits = {t.name for t in model.graph.initializer}
    image = next(i.name for i in model.graph.input if i.name not in inits)
    feeds = {image: np.random.default_rng(5).standard_normal((1, 3, 224, 224)).astype(np.float32)}
    want = run(model, feeds, [gemm.output[0]])[gemm.output[0]]
    got = run(res.model, feeds, [gemm.output[0]])[gemm.output[0]]
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
    assert want.std() > 1e-3 * np.abs(want).max()


@pytest.mark.parametrize("file,act", [
    ("resnet_ts14.onnx", "Relu"), ("resnet_ts17.onnx", "Relu"), ("resnet_dynamo.onnx", "Relu"),
    ("mobilenetv2_ts14.onnx", "Clip"), ("mobilenetv2_ts17.onnx", "Clip"), ("mobilenetv2_dynamo.onnx", "Clip"),
    # dynamo without its own optimizer: BN kept, zero conv biases as Expand(CastLike(0, x), Shape(W)) and
    # Clip bounds as CastLike(6, x); normalisation folds those, so everything fuses as in the TorchScript form
    ("resnet_dynamo_noopt.onnx", "Relu"), ("mobilenetv2_dynamo_noopt.onnx", "Clip"),
])
def test_transformers_cnn_exports(file: str, act: str) -> None:
    model = load_model(FIXTURES / file)
    before = _counts(model)
    res = optimize(model, str(FIXTURES), OptimizeOptions())
    after = _counts(res.model)
    assert after["BatchNormalization"] == 0
    fused = _fused_activations(res.model)
    assert set(fused) == {act}
    # Every activation that directly follows a conv (after BN or not) is now an epilogue.
    n_act = before[act]
    assert fused[act] == n_act - after[act]
    assert fused[act] > 0
    if before["BatchNormalization"]:
        assert len(res.applied) == before["BatchNormalization"]
    assert res.model_check.ok
    for c in res.model_check.comparisons:
        assert c.min_passing_rtol <= 1e-4
        # Folding BN changes the arithmetic, so a real fold shows a (tiny) difference. The dynamo exporter
        # already folded BN itself; fusing Conv + activation alone is bit-exact.
        assert (c.max_abs_err > 0) == (before["BatchNormalization"] > 0)


def test_light_inception_v2_folds_bn_and_channel_affine(light_dir: Path) -> None:
    """Its exporter wrote Conv -> BN -> Mul(scale) -> Add(shift) -> Relu: all of it is one FusedConv."""
    model = load_model(light_dir / "light_inception_v2.onnx")
    res = optimize(model, str(light_dir), OptimizeOptions())
    assert _counts(res.model)["BatchNormalization"] == 0
    assert _fused_activations(res.model) == Counter({"Relu": 69})
    assert _counts(res.model)["Mul"] == 0 and _counts(res.model)["Add"] == 0
    assert res.model_check.ok


# Every light model in the onnx wheel: name -> (BatchNormalization left, FusedConv produced; ResNet-50 and ShuffleNet
# count their residual Add/Sum + Relu FusedConvs since issue 9). DenseNet's
# BNs sit before their convs (BN -> Relu -> Conv, pre-activation), so 62 of its 121 have no conv to fold into.
LIGHT_EXPECTED = {"light_bvlc_alexnet": (0, 5), "light_densenet121": (62, 59), "light_inception_v1": (0, 57),
                  "light_inception_v2": (0, 69), "light_resnet50": (0, 49), "light_shufflenet": (0, 30),
                  "light_squeezenet": (0, 26), "light_vgg19": (0, 16), "light_zfnet512": (0, 5)}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(LIGHT_EXPECTED))
def test_every_light_model(light_dir: Path, name: str) -> None:
    bn_left, fused = LIGHT_EXPECTED[name]
    res = optimize(load_model(light_dir / f"{name}.onnx"), str(light_dir), OptimizeOptions())
    assert _counts(res.model)["BatchNormalization"] == bn_left
    assert _counts(res.model)["FusedConv"] == fused
    assert not res.rolled_back
    assert res.model_check.ok


@pytest.mark.parametrize("file", ["mlp_bn_ts14.onnx", "mlp_bn_ts17.onnx", "mlp_bn_dynamo_noopt.onnx"])
def test_linear_batchnorm1d_exports(file: str) -> None:
    """Linear -> BatchNorm1d -> ReLU (x2) -> Linear -> BatchNorm1d, as torch exports it: Gemm -> BN -> Relu.
    Every BN folds into its Gemm; the Gemm's bias and the Relu then become a FusedMatMul epilogue."""
    res = optimize(load_model(FIXTURES / file), str(FIXTURES), OptimizeOptions())
    assert _counts(res.model) == Counter({"FusedMatMul": 2, "Gemm": 1})
    # two of the three BN-folded Gemms are then taken into the FusedMatMuls: counted there, once
    assert res.applied_by_kind() == Counter({"Gemm(BN folded)": 1, "FusedMatMul[bias,relu]": 2})
    assert res.absorbed_by_kind() == Counter({"Gemm(BN folded)": 2})
    assert res.model_check.ok
    assert all(0 < c.max_abs_err and c.min_passing_rtol <= 1e-4 for c in res.model_check.comparisons)
