"""`KernelEstimate` and the one formula every kernel is priced with.

Per core, with double buffering, the engines (MTE2 in, Cube, Vector, the Cube->Vector hand-off, MTE3 out)
run concurrently on successive tiles, so for n identical tiles

    t_core = sum over tiles of max(stage) + fill/drain = max(stage totals) + (sum(step) - max(step))

where `step` is one tile's stage times (the pipeline fills and drains once). The kernel then takes
`max(t_core, roofline) + t_launch`, the roofline being the chip's total Cube flops / peak, total GM bytes /
GM bandwidth and total L2 bytes / L2 bandwidth.

`bound_by` names what sets the time: 'cube', 'vector' (compute), 'mte2' (per-core reads GM/L2 -> UB/L1),
'mte3' (per-core writes UB -> GM), 'l2_handoff' (Cube -> Vector through L2 on split parts), 'gm_bandwidth'
or 'l2_bandwidth' (the chip roofline), 'launch' (the launch overhead exceeds the work), 'none' (a view).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from npufuse.cost_model.recipes import Recipe
from npufuse.cost_model.workload import OpWork
from npufuse.npu_model.spec import NpuSpec
from npufuse.npu_model.tiling import Tile

STAGES = ("mte2", "cube", "vector", "handoff", "mte3")


@dataclass(frozen=True)
class KernelEstimate:
    """The modeled cost of one kernel, as a plain record. Cycles are per core (the busiest one)."""

    op_type: str
    name: str
    kind: str                    # 'cube' | 'vector' | 'cube+vector' | 'move' | 'view' | 'generic'
    dtype: str
    flops: float                 # 2 x useful Cube MACs + Vector element operations
    cube_cycles: float
    vector_cycles: float
    mte2_cycles: float
    mte3_cycles: float
    handoff_cycles: float
    cores_used: int
    gm_bytes_read: int           # from GM, including re-reads that miss L2
    gm_bytes_written: int
    l2_bytes_read: int           # operand re-reads served by L2
    l2_handoff_bytes: int        # Cube -> Vector hand-off through L2 (split AIC/AIV parts)
    t_mte2_us: float
    t_compute_us: float          # max(Cube, Vector) per core
    t_mte3_us: float
    t_handoff_us: float
    t_fill_drain_us: float
    t_pipeline_us: float         # per-core pipeline, fill/drain included
    t_roofline_us: float         # chip lower bound
    t_launch_us: float
    t_total_us: float
    launches: int
    bound_by: str
    tile: Tile | None
    ub_bytes_needed: int
    feasible: bool = True
    infeasible_reason: str = ""  # why the kernel cannot run as one pass (its time is then a fallback's)
    epilogue_tile: Tile | None = None
    notes: tuple[str, ...] = ()
    basis: tuple[float, ...] = field(default=(), compare=False, repr=False)   # see `price`; () for a view

    @property
    def gm_bytes(self) -> int:
        return self.gm_bytes_read + self.gm_bytes_written

    @property
    def cube_peak_us(self) -> float:
        """The kernel's Cube work as time at the dtype's peak (0.0 without Cube work): equal for two kernels that
        do the same MACs in the same dtype, whatever their tiling."""
        return self.basis[2 * len(STAGES)] if self.basis else 0.0

    def renamed(self, name: str) -> KernelEstimate:
        """`replace(self, name=name)` without re-running the frozen class's __init__ (it has no __post_init__): a
        100k-node graph is priced whole with one such copy per node, and each repeated layer's decisions reuse the
        first layer's kernels renamed (fusion.costing)."""
        copy = object.__new__(self.__class__)
        copy.__dict__.update(self.__dict__)
        copy.__dict__["name"] = name
        return copy

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe plain values."""
        out: dict[str, Any] = {}
        values = self.__dict__   # a frozen dataclass's fields (not slots): read without a getattr each
        for name in _KERNEL_FIELDS:
            v = values[name]
            if isinstance(v, Tile):
                v = v.to_dict()
            elif isinstance(v, tuple):
                v = list(v)
            elif isinstance(v, float):
                v = round(v, 6) if math.isfinite(v) else None
            out[name] = v
        out["gm_bytes"] = self.gm_bytes
        return out


_KERNEL_FIELDS = tuple(f.name for f in fields(KernelEstimate) if f.name != "basis")   # to_dict's, in order


def cycles_us(cycles: float, spec: NpuSpec) -> float:
    return cycles / spec.clock_hz * 1e6


def l2_bytes_per_cycle(spec: NpuSpec, cores: int) -> float:
    """A core's share of the chip's L2 bandwidth when `cores` cores stream at once."""
    return spec.l2_bandwidth_bytes_per_s / spec.clock_hz / max(cores, 1)


def vector_cycles(elems: float, compute_bytes: int, recipe: Recipe, spec: NpuSpec) -> float:
    """Vector cycles for `elems` elements: 256-byte repeats times the recipe's repeat costs."""
    if elems <= 0 or not recipe:
        return 0.0
    repeats = math.ceil(elems * compute_bytes / spec.vector_bytes_per_cycle)
    return repeats * sum(count * spec.repeat_cost(cls) for cls, count in recipe)


