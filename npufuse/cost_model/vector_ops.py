"""Vector kernels: elementwise ops, row ops (norms, softmax), streaming reductions, data movement.

Work splits evenly across the Vector cores; each core streams its share through UB in tiles (double
buffered, 32-byte aligned), reading from GM at the per-core MTE2 rate and writing at the MTE3 rate.
"""

from __future__ import annotations

import math
from dataclasses import replace

from npufuse.cost_model.kernel import KernelEstimate, finish, vector_cycles, vector_ops
from npufuse.cost_model.recipes import (
    ELEMENTWISE,
    MOVES,
    REDUCTIONS,
    ROW_OPS,
    ROW_TEMPS_FP32,
    Recipe,
    add_recipes,
)
from npufuse.cost_model.workload import OpWork, TensorInfo
from npufuse.npu_model.spec import NpuSpec
from npufuse.npu_model.tiling import Tile, row_strategies, row_tile, stream_tile

FP32 = 4
_RESIDUAL_NORMS = frozenset({"SkipLayerNormalization", "AddLayerNorm", "SkipSimplifiedLayerNormalization",
                             "AddRMSNorm"})


def _present(ts) -> list[TensorInfo]:
    return [t for t in ts if t is not None]


def _compute_bytes(op: OpWork) -> int:
    sizes = [t.itemsize for t in _present(op.inputs) + list(op.outputs) if t.dtype != "bool"]
    return max(sizes, default=4)


def _cores_used(elems: int, spec: NpuSpec) -> int:
    """Cores that get work (for the record; every core's share is ceil(elems / vector_cores))."""
    return max(1, min(spec.vector_cores, math.ceil(max(elems, 1) / spec.alignment_bytes)))


def stream_kernel(op: OpWork, spec: NpuSpec, *, elems: int, recipe: Recipe, compute_bytes: int,
                  read_bytes: float, write_bytes: float, in_bytes: list[float], out_bytes: list[float],
                  temps: int = 0, fixed_bytes: list[float] | None = None, kind: str = "vector",
                  notes: tuple[str, ...] = (), feasible: bool = True, reason: str = "",
                  passes: int = 1) -> KernelEstimate:
    """A streaming kernel over `elems` elements split evenly over the Vector cores.

    in_bytes / out_bytes: bytes per element of each streamed input / output (double buffered in UB);
    fixed_bytes: small operands every core loads once (broadcast scale, bias); passes: how many times the
    inputs are streamed (2 for a norm whose row does not fit UB). read_bytes / write_bytes: GM totals.
    """
    elems = max(int(elems), 1)
    fixed = list(fixed_bytes or [])
    elems_pc = math.ceil(elems / spec.vector_cores)
    tile = stream_tile(elems_pc, spec, in_bytes + out_bytes, [FP32] * temps, fixed)
    if not tile.feasible:
        feasible, reason = False, reason or tile.reason
    tile_elems = tile.elems if tile.feasible else min(elems_pc, spec.alignment_bytes)
    per_in, per_out = passes * sum(in_bytes), sum(out_bytes)
    rd, wr = spec.gm_read_bytes_per_cycle_per_core, spec.ub_to_gm_bytes_per_cycle_per_core
    stages = {"mte2": (elems_pc * per_in + sum(fixed)) / rd,
              "vector": vector_cycles(elems_pc, compute_bytes, recipe, spec),
              "mte3": elems_pc * per_out / wr}
    step = {"mte2": tile_elems * per_in / rd, "vector": vector_cycles(tile_elems, compute_bytes, recipe, spec),
            "mte3": tile_elems * per_out / wr}
    dtype = op.outputs[0].dtype if op.outputs else "float32"
    return finish(op, spec, kind=kind, dtype=dtype, stages=stages, step=step, cores=_cores_used(elems, spec),
                  gm_read=read_bytes, gm_write=write_bytes, vec_ops=vector_ops(elems, recipe), tile=tile,
                  ub_bytes=tile.ub_bytes_needed, feasible=feasible, reason=reason, notes=notes)


def _streams_of(op: OpWork, elems: int, spec: NpuSpec) -> tuple[list[float], list[float], list[float]]:
    """Per-element bytes of streamed inputs and outputs, and whole buffers of small broadcast operands."""
    ins: list[float] = []
    fixed: list[float] = []
    for t in _present(op.inputs):
        if t.numel >= elems:
            ins.append(float(t.itemsize))
        elif t.nbytes <= spec.ub_bytes // 16:
            fixed.append(float(t.nbytes))
        else:
            ins.append(t.nbytes / elems)
    return ins, [float(t.itemsize) for t in op.outputs], fixed


