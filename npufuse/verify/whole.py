"""Whole-model checks, and capturing the values a model computes, both segment by segment (see segments.py)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx

from npufuse.errors import first_line
from npufuse.ir.graph import Graph
from npufuse.verify.compare import Tolerance, Verdict, compare
from npufuse.verify.segments import DEFAULT_VERIFY_MEMORY_BYTES, ActivationStore, run_segmented

# The verdict on the whole model, original vs optimized.
ModelCheck = Verdict


def capture(g: Graph, feeds: Mapping[str, np.ndarray], names: Sequence[str],
            budget_bytes: int = DEFAULT_VERIFY_MEMORY_BYTES) -> dict[str, np.ndarray]:
    """The values `names` take when the model runs on `feeds` (values that are feeds come back as given)."""
    names = list(dict.fromkeys(names))
    out = {n: feeds[n] for n in names if n in feeds}
    wanted = [n for n in names if n not in out]
    if not wanted:
        return out
    with ActivationStore(memory_bytes=1 << 62) as store:
        outputs = run_segmented(g.model, feeds, g.base_dir, budget_bytes, wanted, store)
        for n in wanted:
            arr = store.get(n) if n in store else outputs.get(n)
            if arr is None:
                raise KeyError(f"value {n!r} was not computed by the model")
            out[n] = np.asarray(arr)
    return out


def run_model(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray], base_dir: str | None = None,
              budget_bytes: int = DEFAULT_VERIFY_MEMORY_BYTES) -> dict[str, np.ndarray]:
    """The model's outputs on `feeds`, run segment by segment under `budget_bytes` of weights."""
    return run_segmented(model, feeds, base_dir, budget_bytes)


def compare_outputs(got: Mapping[str, np.ndarray], want: Mapping[str, np.ndarray],
                    tolerances: Mapping[str, Tolerance] | None = None) -> ModelCheck:
    """Compare every reference output with the same-named output of the other model."""
    comps = []
    for name, ref in want.items():
        if name not in got:
            return ModelCheck(False, comps, f"{name}: missing from the optimized model's outputs")
        comps.append(compare(name, got[name], ref, (tolerances or {}).get(name)))
    return ModelCheck.of(comps)


def compare_models(original: onnx.ModelProto, optimized: onnx.ModelProto, feeds: Mapping[str, np.ndarray],
                   base_dir: str | None = None, tolerances: Mapping[str, Tolerance] | None = None,
                   reference_outputs: Mapping[str, np.ndarray] | None = None,
                   budget_bytes: int = DEFAULT_VERIFY_MEMORY_BYTES) -> ModelCheck:
    """Run both models (segment by segment) on the same inputs and compare every output (the original's outputs
    may be passed in when they were computed already)."""
    want = reference_outputs
    if want is None:
        try:
            want = run_model(original, feeds, base_dir, budget_bytes)
        except Exception as exc:
            return ModelCheck(False, reason=f"onnxruntime could not run the original model: {first_line(exc)}")
    try:
        got = run_model(optimized, feeds, base_dir, budget_bytes)
    except Exception as exc:
        return ModelCheck(False, reason=f"onnxruntime could not run the optimized model: {first_line(exc)}")
    return compare_outputs(got, want, tolerances)
