"""Every op npufuse emits is valid and right at the lowest opset npufuse accepts and at the highest onnx knows.

One table holds a case per op and per opset-dependent branch of its function body (the Constant that carries a float
attribute, Erf, Split/Slice/Unsqueeze signatures, the standard op a body uses where the opset has it). Each case is
built at its lowest opset and at the highest, checked by onnx.checker (full_check: schemas and types at that opset),
run by onnxruntime and compared with the op's NumPy reference kernel. Below an op's own lowest opset its body is
refused (ValueError, which the engine reports as a near-miss), never built invalid. The table must name every op the
patterns emit, so a new fused op fails here until its bodies are tested.

The end-to-end half drives decomposed norms, GELUs, activations and epilogues through `optimize` at old opsets.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from test_norms_gelu import gelu_model, layernorm_model, rmsnorm_model

from npufuse import FUSED_DOMAIN
from npufuse.fusion.engine import OptimizeOptions, optimize
from npufuse.patterns import fused_op_defs
from npufuse.patterns.add_norm import add_layer_norm_body, add_rms_norm_body
from npufuse.patterns.base import FLOAT_ATTR_REF_OPSET, MIN_OPSET, is_npufuse_body
from npufuse.patterns.norms import layer_norm_body
from npufuse.ir.runtime import IR_VERSION, run
from npufuse.verify.compare import compare

MAX_OPSET = onnx.defs.onnx_opset_version()
RNG = np.random.default_rng(20)


def _a(*shape: int, dtype=np.float32, scale: float = 1.0) -> np.ndarray:
    return (RNG.standard_normal(shape) * scale).astype(dtype)


@dataclass
class Case:
    op: tuple[str, str]                          # (domain, op_type)
    name: str
    attrs: dict[str, Any]
    inputs: list[tuple[str, np.ndarray | None]]  # in the op's input order; None: an omitted optional input
    outputs: int = 1
    min_opset: int = MIN_OPSET                   # below it the body is refused
    body: Callable[[dict, int, int], onnx.FunctionProto] | None = None   # a variant FusedOpDef.make_node cannot pick
    max_opset: int = MAX_OPSET
    notes: dict[str, Any] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return f"{self.op[1]}-{self.name}"


X3, H = (2, 3, 8), 8
ATTN = dict(B=2, H=4, G=2, S=5, D=8)


def _attention_inputs(kv: int, mask: bool, bool_mask: bool) -> list[tuple[str, np.ndarray | None]]:
    b, h, s, d = ATTN["B"], ATTN["H"], ATTN["S"], ATTN["D"]
    ins: list[tuple[str, np.ndarray | None]] = [("q", _a(b, h, s, d)), ("k", _a(b, kv, s, d)), ("v", _a(b, kv, s, d))]
    ins.append(("m", np.where(RNG.random((b, 1, s, s)) < 0.7, 0.0, -1e4).astype(np.float32) if mask else None))
    if bool_mask:
        ins.append(("bm", RNG.random((b, 1, 1, s)) < 0.6))
    return ins


def _mla_case() -> Case:
    b, s, hid, rq, rkv, n, dn, dr = 2, 3, 16, 12, 8, 2, 4, 4
    attrs = {"num_heads": n, "qk_nope_head_dim": dn, "qk_rope_head_dim": dr, "kv_lora_rank": rkv,
             "epsilon_cq": 1e-3, "epsilon_ckv": 1e-2, "interleaved": 0}
    shapes = {"X": (b, s, hid), "W_dq": (hid, rq), "gamma_cq": (rq,), "W_uq_qr": (rq, n * (dn + dr)),
              "W_dkv_kr": (hid, rkv + dr), "gamma_ckv": (rkv,), "cos": (1, 1, s, dr), "sin": (1, 1, s, dr)}
    return Case(("npufuse", "MlaProlog"), "half", attrs, [(k, _a(*v)) for k, v in shapes.items()], outputs=4,
                min_opset=13)


def _cases() -> list[Case]:
    ln = ("npufuse", "LayerNorm")
    rms = ("npufuse", "RMSNorm")
    mm = ("npufuse", "FusedMatMul")
    cases = [
        Case(ln, "f32", {"epsilon": 1e-3, "stash_type": 1}, [("x", _a(*X3)), ("g", _a(H)), ("b", _a(H))]),
        Case(ln, "f16-stash-f32", {"epsilon": 1e-2, "stash_type": 1},
             [("x", _a(*X3, dtype=np.float16)), ("g", _a(H, dtype=np.float16)), ("b", _a(H, dtype=np.float16))]),
        Case(ln, "no-beta", {"epsilon": 1e-3, "stash_type": 1}, [("x", _a(*X3)), ("g", _a(H))],
             body=lambda a, o, e: layer_norm_body(a, o, e, has_beta=False)),
        Case(ln, "default-epsilon", {"stash_type": 1}, [("x", _a(*X3)), ("g", _a(H)), ("b", _a(H))]),
        Case(rms, "f32", {"epsilon": 1e-3, "stash_type": 1}, [("x", _a(*X3)), ("g", _a(H))]),
        Case(rms, "f16-stash-f32", {"epsilon": 1e-2, "stash_type": 1},
             [("x", _a(*X3, dtype=np.float16)), ("g", _a(H, dtype=np.float16))]),
        Case(("", "LayerNormalization"), "std", {"axis": -1, "epsilon": 1e-3},
             [("x", _a(*X3)), ("g", _a(H)), ("b", _a(H))], min_opset=17),
        Case(("", "RMSNormalization"), "std", {"axis": -1, "epsilon": 1e-3}, [("x", _a(*X3)), ("g", _a(H))],
             min_opset=23),
        Case(("", "Gelu"), "std", {"approximate": "tanh"}, [("x", _a(*X3, scale=3))], min_opset=20),
        Case(("npufuse", "Gelu"), "none", {"approximate": "none"}, [("x", _a(*X3, scale=3))], min_opset=9),
        Case(("npufuse", "Gelu"), "tanh", {"approximate": "tanh"}, [("x", _a(*X3, scale=3))]),
        Case(("npufuse", "Gelu"), "quick", {"approximate": "quick"}, [("x", _a(*X3, scale=3))]),
        Case(("npufuse", "AddLayerNorm"), "beta-sum", {"epsilon": 1e-3, "stash_type": 1},
             [("a", _a(*X3)), ("r", _a(*X3)), ("g", _a(H)), ("b", _a(H))], outputs=2),
        Case(("npufuse", "AddLayerNorm"), "nobeta-y", {"epsilon": 1e-2, "stash_type": 1},
             [("a", _a(*X3)), ("r", _a(*X3)), ("g", _a(H))],
             body=lambda a, o, e: add_layer_norm_body(a, o, e, has_beta=False, with_sum=False)),
        Case(("npufuse", "AddRMSNorm"), "sum", {"epsilon": 1e-3, "stash_type": 1},
             [("a", _a(*X3)), ("r", _a(*X3)), ("g", _a(H))], outputs=2),
        Case(("npufuse", "AddRMSNorm"), "y", {"epsilon": 1e-2, "stash_type": 1},
             [("a", _a(*X3)), ("r", _a(*X3)), ("g", _a(H))],
             body=lambda a, o, e: add_rms_norm_body(a, o, e, with_sum=False)),
        Case(("npufuse", "RotaryEmbedding"), "half", {"interleaved": 0, "rotary_dim": 0},
             [("x", _a(2, 2, 5, 8)), ("cos", _a(1, 1, 5, 8)), ("sin", _a(1, 1, 5, 8))]),
        Case(("npufuse", "RotaryEmbedding"), "half-partial", {"interleaved": 0, "rotary_dim": 4},
             [("x", _a(2, 2, 5, 8)), ("cos", _a(1, 1, 5, 4)), ("sin", _a(1, 1, 5, 4))]),
        Case(("npufuse", "RotaryEmbedding"), "interleaved", {"interleaved": 1, "rotary_dim": 0},
             [("x", _a(2, 2, 5, 8)), ("cos", _a(1, 1, 5, 8)), ("sin", _a(1, 1, 5, 8))], min_opset=10),
        Case(("npufuse", "RotaryEmbeddingPair"), "half", {"interleaved": 0, "rotary_dim": 0},
             [("q", _a(2, 4, 5, 8)), ("k", _a(2, 2, 5, 8)), ("cos", _a(1, 1, 5, 8)), ("sin", _a(1, 1, 5, 8))],
             outputs=2),
        Case(("npufuse", "RotaryEmbeddingPair"), "interleaved-partial", {"interleaved": 1, "rotary_dim": 4},
             [("q", _a(2, 4, 5, 8)), ("k", _a(2, 2, 5, 8)), ("cos", _a(1, 1, 5, 4)), ("sin", _a(1, 1, 5, 4))],
             outputs=2, min_opset=10),
        Case(("npufuse", "FusedAttention"), "gqa-mask",
             dict(scale=0.37, num_heads=4, kv_num_heads=2, mask_order="add", q_layout="BNSD", k_layout="BNSD",
                  v_layout="BNSD", out_layout="BNSD"), _attention_inputs(2, True, False), min_opset=13),
        Case(("npufuse", "FusedAttention"), "causal-bool",
             dict(scale=0.5, causal=1, num_heads=4, kv_num_heads=4, mask_order="where", mask_fill=-1e9,
                  q_layout="BNSD", k_layout="BNSD", v_layout="BNSD", out_layout="BSND"),
             _attention_inputs(4, False, False), min_opset=13),
        Case(("npufuse", "FusedAttention"), "bool-mask",
             dict(scale=0.5, num_heads=4, kv_num_heads=4, mask_order="where", mask_fill=-1e9, bool_mask_mode="keep"),
             _attention_inputs(4, False, True), min_opset=13),
        _mla_case(),
    ]
    for act, params in [("Relu", {}), ("Clip", {"min": 0.0, "max": 6.0}), ("LeakyRelu", {"alpha": 0.2}),
                        ("HardSigmoid", {"alpha": 0.3, "beta": 0.6}), ("HardSwish", {}), ("Silu", {})]:
        cases.append(Case(("npufuse", "FusedConv"), act, dict(group=2, strides=[2, 1], pads=[1, 0, 1, 2],
                                                                 activation=act, **params),
                          [("x", _a(2, 4, 6, 5, scale=3)), ("w", _a(6, 2, 3, 3)), ("b", _a(6))]))
    # the GELU epilogue: ONNX's Gelu from opset 20 (none, tanh), below it npufuse.Gelu's decomposition (erf: 9 up);
    # quick is always the decomposition
    for approximate, lowest in (("none", 9), ("tanh", MIN_OPSET), ("quick", MIN_OPSET)):
        cases.append(Case(("npufuse", "FusedConv"), f"gelu-{approximate}",
                          dict(group=2, pads=[1, 0, 1, 2], activation="Gelu", approximate=approximate),
                          [("x", _a(2, 4, 6, 5, scale=3)), ("w", _a(6, 2, 3, 3)), ("b", _a(6))], min_opset=lowest))
    cases.append(Case(("npufuse", "FusedConv"), "affine-residual-gelu-f16",
                      dict(pads=[1, 1, 1, 1], affine=1, residual=1, activation="Gelu", approximate="none"),
                      [("x", _a(1, 4, 5, 5, dtype=np.float16, scale=2)), ("w", _a(6, 4, 3, 3, dtype=np.float16)),
                       ("b", _a(6, dtype=np.float16)), ("z", _a(1, 6, 5, 5, dtype=np.float16)),
                       ("s", RNG.uniform(0.5, 2.0, (6, 1, 1)).astype(np.float32)), ("t", _a(6, 1, 1))], min_opset=9))
    cases.append(Case(("npufuse", "FusedConv"), "residual-relu", dict(activation="Relu", residual=1),
                      [("x", _a(2, 4, 6, 5)), ("w", _a(6, 4, 1, 1)), ("b", _a(6)), ("z", _a(2, 6, 6, 5))]))
    # fp16 models: the BatchNorm kept as a float32 per-channel epilogue (affine=1), alone, with an activation,
    # and before a residual add
    f16 = np.float16
    for name, extra, z in [("affine", {}, None), ("affine-silu", {"activation": "Silu"}, None),
                           ("affine-residual-relu", {"activation": "Relu", "residual": 1}, _a(1, 6, 5, 5, dtype=f16))]:
        cases.append(Case(("npufuse", "FusedConv"), name, dict(pads=[1, 1, 1, 1], affine=1, **extra),
                          [("x", _a(1, 4, 5, 5, dtype=f16, scale=2)), ("w", _a(6, 4, 3, 3, dtype=f16)),
                           ("b", _a(6, dtype=f16)), ("z", z), ("s", RNG.uniform(0.5, 2.0, (6, 1, 1)).astype(np.float32)),
                           ("t", _a(6, 1, 1))]))
    for act in ("silu", "gelu", "gelu_tanh", "relu"):
        k, n = 8, 6
        cases.append(Case(("npufuse", "GatedMLP"), f"{act}-separate-bias", {"activation": act, "merged": 0, "has_bias": 1},
                          [("x", _a(2, 3, k)), ("wg", _a(k, n)), ("wu", _a(k, n)), ("bg", _a(n)), ("bu", _a(n))],
                          min_opset=9 if act == "gelu" else MIN_OPSET))
        cases.append(Case(("npufuse", "GatedMLP"), f"{act}-merged", {"activation": act, "merged": 1, "gate_first": 0,
                                                                      "has_bias": 0},
                          [("x", _a(2, 3, k)), ("w", _a(k, 2 * n))], min_opset=9 if act == "gelu" else MIN_OPSET))
    k, n = 8, 6
    mm_ins = [("a", _a(2, 3, k)), ("w", _a(k, n)), ("bias", _a(n)), ("g", _a(n)), ("beta", _a(n))]
    for steps in (["bias", "layernorm"], ["bias", "gelu"], ["gelu_tanh", "rmsnorm"], ["relu"], ["silu"], ["tanh"],
                  ["sigmoid"], ["quick_gelu"], ["bias", "gelu", "layernorm"]):
        cases.append(Case(mm, "+".join(steps), {"epilogue": steps, "epsilon": 1e-3}, mm_ins,
                          min_opset=9 if "gelu" in steps else MIN_OPSET))
    half = [(nm, a.astype(np.float16)) for nm, a in mm_ins]
    cases.append(Case(mm, "f16-layernorm", {"epilogue": ["bias", "layernorm"], "epsilon": 1e-2}, half))
    cases.append(Case(("npufuse", "Silu"), "f32", {}, [("x", _a(2, 3, 8, scale=3))]))
    gn_ins = [("x", _a(2, 8, 3, 5, scale=2)), ("scale", _a(8)), ("bias", _a(8))]
    cases += [Case(("npufuse", "GroupNorm"), "f32", {"num_groups": 4, "epsilon": 1e-2}, gn_ins, min_opset=9),
              Case(("npufuse", "GroupNormSilu"), "f32-3d", {"num_groups": 2, "epsilon": 0.3},
                   [("x", _a(2, 8, 7, scale=2)), ("scale", _a(8)), ("bias", _a(8))], min_opset=9),
              Case(("npufuse", "GroupNormSilu"), "f16", {"num_groups": 8, "epsilon": 1e-5},
                   [(nm, a.astype(np.float16)) for nm, a in gn_ins], min_opset=9)]
    moe = ("npufuse", "MoeGatingTopKSoftmax")    # TopK's k an attribute before 10, ReduceSum's axes before 13
    moe_x = _a(6, 8, scale=2)
    cases += [Case(moe, "f32", {"k": 2, "renormalize": 0}, [("x", moe_x)], outputs=2),
              Case(moe, "f32-renorm-3d", {"k": 3, "renormalize": 1}, [("x", _a(2, 3, 8, scale=2))], outputs=2),
              Case(moe, "f16-renorm", {"k": 2, "renormalize": 1}, [("x", moe_x.astype(np.float16))], outputs=2)]
    return cases


CASES = _cases()


def _model(case: Case, opset: int) -> tuple[onnx.ModelProto, dict[str, np.ndarray], list[np.ndarray]]:
    d = fused_op_defs()[case.op]
    names = [n if a is not None else "" for n, a in case.inputs]
    while names and not names[-1]:
        names.pop()
    arrays = [a for _, a in case.inputs]
    elem = helper.np_dtype_to_tensor_dtype(arrays[0].dtype)
    outs = [f"y{i}" for i in range(case.outputs)]
    node, fn = d.make_node(names, outs, "n", case.attrs, opset, elem)
    if case.body is not None:
        fn = case.body(case.attrs, opset, elem)
        node.overload = fn.overload
    want = d.reference(arrays, case.attrs)[:case.outputs]
    feeds = {n: a for n, a in case.inputs if a is not None}
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
                      for n, a in feeds.items()],
        [helper.make_tensor_value_info(o, helper.np_dtype_to_tensor_dtype(w.dtype), w.shape)
         for o, w in zip(outs, want)])
    imports = [helper.make_opsetid("", opset)] + ([helper.make_opsetid(FUSED_DOMAIN, 1)] if d.domain else [])
    model = helper.make_model(graph, opset_imports=imports, functions=[fn] if fn is not None else [],
                              ir_version=IR_VERSION)
    return model, feeds, want


def test_the_table_covers_every_fused_op() -> None:
    assert {c.op for c in CASES} == set(fused_op_defs())


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("end", ["lowest", "highest"])
def test_body_is_valid_and_matches_the_reference(case: Case, end: str) -> None:
    opset = max(case.min_opset, MIN_OPSET) if end == "lowest" else case.max_opset
    model, feeds, want = _model(case, opset)
    onnx.checker.check_model(model, full_check=True)
    # npufuse knows its own bodies again by their stamp (an optimized model optimized again; fusion.admit)
    assert all(is_npufuse_body(f) for f in model.functions)
    got = run(model, feeds)
    for i, w in enumerate(want):
        c = compare(f"y{i}", got[f"y{i}"], w)
        assert c.ok, (opset, c.detail)


@pytest.mark.parametrize("case", [c for c in CASES if c.min_opset > MIN_OPSET and c.op[0] == FUSED_DOMAIN],
                         ids=lambda c: c.id)
def test_below_its_lowest_opset_a_body_is_refused_not_built_invalid(case: Case) -> None:
    with pytest.raises(ValueError, match="opset"):
        _model(case, case.min_opset - 1)


@pytest.mark.parametrize("op", [("npufuse", "LayerNorm"), ("npufuse", "FusedMatMul"), ("npufuse", "AddRMSNorm")])
def test_a_float_attribute_is_baked_into_distinct_bodies_only_where_it_cannot_be_forwarded(op) -> None:
    """Below opset 12 the epsilon is a constant of the body, so nodes with different epsilons must get different
    overloads (the model holds one body per overload); from 12 one forwarded body serves them all."""
    d = fused_op_defs()[op]
    base = {"epilogue": ["layernorm"]} if op[1] == "FusedMatMul" else {"stash_type": 1}
    names = ["x", "w", "", "g", "b"] if op[1] == "FusedMatMul" else ["x", "r", "g"]
    for opset, distinct in ((FLOAT_ATTR_REF_OPSET - 1, True), (FLOAT_ATTR_REF_OPSET, False)):
        fns = [d.make_node(names, ["y"], "n", {**base, "epsilon": eps}, opset, TensorProto.FLOAT)[1]
               for eps in (1e-5, 1e-2)]
        assert (fns[0].overload != fns[1].overload) == distinct, (opset, fns[0].overload, fns[1].overload)
        if distinct:
            consts = [n for f in fns for n in f.node if n.op_type == "Constant" and n.attribute[0].name == "value"
                      and n.attribute[0].t.data_type == TensorProto.FLOAT and not n.attribute[0].t.dims]
            assert len(consts) >= 2


def test_two_epsilons_in_one_old_opset_model_each_get_their_own() -> None:
    """Two LayerNorms of different epsilon in one opset-11 model, each bound to its own body, both exact."""
    from npufuse.patterns.norms import NPU_LAYER_NORM
    x, g, b = _a(2, 3, 8) * 1e-2, _a(8), _a(8)   # small x: epsilon matters
    nodes, fns, want = [], {}, []
    for i, eps in enumerate((1e-5, 1e-2)):
        node, fn = NPU_LAYER_NORM.make_node(["x", "g", "b"], [f"y{i}"], f"ln{i}", {"epsilon": eps, "stash_type": 1},
                                            11, TensorProto.FLOAT)
        nodes.append(node)
        fns[fn.overload] = fn
        want.append(NPU_LAYER_NORM.reference([x, g, b], {"epsilon": eps})[0])
    assert len(fns) == 2
    feeds = {"x": x, "g": g, "b": b}
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(k, TensorProto.FLOAT, v.shape)
                                           for k, v in feeds.items()],
                              [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, w.shape)
                               for i, w in enumerate(want)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11), helper.make_opsetid(FUSED_DOMAIN, 1)],
                              functions=list(fns.values()), ir_version=IR_VERSION)
    onnx.checker.check_model(model, full_check=True)
    got = run(model, feeds)
    assert not np.allclose(want[0], want[1], atol=1e-3)      # the two epsilons really give different results
    for i, w in enumerate(want):
        c = compare(f"y{i}", got[f"y{i}"], w)
        assert c.ok, c.detail


# ---- end to end: decomposed graphs at old opsets through optimize ---------------------------------------------

@pytest.mark.parametrize("opset", [MIN_OPSET, 9, 11])
@pytest.mark.parametrize("build,fused", [(layernorm_model, "LayerNorm"), (rmsnorm_model, "RMSNorm"),
                                         (gelu_model, "Gelu")], ids=["layernorm", "rmsnorm", "gelu"])
def test_old_opset_models_fuse_into_valid_verified_models(build, fused: str, opset: int) -> None:
    if build is gelu_model and opset < 9:
        pytest.skip("the exact GELU needs Erf (opset 9): no such graph exists below it")
    model = build(opset)
    res = optimize(model, options=OptimizeOptions())
    assert [n.op_type for n in res.model.graph.node if n.domain == FUSED_DOMAIN] == [fused]
    onnx.checker.check_model(res.model, full_check=True)
    assert res.model_check is not None and res.model_check.ok