def elementwise(op: OpWork, spec: NpuSpec, recipe: Recipe | None = None, temps: int | None = None,
                notes: tuple[str, ...] = ()) -> KernelEstimate:
    """Elementwise op (activations, arithmetic, BatchNormalization in inference)."""
    base, base_temps = ELEMENTWISE.get(op.op_type, ((("add", 1),), 0))
    if op.op_type in ("Sum", "Mean", "Max", "Min") and len(_present(op.inputs)) > 2:
        base = (("add", len(_present(op.inputs)) - 1),)
    if op.op_type == "Gelu" and op.attrs.get("approximate", "none") == "tanh":
        base = ELEMENTWISE["FastGelu"][0]
    elif op.op_type == "Gelu" and op.attrs.get("approximate", "none") == "quick":
        base = ELEMENTWISE["QuickGelu"][0]
    recipe = base if recipe is None else recipe
    temps = base_temps if temps is None else temps
    elems = max([t.numel for t in op.outputs] + [1])
    ins, outs, fixed = _streams_of(op, elems, spec)
    read = float(sum(t.nbytes for t in _present(op.inputs)))
    write = float(sum(t.nbytes for t in op.outputs))
    return stream_kernel(op, spec, elems=elems, recipe=recipe, compute_bytes=_compute_bytes(op),
                         read_bytes=read, write_bytes=write, in_bytes=ins, out_bytes=outs, temps=temps,
                         fixed_bytes=fixed, notes=notes)


def generic(op: OpWork, spec: NpuSpec, why: str = "") -> KernelEstimate:
    """Fallback for op types the model does not know: one add per element of the largest tensor."""
    note = why or f"{op.op_type!r} is not modeled; priced as a generic elementwise op"
    est = elementwise(op, spec, recipe=(("add", 1),), temps=0, notes=(note,))
    return _with_kind(est, "generic")


def _with_kind(est: KernelEstimate, kind: str) -> KernelEstimate:
    return replace(est, kind=kind)


def _axis(op: OpWork, rank: int, default: int) -> int:
    axis = int(op.attrs.get("axis", default))
    return axis + rank if axis < 0 else axis