def vector_ops(elems: float, recipe: Recipe) -> float:
    """Element operations (the Vector's share of `flops`)."""
    return float(elems) * sum(count for _, count in recipe)


def finish(op: OpWork, spec: NpuSpec, *, kind: str, dtype: str, stages: Mapping[str, float],
           step: Mapping[str, float], cores: int, gm_read: float, gm_write: float, cube_flops: float = 0.0,
           vec_ops: float = 0.0, cube_dtype: str | None = None, l2_read: float = 0.0,
           l2_traffic: float | None = None, handoff_bytes: float = 0.0,
           tile: Tile | None = None, ub_bytes: int = 0, feasible: bool = True, reason: str = "",
           epilogue_tile: Tile | None = None, notes: tuple[str, ...] = ()) -> KernelEstimate:
    """Assemble a KernelEstimate from per-core stage totals (cycles) and one step's stage times.

    l2_read: operand re-reads served by L2 (for the record); l2_traffic: all operand bytes that pass L2
    (for the L2 roofline; defaults to l2_read); handoff_bytes: Cube->Vector bytes through L2 (written once,
    read once).
    """
    st = {s: float(stages.get(s, 0.0)) for s in STAGES}
    sp = {s: float(step.get(s, 0.0)) for s in STAGES}
    basis = (tuple(st[s] for s in STAGES) + tuple(sp[s] for s in STAGES) +
             (cube_flops / spec.peak_flops(cube_dtype or dtype) * 1e6 if cube_flops else 0.0,
              float(gm_read + gm_write),
              ((l2_read if l2_traffic is None else l2_traffic) + 2.0 * handoff_bytes)
              / spec.l2_bandwidth_bytes_per_s * 1e6))
    p = price(basis, spec)
    st = p.stages
    if p.launch_bound:
        bound = "launch"
    elif p.t_roof_us > p.t_pipe_us:
        bound = p.roof_name
    else:
        top = max(STAGES, key=lambda s: st[s])
        bound = "l2_handoff" if top == "handoff" else top
    fill_drain, t_pipe, t_roof, t_body = p.fill_drain_cycles, p.t_pipe_us, p.t_roof_us, p.t_body_us
    serial, overlapped = spec.launch_terms_us()
    t_launch = serial if not overlapped else p.t_total_us - t_body   # exact where the launch adds serially
    return KernelEstimate(
        op_type=op.op_type, name=op.name, kind=kind, dtype=dtype, flops=float(cube_flops + vec_ops),
        cube_cycles=st["cube"], vector_cycles=st["vector"], mte2_cycles=st["mte2"], mte3_cycles=st["mte3"],
        handoff_cycles=st["handoff"], cores_used=int(cores), gm_bytes_read=int(round(gm_read)),
        gm_bytes_written=int(round(gm_write)), l2_bytes_read=int(round(l2_read)),
        l2_handoff_bytes=int(round(handoff_bytes)), t_mte2_us=cycles_us(st["mte2"], spec),
        t_compute_us=cycles_us(max(st["cube"], st["vector"]), spec), t_mte3_us=cycles_us(st["mte3"], spec),
        t_handoff_us=cycles_us(st["handoff"], spec), t_fill_drain_us=cycles_us(fill_drain, spec),
        t_pipeline_us=t_pipe, t_roofline_us=t_roof, t_launch_us=t_launch, t_total_us=p.t_total_us,
        launches=1, bound_by=bound, tile=tile, ub_bytes_needed=int(ub_bytes), feasible=feasible,
        infeasible_reason=reason, epilogue_tile=epilogue_tile, notes=tuple(notes), basis=basis)


