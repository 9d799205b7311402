"""onnx's shape inference as advice: the types and shapes (symbolic dims kept) it can reach, never a failure."""

from __future__ import annotations

import logging

import onnx

log = logging.getLogger(__name__)


def infer_value_types(model: onnx.ModelProto) -> dict[str, onnx.TypeProto]:
    """Types and shapes (symbolic dims kept) of every value onnx's shape inference can reach."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)
    except Exception as exc:  # inference is advice, not a requirement: patterns that need shapes refuse
        log.warning("shape inference failed (%s); continuing with the shapes the model declares", exc)
        inferred = model
    g = inferred.graph
    return {vi.name: vi.type for vi in list(g.value_info) + list(g.input) + list(g.output)
            if vi.type.HasField("tensor_type")}
