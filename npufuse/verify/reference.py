"""The reference executor: runs replacement nodes with the fused ops' NumPy kernels.

Fused `npufuse` ops run their own reference kernel; standard ops that replacements emit (a BN-folded
Conv, LayerNormalization, ...) run npufuse's NumPy kernel where it has one, else onnx's reference
evaluator. onnxruntime is never used here: it is the other side of the comparison.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import onnx

from npufuse.patterns import kernels
from npufuse.ir.graph import attributes

StdKernel = Callable[[Sequence[np.ndarray | None], dict[str, Any]], list[np.ndarray]]

STANDARD_KERNELS: dict[str, StdKernel] = {
    "Conv": lambda ins, a: [kernels.conv(ins[0], ins[1], ins[2] if len(ins) > 2 else None,
                                         **{k: v for k, v in a.items() if k != "kernel_shape"})],
}


def run_reference(nodes: Sequence[onnx.NodeProto], env: Mapping[str, np.ndarray], opset: int,
                  outputs: Sequence[str]) -> dict[str, np.ndarray]:
    """Execute `nodes` in order over the values in `env`; return the requested outputs."""
    from npufuse.patterns import fused_op_defs

    defs = fused_op_defs()
    values: dict[str, np.ndarray | None] = dict(env)
    for node in nodes:
        ins = [values[v] if v else None for v in node.input]
        attrs = attributes(node)
        key = ("" if node.domain == "ai.onnx" else node.domain, node.op_type)
        if key in defs:
            outs = defs[key].reference(ins, attrs)
        elif node.domain in ("", "ai.onnx") and node.op_type in STANDARD_KERNELS:
            outs = STANDARD_KERNELS[node.op_type](ins, attrs)
        elif node.domain in ("", "ai.onnx"):
            outs = _onnx_reference(node, ins, opset)
        else:
            raise NotImplementedError(f"no reference kernel for {node.domain}.{node.op_type}")
        for name, arr in zip(node.output, outs):
            if name:
                values[name] = arr
    return {o: values[o] for o in outputs}


def _onnx_reference(node: onnx.NodeProto, ins: Sequence[np.ndarray | None], opset: int) -> list[np.ndarray]:
    from onnx.reference import ReferenceEvaluator

    ev = ReferenceEvaluator(node, opsets={"": opset})
    return list(ev.run(None, {k: v for k, v in zip(node.input, ins) if k}))
