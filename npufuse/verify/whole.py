"""Whole-model checks, and capturing the real activations that per-rewrite checks feed on."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence

import numpy as np
import onnx

from npufuse.errors import first_line
from npufuse.graph import Graph
from npufuse.runtime import IR_VERSION, run
from npufuse.verify.compare import Tolerance, Verdict, compare

# The verdict on the whole model, original vs optimized.
ModelCheck = Verdict


def with_outputs(g: Graph, names: Sequence[str]) -> onnx.ModelProto:
    """A copy of `g`'s model that also outputs `names` (intermediate values)."""
    model = copy.deepcopy(g.model)
    have = {o.name for o in model.graph.output}
    model.graph.output.extend(g.value_info(n) for n in names if n not in have)
    model.ir_version = max(model.ir_version, 4)
    if model.functions:
        model.ir_version = max(model.ir_version, IR_VERSION)
    return model


def capture(g: Graph, feeds: Mapping[str, np.ndarray], names: Sequence[str]) -> dict[str, np.ndarray]:
    """The values `names` take when the model runs on `feeds` (one onnxruntime run)."""
    names = list(dict.fromkeys(names))
    if not names:
        return {}
    return run(with_outputs(g, names), feeds, names, base_dir=g.base_dir)


def compare_models(original: onnx.ModelProto, optimized: onnx.ModelProto, feeds: Mapping[str, np.ndarray],
                   base_dir: str | None = None, tolerances: Mapping[str, Tolerance] | None = None,
                   reference_outputs: Mapping[str, np.ndarray] | None = None) -> ModelCheck:
    """Run both models on onnxruntime with the same inputs and compare every output (the original's
    outputs may be passed in when they were computed already)."""
    want = reference_outputs
    if want is None:
        try:
            want = run(original, feeds, base_dir=base_dir)
        except Exception as exc:
            return ModelCheck(False, reason=f"onnxruntime could not run the original model: {first_line(exc)}")
    try:
        got = run(optimized, feeds, list(want), base_dir=base_dir)
    except Exception as exc:
        return ModelCheck(False, reason=f"onnxruntime could not run the optimized model: {first_line(exc)}")
    comps = [compare(name, got[name], want[name], (tolerances or {}).get(name)) for name in want]
    bad = [c for c in comps if not c.ok]
    return ModelCheck(not bad, comps, "; ".join(f"{c.name}: {c.detail}" for c in bad))