# `basis`: what `price` needs, recorded on every kernel so a calibration re-prices it under other profile terms
# without re-running the cost model: 5 stage totals (cycles, per core, in STAGES order), 5 step times (cycles),
# the Cube roofline (µs at peak), GM bytes, the L2 roofline (µs).
BASIS_LEN = 2 * len(STAGES) + 3


@dataclass(frozen=True)
class Priced:
    stages: dict[str, float]        # stage totals after the calibrated terms (cycles)
    fill_drain_cycles: float
    t_pipe_us: float
    t_roof_us: float
    roof_name: str
    t_body_us: float
    t_total_us: float
    launch_bound: bool


def price(basis: tuple[float, ...], spec: NpuSpec) -> Priced:
    """The one pricing formula: a kernel's time from its basis and the profile's (calibrated) terms.

    Cube cycles are divided by the size-dependent Cube efficiency (`NpuSpec.cube_efficiency` of the stage
    total), Vector cycles multiplied by `vector_cost_factor`, the GM roofline taken at `gm_fraction` of the
    chip's bandwidth; then t = max(t_pipeline, t_roofline) and the launch of the execution mode:
    max(t + serial, overlapped) (`NpuSpec.launch_terms_us`). Neutral terms give the physics unchanged.
    """
    n = len(STAGES)
    st = dict(zip(STAGES, basis[:n]))
    sp = dict(zip(STAGES, basis[n:2 * n]))
    roof_cube, gm_bytes, roof_l2 = basis[2 * n:2 * n + 3]
    eff = spec.cube_efficiency(st["cube"])
    if eff != 1.0:
        st["cube"] /= eff
        sp["cube"] /= eff
    if spec.vector_cost_factor != 1.0:
        st["vector"] *= spec.vector_cost_factor
        sp["vector"] *= spec.vector_cost_factor
    steps = list(sp.values())
    fill_drain = sum(steps) - max(steps)
    t_pipe = cycles_us(max(st.values()) + fill_drain, spec)
    roofs = {"cube": roof_cube,
             "gm_bandwidth": gm_bytes / (spec.gm_bandwidth_bytes_per_s * spec.gm_fraction) * 1e6,
             "l2_bandwidth": roof_l2}
    roof_name = max(roofs, key=lambda k: roofs[k])
    t_roof = roofs[roof_name]
    t_body = max(t_pipe, t_roof)
    serial, overlapped = spec.launch_terms_us()
    t_total = max(t_body + serial, overlapped)
    launch_bound = max(serial, overlapped) >= t_body
    return Priced(st, fill_drain, t_pipe, t_roof, roof_name, t_body, t_total, launch_bound)


def view(op: OpWork, spec: NpuSpec) -> KernelEstimate:
    """A metadata op: no kernel, no bytes (the runtime aliases the buffer)."""
    dtype = op.outputs[0].dtype if op.outputs else "float32"
    return KernelEstimate(op.op_type, op.name, "view", dtype, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0, 0, 0, 0, 0,
                          0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0, "none", None, 0,
                          notes=("a view: no kernel launch and no data movement",))
