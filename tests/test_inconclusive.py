"""A check that cannot check says so (issue 12, item 5): the reference NaN/inf on npufuse's own inputs, or empty
outputs, is inconclusive (optimize writes nothing, exit 2 with what to do), never drift (exit 1)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from npufuse.cli import main
from npufuse.fusion.engine import OptimizeOptions, optimize
from npufuse.verify.compare import Verdict, compare


def _gelu_then_layernorm(eps: float, seq: int | str = "seq") -> onnx.ModelProto:
    """x -> MatMul + bias + GELU (fuses, checked on finite activations) -> a decomposed LayerNorm with epsilon
    `eps` (not fused: a negative epsilon is refused) -> y. eps = -5 makes every row NaN."""
    rng = np.random.default_rng(0)
    h, f = 16, 32
    c = {"w": rng.standard_normal((h, f)) * 0.3, "b": rng.standard_normal(f) * 0.1, "half": np.array(0.5),
         "one": np.array(1.0), "sqrt2": np.array(np.sqrt(2.0)), "gamma": np.ones(f), "beta": np.zeros(f),
         "eps": np.array(eps), "two": np.array(2.0)}
    n = helper.make_node
    nodes = [n("MatMul", ["x", "w"], ["mm"]), n("Add", ["mm", "b"], ["hb"]), n("Div", ["hb", "sqrt2"], ["hs"]),
             n("Erf", ["hs"], ["e"]), n("Add", ["e", "one"], ["e1"]), n("Mul", ["hb", "e1"], ["g0"]),
             n("Mul", ["g0", "half"], ["x2"]), n("ReduceMean", ["x2"], ["mu"], axes=[-1]), n("Sub", ["x2", "mu"], ["xc"]),
             n("Pow", ["xc", "two"], ["sq"]), n("ReduceMean", ["sq"], ["var"], axes=[-1]), n("Add", ["var", "eps"], ["ve"]),
             n("Sqrt", ["ve"], ["sd"]), n("Div", ["xc", "sd"], ["xn"]), n("Mul", ["xn", "gamma"], ["xg"]),
             n("Add", ["xg", "beta"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", seq, h])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", seq, f])],
                          [numpy_helper.from_array(v.astype(np.float32), k) for k, v in c.items()])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def test_a_non_finite_reference_is_inconclusive_not_drift() -> None:
    res = optimize(_gelu_then_layernorm(-5.0), None, OptimizeOptions())
    assert res.applied and all(r.check.ok for r in res.applied)   # the rewrites saw finite activations
    assert not res.ok and res.inconclusive
    assert "NaN or inf on the generated inputs" in res.model_check.reason and "y" in res.model_check.reason


def test_optimize_cli_says_inconclusive_exit_2_and_writes_nothing(tmp_path: Path) -> None:
    """Before: 'the optimized model drifts from the original', exit 1."""
    src, out = tmp_path / "m.onnx", tmp_path / "m.opt.onnx"
    onnx.save(_gelu_then_layernorm(-5.0), src)
    r = CliRunner().invoke(main, ["optimize", str(src), "-o", str(out)])
    assert r.exit_code == 2, r.output
    err = [ln for ln in r.output.splitlines() if ln.startswith("npufuse: error:")]
    assert len(err) == 1 and "inconclusive" in err[0] and "y: 100% of the reference is NaN" in err[0]
    assert "--dim" in err[0] and "drifts" not in r.output and "INCONCLUSIVE" in r.output
    assert not out.exists()


def test_check_cli_says_inconclusive_exit_2(tmp_path: Path) -> None:
    src = tmp_path / "m.onnx"
    onnx.save(_gelu_then_layernorm(-5.0), src)
    r = CliRunner().invoke(main, ["check", str(src), str(src)])
    assert r.exit_code == 2 and "INCONCLUSIVE" in r.output and "DRIFT" not in r.output, r.output


def test_a_real_drift_next_to_nan_is_still_drift() -> None:
    want = np.array([1.0, np.nan, 2.0], np.float32)
    v = Verdict.of([compare("y", np.array([1.0, 5.0, 3.0], np.float32), want)])
    assert not v.ok and not v.inconclusive                 # 2 vs 3 is drift, whatever the NaN
    v = Verdict.of([compare("y", np.array([1.0, 5.0, 2.0], np.float32), want)])
    assert not v.ok and v.inconclusive                     # only the undefined element differs
    v = Verdict.of([compare("y", np.array([np.nan, np.nan, 2.0], np.float32), want)])
    assert not v.ok and not v.inconclusive                 # NaN where the reference is defined: drift


def test_a_dim_fixed_at_zero_checks_nothing_and_says_so() -> None:
    """Before: the rewrite 'verified' on empty tensors and was applied."""
    res = optimize(_gelu_then_layernorm(1e-5, seq=0), None, OptimizeOptions())
    assert not res.applied and res.rolled_back
    assert all("inconclusive" in r.reason and "nothing compared" in r.reason for r in res.rolled_back)


def test_a_symbolic_past_dim_is_at_least_one() -> None:
    """The default for a `past` dim was 0: everything reading it verified on empty tensors."""
    res = optimize(_gelu_then_layernorm(1e-5, seq="past"), None, OptimizeOptions())
    assert res.applied and res.model_check.ok
    assert not any(c.inconclusive for c in res.model_check.comparisons)


def test_drift_on_the_finite_part_is_drift_however_much_of_the_reference_is_nan() -> None:
    """sqrt(x - 0.3) against 2 * sqrt(x - 0.3) on inputs mostly below 0.3: the reference is 70% NaN, but every
    finite element is off by 2x. That is drift (exit 1), not 'inconclusive'."""
    from npufuse.verify.compare import compare

    want = np.full(10, np.nan, dtype=np.float32)
    want[:3] = [0.5, 1.0, 2.0]
    got = want * 2
    c = compare("y", got, want)
    assert not c.ok and not c.inconclusive, c
    # and where the finite part agrees, a mostly-NaN reference stays inconclusive
    c = compare("y", want.copy(), want)
    assert not c.ok and c.inconclusive, c
