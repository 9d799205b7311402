"""A candidate's Ascend kernel: its replacement mapped to the CANN kernel it becomes (npu_model.ascend_kernels)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from npufuse.ir.candidates import Match, Replacement
from npufuse.ir.graph import Graph, np_dtype
from npufuse.npu_model.ascend_kernels import region_kernel


def replacement_kernel(g: Graph, m: Match, rep: Replacement, spec: Any = None,
                       node_ops: Iterable[str] | None = None) -> dict[str, Any] | None:
    """The kernel record of `rep` on `spec`'s chip (no chip without a spec, or where the profile states none),
    from the graph's own shapes: fixed dims as ints, symbolic ones by name. The engine's record and the cost
    model's decision both come from here, so they name the same kernel. `node_ops`: the op types of `m`'s nodes,
    where the caller has read them already."""
    extra = {t.name: tuple(int(d) for d in t.dims) for t in rep.initializers}

    def shape_of(v: str):
        return extra[v] if v in extra else g.shape(v)

    def dtype_of(v: str) -> str | None:
        if v in extra:
            t = next(t for t in rep.initializers if t.name == v)
            dt = np_dtype(t.data_type)
        else:
            dt = g.dtype(v)
        return dt.name if dt is not None else None

    return region_kernel(rep.nodes, shape_of, getattr(spec, "chip", None), getattr(spec, "name", None),
                         set(node_ops) if node_ops is not None else {g.node(n).op_type for n in m.nodes},
                         getattr(spec, "ub_bytes", None),
                         getattr(spec, "user_kernels", ()), dtype_of)
