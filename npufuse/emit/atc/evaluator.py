"""Run an ATC-form model on the CPU: standard ops plus CANN plugin nodes (domain "npu", the default domain or
the literal "ai.onnx"), with `onnx.reference.ReferenceEvaluator` and one `OpRun` class per plugin op wrapping
its NumPy reference kernel.

A plugin node's attributes reach its kernel as the ATC plugin would pass them: the plugin's defaults, then
the node's attributes that the plugin reads with the ONNX type it reads (others are ignored, as ATC ignores
them). ReferenceEvaluator does not know the literal "ai.onnx" domain (it raises for `ai.onnx::Relu`), so
`run_atc_model` evaluates a copy whose "ai.onnx" domains are renamed to the default domain.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun

from npufuse.emit.atc.plugins import plugin_attrs
from npufuse.emit.atc.reference_kernels import KERNELS

PLUGIN_DOMAINS = ("npu", "")


def _make_class(op_type: str, domain: str, declared: Mapping[str, np.dtype]) -> type[OpRun]:
    kernel = KERNELS[op_type]

    def _run(self: OpRun, *inputs: np.ndarray | None, **_: Any) -> tuple[np.ndarray, ...]:
        node = self.onnx_node
        attrs = {k: v for k, v in plugin_attrs(node).items() if v is not None}
        results = kernel(list(inputs), attrs)[:len(node.output)]
        # the graph's declared dtype wins over the kernel's natural one (e.g. a float32 model of a fp16 kernel)
        return tuple(r.astype(declared[name]) if name in declared else r for name, r in zip(node.output, results))

    return type(op_type, (OpRun,), {"op_domain": domain, "_run": _run, "__doc__": f"{op_type} ({domain or 'default'})"})


def plugin_op_classes(declared: Mapping[str, np.dtype] | None = None) -> list[type[OpRun]]:
    """One OpRun class per plugin op and per domain it may appear in ("npu" and the default domain;
    "ai.onnx" nodes are renamed to the default domain by `run_atc_model`). `declared`: output name -> dtype
    to cast kernel results to."""
    declared = dict(declared or {})
    return [_make_class(op, dom, declared) for op in KERNELS for dom in PLUGIN_DOMAINS]


def _rename_domains(graph: onnx.GraphProto) -> None:
    for node in graph.node:
        if node.domain == "ai.onnx":
            node.domain = ""
        for a in node.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                _rename_domains(a.g)
            elif a.type == onnx.AttributeProto.GRAPHS:
                for g in a.graphs:
                    _rename_domains(g)


def normalise_domains(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of `model` with the literal "ai.onnx" domain renamed to "" in nodes (subgraphs too) and in
    opset_import (the highest version kept when both were imported)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    _rename_domains(out.graph)
    versions: dict[str, int] = {}
    for o in out.opset_import:
        dom = "" if o.domain == "ai.onnx" else o.domain
        versions[dom] = max(versions.get(dom, 0), o.version)
    del out.opset_import[:]
    out.opset_import.extend(onnx.helper.make_opsetid(d, v) for d, v in versions.items())
    return out


def _declared_dtypes(graph: onnx.GraphProto) -> dict[str, np.dtype]:
    out = {}
    for vi in list(graph.value_info) + list(graph.output):
        t = vi.type.tensor_type.elem_type
        if t and t != onnx.TensorProto.BFLOAT16:  # no NumPy bfloat16: keep the kernel's dtype
            out[vi.name] = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t))
    return out


def run_atc_model(model: onnx.ModelProto, feeds: dict[str, np.ndarray],
                  output_names: list[str] | None = None) -> list[np.ndarray]:
    """Evaluate an ATC-form `model` on `feeds`; the graph outputs (or `output_names`) in order."""
    m = normalise_domains(model)
    ref = ReferenceEvaluator(m, new_ops=plugin_op_classes(_declared_dtypes(m.graph)))
    return list(ref.run(output_names, feeds))
