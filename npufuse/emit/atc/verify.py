"""The ATC form checked against the original: the same seeded inputs, the original on onnxruntime (segment by
segment, as every whole-model check), the ATC form on onnx's reference evaluator with a NumPy kernel per plugin op
of what the CANN kernel computes as its plugin configures it (`evaluator.run_atc_model`), every output compared
with the dtype-aware tolerances of `npufuse check`."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx
from onnx import external_data_helper

from npufuse.emit.atc.evaluator import run_atc_model
from npufuse.ir.graph import Graph
from npufuse.ir.weights import is_external
from npufuse.verify.compare import Verdict
from npufuse.verify.inputs import model_inputs
from npufuse.verify.whole import compare_outputs, run_model


def _with_weights(model: onnx.ModelProto, base_dir: str | None) -> onnx.ModelProto:
    """A copy the reference evaluator can run: external weights read in (verification only; never written)."""
    if not any(is_external(t) for t in model.graph.initializer):
        return model
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    external_data_helper.load_external_data_for_model(copy, base_dir or ".")
    return copy


def verify_atc(original: onnx.ModelProto, atc_model: onnx.ModelProto, base_dir: str | None, *, seed: int = 0,
               dims: Mapping[str, int] | None = None,
               reference_outputs: Mapping[str, np.ndarray] | None = None) -> Verdict:
    """Original vs ATC form on the same seeded inputs, every output of the original."""
    g = Graph(original, base_dir)
    feeds = model_inputs(g, seed, dims)
    want = dict(reference_outputs) if reference_outputs is not None else run_model(original, feeds, base_dir)
    names = [o.name for o in atc_model.graph.output]
    runnable = _with_weights(atc_model, base_dir)
    got = dict(zip(names, run_atc_model(runnable, {k: v for k, v in feeds.items()
                                                   if k in {i.name for i in atc_model.graph.input}})))
    return compare_outputs(got, want)