def row_geometry(op: OpWork) -> tuple[int, int]:
    """(rows, elements per row) of a row op: the reduced axes are the row."""
    x = op.inputs[0]
    assert x is not None
    shape = x.shape or (1,)
    rank = len(shape)
    t = op.op_type
    if t in ("Softmax", "LogSoftmax"):
        axis = _axis(op, rank, -1)
        row = shape[axis]
    elif t in ("GroupNormalization", "GroupNorm", "GroupNormSilu"):
        groups = int(op.attrs.get("num_groups", 1))
        row = x.numel // max(shape[0] * groups, 1)
    elif t == "InstanceNormalization":
        row = math.prod(shape[2:]) if rank > 2 else 1
    else:
        axis = _axis(op, rank, -1)
        row = math.prod(shape[axis:])
    row = max(int(row), 1)
    return max(x.numel // row, 1), row


def row_op(op: OpWork, spec: NpuSpec, extra_recipe: Recipe = ()) -> KernelEstimate:
    """Norms and softmax: whole rows of the reduced axis in UB, one pass over GM.

    Where no row fits UB double buffered, CANN's tiling falls back to single buffering, then to a split-row
    two-pass kernel (statistics, then normalise: the input is read twice); the cheaper feasible one is priced
    and named (`tiling.row_strategies`). Only where not even a chunk of 32 elements fits is the estimate
    infeasible.
    """
    x = op.inputs[0]
    assert x is not None
    rows, row = row_geometry(op)
    recipe = add_recipes(ROW_OPS.get(op.op_type, ROW_OPS["LayerNormalization"]), extra_recipe)
    # By role, not size: X (and the residual of Skip/Add norms) stream; gamma, beta, bias are per-row constants.
    n_streams = 2 if op.op_type in _RESIDUAL_NORMS else 1
    full = _present(op.inputs[:n_streams])
    params = [float(t.nbytes) for t in _present(op.inputs[n_streams:])]
    in_b = [float(t.itemsize) for t in full]
    out_b = [t.nbytes / max(x.numel, 1) for t in op.outputs]   # Mean / InvStdDev outputs are per row
    read = float(sum(t.nbytes for t in _present(op.inputs)))
    write = float(sum(t.nbytes for t in op.outputs))
    elems = rows * row
    rows_pc = math.ceil(rows / spec.vector_cores)
    what = f"a row of {row} {x.dtype} elements"
    streams = in_b + [float(t.itemsize) for t in op.outputs if t.numel >= x.numel]
    options = row_strategies(rows_pc, row, spec, streams, [FP32] * ROW_TEMPS_FP32, params, what=what)
    if options:
        priced = [_row_kernel(op, spec, t, rows, row, rows_pc, recipe, in_b, out_b, params, read, write, full)
                  for t in options]
        return min(priced, key=lambda e: e.t_total_us)
    tile = row_tile(rows_pc, row, spec, streams, [FP32] * ROW_TEMPS_FP32, params, what=what)
    if not tile.feasible:
        full_read = float(sum(t.nbytes for t in full))
        return stream_kernel(op, spec, elems=elems, recipe=recipe, compute_bytes=FP32, read_bytes=read + full_read,
                             write_bytes=write, in_bytes=in_b, out_bytes=out_b, temps=ROW_TEMPS_FP32,
                             fixed_bytes=[], feasible=False, reason=tile.reason, passes=2,
                             notes=(f"{tile.reason}; priced as a two-pass kernel (the input is read twice)",))
    raise AssertionError("row_strategies found no way, row_tile found one")   # pragma: no cover


def _row_kernel(op: OpWork, spec: NpuSpec, tile: Tile, rows: int, row: int, rows_pc: int, recipe: Recipe,
                in_b: list[float], out_b: list[float], params: list[float], read: float, write: float,
                full: list[TensorInfo]) -> KernelEstimate:
    """One row-work strategy priced: whole rows (double or single buffered) or split-row two-pass."""
    x = op.inputs[0]
    assert x is not None
    elems = rows * row
    if tile.strategy == "two-pass":
        full_read = float(sum(t.nbytes for t in full))
        est = stream_kernel(op, spec, elems=elems, recipe=recipe, compute_bytes=FP32, read_bytes=read + full_read,
                            write_bytes=write, in_bytes=in_b, out_bytes=out_b, temps=ROW_TEMPS_FP32,
                            fixed_bytes=[], passes=2,
                            notes=(f"{tile.reason}; split-row two-pass: the row in chunks of {tile.cols}, "
                                   "statistics then normalise (the input is read twice)",))
        return replace(est, tile=tile, ub_bytes_needed=tile.ub_bytes_needed)
    rd, wr = spec.gm_read_bytes_per_cycle_per_core, spec.ub_to_gm_bytes_per_cycle_per_core
    per_row_in, per_row_out = row * sum(in_b), row * sum(out_b)
    stages = {"mte2": (rows_pc * per_row_in + sum(params)) / rd,
              "vector": vector_cycles(rows_pc * row, FP32, recipe, spec),
              "mte3": rows_pc * per_row_out / wr}
    step = {"mte2": tile.rows * per_row_in / rd, "vector": vector_cycles(tile.rows * row, FP32, recipe, spec),
            "mte3": tile.rows * per_row_out / wr}
    notes: tuple[str, ...] = ()
    if tile.strategy == "single-buffered":
        # nothing overlaps: every tile loads, computes and stores in turn (fill/drain = the whole sum)
        step = dict(stages)
        notes = (f"{tile.reason}; single-buffered whole rows: loads, compute and stores do not overlap",)
    return finish(op, spec, kind="vector", dtype=x.dtype, stages=stages, step=step,
                  cores=min(rows, spec.vector_cores), gm_read=read, gm_write=write,
                  vec_ops=vector_ops(elems, recipe), tile=tile, ub_bytes=tile.ub_bytes_needed, notes=notes)


def reduction(op: OpWork, spec: NpuSpec) -> KernelEstimate:
    """Streaming reductions: partial results carry across tiles, so no whole row is needed."""
    x = op.inputs[0]
    assert x is not None
    recipe = REDUCTIONS.get(op.op_type, (("reduce", 1),))
    read = float(sum(t.nbytes for t in _present(op.inputs)))
    write = float(sum(t.nbytes for t in op.outputs))
    return stream_kernel(op, spec, elems=x.numel, recipe=recipe, compute_bytes=max(x.itemsize, FP32),
                         read_bytes=read, write_bytes=write, in_bytes=[read / max(x.numel, 1)],
                         out_bytes=[write / max(x.numel, 1)], temps=1)


def pool(op: OpWork, spec: NpuSpec) -> KernelEstimate:
    """MaxPool / AveragePool: each output element reduces a kernel window."""
    x = op.inputs[0]
    assert x is not None
    window = math.prod(op.attrs.get("kernel_shape", [1]))
    out = op.outputs[0]
    recipe = (("add", float(window)),)
    read = float(x.nbytes)
    write = float(sum(t.nbytes for t in op.outputs))
    return stream_kernel(op, spec, elems=out.numel, recipe=recipe, compute_bytes=x.itemsize, read_bytes=read,
                         write_bytes=write, in_bytes=[read / max(out.numel, 1)],
                         out_bytes=[write / max(out.numel, 1)])


def move(op: OpWork, spec: NpuSpec) -> KernelEstimate:
    """Data movement (Transpose, Concat, Slice, Gather, ...): bytes in and out, little or no compute."""
    recipe, reads_output_size = MOVES.get(op.op_type, ((), False))
    ins = _present(op.inputs)
    write = float(sum(t.nbytes for t in op.outputs))
    if reads_output_size and ins:
        read = float(min(ins[0].nbytes, write) + sum(t.nbytes for t in ins[1:]))
    else:
        read = float(sum(t.nbytes for t in ins))
    elems = max([t.numel for t in op.outputs] + [1])
    item = max([t.itemsize for t in op.outputs] + [1])
    est = stream_kernel(op, spec, elems=elems, recipe=recipe, compute_bytes=item, read_bytes=read,
                        write_bytes=write, in_bytes=[read / elems], out_bytes=[write / elems])
    return _with_kind(est, "move")
