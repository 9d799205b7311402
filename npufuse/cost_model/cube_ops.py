"""Cube kernels: MatMul / Gemm, Conv as implicit GEMM, their fused epilogues, and flash attention.

A GEMM of batch x (m x k) @ (k x n) is cut into m_tile x n_tile output tiles (`npu_model.tiling.cube_tile`,
searched for the lowest modeled time); tiles spread over the Cube cores. Each tile reads an A panel
(m_tile rows) and a B panel (n_tile columns) over the whole k: the first read of every byte comes from GM,
re-reads by other tiles come from L2 when the operands (or the panels the cores work on at once, with a
swizzled tile order, see `_band_bytes`) fit L2, else from GM again. Partial edge tiles cost a full tile on the Cube (the
fractal is 16 x 16 x k_fractal) but move only their real bytes.

Epilogues run on the Vector unit beside the Cube: on 'direct' parts (910A, 310P) L0C results go to UB on
the same core; on 'l2' parts (910B, split AIC/AIV) each output tile is handed to the Vector cores through
L2 (written and read back at the L2 rate) and the Vector work is shared by the AIVs of a Cube core.
A norm epilogue needs whole output rows in UB: on direct parts the Cube's m tile is limited to the rows
that fit (fewer than 16 starves the Cube: a fractal still costs 16 rows); on split parts the Vector cores
normalise whole rows read back from the L2 workspace, and at least one row must fit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from npufuse.cost_model.kernel import (
    KernelEstimate,
    finish,
    l2_bytes_per_cycle,
    vector_cycles,
    vector_ops,
)
from npufuse.cost_model.recipes import (
    EPILOGUE,
    NORM_EPILOGUES,
    ROW_TEMPS_FP32,
    Recipe,
    add_recipes,
)
from npufuse.cost_model.workload import OpWork, TensorInfo, itemsize
from npufuse.npu_model.spec import NpuSpec
from npufuse.npu_model.tiling import (
    CUBE_TILE_SIZES,
    Tile,
    cube_tile,
    round_down,
    round_up,
    row_tile,
    stream_tile,
)

FP32 = 4
FILL_K = 256   # the pipeline fills with one k-panel this deep (a fixed depth keeps costs monotone in size)
_ONLINE_SOFTMAX: Recipe = (("reduce", 2), ("add", 5), ("exp", 1))  # max, sum, rescale, exp per score
_SOFTCAP: Recipe = (("tanh", 1), ("add", 2))    # logit soft-capping per score: cap * tanh(s / cap), two muls


@dataclass(frozen=True)
class Gemm:
    """batch x (m x k) @ (k x n) with the GM bytes behind it."""

    batch: int
    m: int
    n: int
    k: int
    in_dtype: str
    a_row_bytes: float        # GM bytes of A behind one output row (k * itemsize for MatMul)
    a_bytes: float            # unique bytes of A
    b_bytes: float            # unique bytes of B (all batches)
    b_itemsize: float
    out_itemsize: int
    out_bytes: float
    extra_read: float = 0.0   # bias, gamma, beta: read once


@dataclass(frozen=True)
class Epilogue:
    """Vector work applied to the GEMM's output before it leaves the chip."""

    recipe: Recipe = ()
    norm: Recipe | None = None
    norm_fixed_bytes: tuple[float, ...] = ()   # whole-row constants in UB (gamma, beta, bias)
    names: tuple[str, ...] = field(default_factory=tuple)


CUBE_K_BYTES = 32   # a fractal's k edge is 32 bytes of the input dtype: 16 fp16, 8 fp32, 32 int8 (k0)


def _k_fractal(spec: NpuSpec, dtype: str) -> int:
    """k0 of the Cube's fractal for an input dtype (the dtype the Cube runs, `NpuSpec.cube_dtype`)."""
    return max(1, CUBE_K_BYTES // itemsize(spec.cube_dtype(dtype)))


def _fractal_cycles(spec: NpuSpec, dtype: str) -> float:
    """Cycles one block x block x k0 fractal takes at the profile's MAC rate (1 for fp16; 2 for fp32 at 1/4)."""
    macs = spec.cube_block * spec.cube_block * _k_fractal(spec, dtype)
    return macs / spec.cube_macs_per_cycle(spec.cube_dtype(dtype))


def _cube_dtype_notes(spec: NpuSpec, dtype: str) -> tuple[str, ...]:
    run = spec.cube_dtype(dtype)
    if run == dtype:
        return ()
    return (f"{dtype} Cube work priced as {run}: {spec.name}'s Cube has no {dtype} path and ATC runs it in "
            f"{run} by default (precision_mode)",)


def _dims(t: TensorInfo | None, what: str) -> tuple[int, ...]:
    if t is None or not t.shape:
        raise ValueError(f"{what} has no shape")
    return tuple(max(int(d), 1) for d in t.shape)


def price_gemm(op: OpWork, spec: NpuSpec, g: Gemm, epi: Epilogue | None = None,
               notes: tuple[str, ...] = ()) -> KernelEstimate:
    """The best-tiled kernel for a GEMM with an optional epilogue (tile searched for the lowest time).

    Per core (the busiest): its tiles' operand panels stream in through MTE2 at the core's share of the L2
    rate, plus its share of the first-touch reads from GM (spread over the Cube cores that run) at the GM rate; when
    the operands miss L2 every panel comes from GM. The Cube costs ceil(rows/16) x ceil(cols/16) x
    ceil(k/k_fractal) cycles per tile. Every term grows with m, n and k; a bigger GEMM can cost less only
    where its extra tiles bring one more core into play (tests/test_cost_model.py bounds that dip).
    """
    block = spec.cube_block
    cube_dtype = spec.cube_dtype(g.in_dtype)
    kf = _k_fractal(spec, cube_dtype)
    fc = _fractal_cycles(spec, cube_dtype)
    in_bytes = itemsize(cube_dtype)          # what L0A / L0B hold
    split = spec.cube_to_vector_path == "l2"
    vpc = spec.vector_per_cube_core
    cc = spec.cube_cores
    l2_rate = l2_bytes_per_cycle(spec, cc)
    gm_rate = spec.gm_read_bytes_per_cycle_per_core
    out_rate = spec.ub_to_gm_bytes_per_cycle_per_core
    norm = epi is not None and epi.norm is not None
    notes = list(notes) + list(_cube_dtype_notes(spec, g.in_dtype))
    row_t: Tile | None = None
    rows_fit: int | None = None
    m_sizes = None
    feasible, reason = True, ""
    vec_recipe: Recipe = add_recipes(epi.norm or (), epi.recipe) if epi is not None else ()
    if norm:
        assert epi is not None
        rows_total = g.batch * g.m
        want = math.ceil(rows_total / spec.vector_cores) if split else 1 << 30
        row_t = row_tile(max(want, 1), g.n, spec, [g.out_itemsize, g.out_itemsize], [FP32] * ROW_TEMPS_FP32,
                         list(epi.norm_fixed_bytes), what=f"a row of {g.n} {g.in_dtype} elements")
        if not row_t.feasible:
            feasible, reason = False, row_t.reason
            norm = False          # price the part that can run, for information only
            vec_recipe = epi.recipe
            notes.append(f"{reason}; the time shown omits the norm epilogue")
        elif not split:
            rows_fit = row_t.rows
            top = round_down(rows_fit, block)
            m_sizes = [x for x in CUBE_TILE_SIZES if x <= top] or [block]
            if rows_fit < min(block, g.m):
                notes.append(f"UB holds only {rows_fit} rows of {g.n}: the Cube is starved "
                             f"(an m tile of {rows_fit} < {block} rows still costs a full fractal)")
    rowblock = norm and not split
    hand_bytes = float(g.batch * g.m * g.n * g.out_itemsize) if split and vec_recipe else 0.0
    unique = g.a_bytes + g.b_bytes
    macs = float(g.batch) * g.m * g.n * g.k

    def evaluate(t: Tile) -> dict:
        # Split-K: when the output tiles leave Cube cores idle, a plain GEMM (no epilogue: it needs whole sums)
        # may cut k over the idle cores, each adding its fp32 partial sums into GM (atomic add). The cheaper of
        # the two is taken, so a small GEMM never costs more than a bigger one that fills the chip.
        m_eff = min(t.m, g.m, rows_fit) if rowblock and rows_fit is not None else min(t.m, g.m)
        tiles = g.batch * math.ceil(g.m / m_eff) * math.ceil(g.n / min(t.n, g.n))
        best = _evaluate(t, 1)
        split_k = min(cc // max(tiles, 1), math.ceil(g.k / FILL_K))
        if not vec_recipe and split_k > 1:
            other = _evaluate(t, split_k)
            if other["cost"] < best["cost"]:
                best = other
        return best

    def _evaluate(t: Tile, split_k: int) -> dict:
        m_eff = min(t.m, g.m, rows_fit) if rowblock and rows_fit is not None else min(t.m, g.m)
        n_eff = min(t.n, g.n)
        k_core = math.ceil(g.k / split_k)
        tiles_m, tiles_n = math.ceil(g.m / m_eff), math.ceil(g.n / n_eff)
        tiles = g.batch * tiles_m * tiles_n * split_k
        units = g.batch * tiles_m if rowblock else tiles      # a row block is one core's work when rows sit in UB
        per_unit = tiles_n if rowblock else 1
        cores = max(1, min(cc, units))
        upc = math.ceil(units / cores)
        tpc = upc * per_unit
        a_panel, b_panel = m_eff * g.a_row_bytes / split_k, n_eff * k_core * g.b_itemsize
        tile_reads = a_panel + b_panel
        all_reads = tiles * tile_reads
        hit = min(unique, _band_bytes(cores, a_panel, b_panel)) <= spec.l2_bytes
        if hit:
            # each byte's first read comes from GM through one of the cores that run (not all the chip's)
            first = min(unique / cores, tpc * tile_reads)
            mte2 = first / gm_rate + (tpc * tile_reads - first) / l2_rate
        else:
            mte2 = tpc * tile_reads / gm_rate
        mte2 += g.extra_read / cores / gm_rate
        cube_tile_cycles = math.ceil(m_eff / block) * math.ceil(n_eff / block) * math.ceil(k_core / kf) * fc
        cube = tpc * cube_tile_cycles
        out_tile = m_eff * n_eff * (FP32 if split_k > 1 else g.out_itemsize)   # split-K writes fp32 partials
        gm_write = g.out_bytes if split_k == 1 else float(g.batch * g.m * g.n * FP32 * split_k)
        vec = handoff = 0.0
        mte3 = tpc * out_tile / out_rate
        vec_step = 0.0
        mte3_step = out_tile / out_rate
        hand_step = 0.0
        if vec_recipe and not norm:                            # elementwise epilogue on each output tile
            v_tile = vector_cycles(m_eff * n_eff, g.out_itemsize, vec_recipe, spec)
            if split:
                vec, vec_step = tpc * v_tile / vpc, v_tile / vpc
                handoff, hand_step = tpc * out_tile / l2_rate, out_tile / l2_rate
                mte3, mte3_step = mte3 / vpc, mte3_step / vpc
            else:
                vec, vec_step = tpc * v_tile, v_tile
        elif rowblock:                                         # whole rows in this core's UB (direct path)
            v_block = vector_cycles(m_eff * g.n, FP32, vec_recipe, spec)
            vec, vec_step = upc * v_block, v_block
            mte3, mte3_step = upc * m_eff * g.n * g.out_itemsize / out_rate, m_eff * g.n * g.out_itemsize / out_rate
        elif norm:                                             # split: AIVs read whole rows back from L2
            assert row_t is not None
            rows_aiv = math.ceil(g.batch * g.m / spec.vector_cores)
            handoff, hand_step = tpc * out_tile / l2_rate, out_tile / l2_rate
            vec = vector_cycles(rows_aiv * g.n, FP32, vec_recipe, spec)
            vec_step = vector_cycles(row_t.rows * g.n, FP32, vec_recipe, spec)
            mte3 = rows_aiv * g.n * g.out_itemsize / out_rate
            mte3_step = row_t.rows * g.n * g.out_itemsize / out_rate
        k_panel = min(FILL_K, -(-k_core // kf) * kf)
        step = {"mte2": (m_eff * g.a_row_bytes * k_panel / max(g.k, 1) + n_eff * k_panel * g.b_itemsize) / l2_rate,
                "cube": math.ceil(m_eff / block) * math.ceil(n_eff / block) * math.ceil(k_panel / kf) * fc,
                "vector": vec_step, "handoff": hand_step, "mte3": mte3_step}
        stages = {"mte2": mte2, "cube": cube, "vector": vec, "handoff": handoff, "mte3": mte3}
        gm_read = unique + g.extra_read + (0.0 if hit else max(all_reads - unique, 0.0))
        l2_traffic = all_reads if hit else 0.0
        body = max(stages.values()) + sum(step.values()) - max(step.values())
        roof = max(2.0 * macs / spec.peak_flops(cube_dtype),
                   (gm_read + gm_write) / spec.gm_bandwidth_bytes_per_s,
                   (l2_traffic + 2 * hand_bytes) / spec.l2_bandwidth_bytes_per_s) * spec.clock_hz
        return {"stages": stages, "step": step, "cores": cores, "gm_read": gm_read,
                "l2_read": max(all_reads - unique, 0.0) if hit else 0.0, "l2_traffic": l2_traffic,
                "cost": max(body, roof), "m_eff": m_eff, "gm_write": gm_write, "split_k": split_k}

    cache: dict[tuple[int, int], dict] = {}

    def score(t: Tile) -> float:
        r = evaluate(t)
        cache[(t.m, t.n)] = r
        return r["cost"]

    tile = cube_tile(g.m, g.n, g.k, in_bytes, spec, kf, score=score, m_sizes=m_sizes)
    if not tile.feasible:
        raise ValueError(f"no Cube tile: {tile.reason}")
    r = cache.get((tile.m, tile.n)) or evaluate(tile)
    if rowblock and r["m_eff"] < min(block, g.m) and not any("starved" in n for n in notes):
        notes.append(f"only {r['m_eff']} rows per Cube tile: the Cube is starved")
    epi_tile = row_t
    if vec_recipe and not norm:
        share = vpc if split else 1
        epi_tile = stream_tile(max(1, r["m_eff"] * min(tile.n, g.n) // share), spec,
                               [g.out_itemsize, g.out_itemsize], [FP32])
    if r["split_k"] > 1:
        notes.append(f"split-K: k cut over {r['split_k']} Cube cores per output tile, fp32 partial sums "
                     "added in GM")
    kind = "cube+vector" if vec_recipe else "cube"
    vec_elems = float(g.batch) * g.m * g.n if vec_recipe else 0.0
    # The L2 roofline counts every panel read (it all passes L2); the record shows the re-reads.
    return finish(op, spec, kind=kind, dtype=g.in_dtype, stages=r["stages"], step=r["step"], cores=r["cores"],
                  gm_read=r["gm_read"], gm_write=r["gm_write"], cube_flops=2.0 * macs,
                  vec_ops=vector_ops(vec_elems, vec_recipe), cube_dtype=cube_dtype, l2_read=r["l2_read"],
                  l2_traffic=r["l2_traffic"],
                  handoff_bytes=hand_bytes, tile=tile,
                  ub_bytes=epi_tile.ub_bytes_needed if epi_tile is not None else 0, feasible=feasible,
                  reason=reason, epilogue_tile=epi_tile, notes=tuple(notes))


def _band_bytes(cores: int, a_panel: float, b_panel: float) -> float:
    """Operand bytes the cores touch at once when tiles are swizzled into an r x c block (r*c = cores):
    r A panels and c B panels, at best 2*sqrt(cores * a_panel * b_panel). Re-reads hit L2 if this fits."""
    return 2.0 * math.sqrt(cores * a_panel * b_panel)


# ---- MatMul / Gemm ---------------------------------------------------------------------------------

def matmul_gemm(op: OpWork) -> tuple[Gemm, list[TensorInfo]]:
    """The GEMM behind MatMul, Gemm, MatMulInteger, QLinearMatMul and FusedMatMul; plus extra inputs."""
    t = op.op_type
    if t == "QLinearMatMul":
        a, b, extra = op.input(0), op.input(3), [x for x in op.inputs[1:3] + op.inputs[4:] if x is not None]
    else:
        a, b = op.input(0), op.input(1)
        extra = [x for x in op.inputs[2:] if x is not None]
    ad, bd = _dims(a, "input A"), _dims(b, "input B")
    assert a is not None and b is not None
    if t == "Gemm":
        m, k = (ad[1], ad[0]) if op.attrs.get("transA", 0) else (ad[0], ad[-1])
        n = bd[0] if op.attrs.get("transB", 0) else bd[-1]
        batch, b_shared = 1, True
    else:
        m, k = (1, ad[0]) if len(ad) == 1 else (ad[-2], ad[-1])
        if len(bd) == 1:
            n = 1
        elif t == "MatMulNBits":
            n = int(op.attrs.get("N", bd[0]))
        else:
            n = bd[-1]
        out = op.outputs[0] if op.outputs else None
        batch = max(1, out.numel // max(m * n, 1)) if out is not None and out.shape else \
            max(1, math.prod(ad[:-2]) if len(ad) > 2 else 1, math.prod(bd[:-2]) if len(bd) > 2 else 1)
        b_shared = len(bd) <= 2
    out_t = op.outputs[0] if op.outputs else TensorInfo((batch, m, n), a.dtype)
    b_item = b.nbytes / max(k * n * (1 if b_shared else batch), 1)
    g = Gemm(batch=batch, m=m, n=n, k=k, in_dtype=a.dtype, a_row_bytes=k * a.itemsize, a_bytes=float(a.nbytes),
             b_bytes=float(b.nbytes), b_itemsize=b_item, out_itemsize=out_t.itemsize,
             out_bytes=float(sum(o.nbytes for o in op.outputs)) or float(batch * m * n * out_t.itemsize),
             extra_read=float(sum(x.nbytes for x in extra)))
    return g, extra


def matmul(op: OpWork, spec: NpuSpec) -> KernelEstimate:
    """MatMul / Gemm (Gemm's C is added by FixPipe on the way out of L0C: read once, no Vector work)."""
    g, _ = matmul_gemm(op)
    return price_gemm(op, spec, g)


def fused_matmul(op: OpWork, spec: NpuSpec) -> KernelEstimate:
    """npufuse.FusedMatMul(A, B, bias?, gamma?, beta?) with attrs `epilogue` and `epsilon`."""
    g, _ = matmul_gemm(op)
    names = [str(e) for e in op.attrs.get("epilogue", [])]
    unknown = [e for e in names if e not in EPILOGUE and e not in NORM_EPILOGUES]
    norms = [e for e in names if e in NORM_EPILOGUES]
    # A leading bias is added by FixPipe on the way out of L0C (as for Conv and Gemm): no Vector work.
    vector_steps = names[1:] if names[:1] == ["bias"] else names
    vector_steps, notes = _fixpipe_relu(vector_steps, spec)
    recipe = add_recipes(*(EPILOGUE[e] for e in vector_steps if e in EPILOGUE))
    if unknown:
        recipe = add_recipes(recipe, (("add", float(len(unknown))),))
    # Whole-row constants in UB are the norm's gamma and beta (inputs 3, 4); the bias (input 2) never enters UB.
    fixed = tuple(float(x.nbytes) for x in op.inputs[3:] if x is not None)
    norm = add_recipes(*(NORM_EPILOGUES[e] for e in norms)) if norms else None
    if unknown:
        notes += (f"unknown epilogue step(s) {unknown} priced as one add each",)
    return price_gemm(op, spec, g, Epilogue(recipe, norm, fixed if norm else (), tuple(names)), notes)


FIXPIPE_RELU = ("relu", "Relu")


def _fixpipe_relu(steps: list[str], spec: NpuSpec) -> tuple[list[str], tuple[str, ...]]:
    """On split AIC/AIV parts (910B) the Cube's FixPipe applies a ReLU on the way out of L0C (after the bias):
    a leading ReLU is no Vector work and needs no hand-off to the Vector cores. Coupled parts run it on the
    Vector as before."""
    if spec.cube_to_vector_path == "l2" and steps[:1] and steps[0] in FIXPIPE_RELU:
        return steps[1:], ("ReLU applied by FixPipe on the way out of L0C: no Vector work, no L2 hand-off",)
    return steps, ()


# ---- Conv -----------------------------------------------------------------------------------------

# ATC's small-channel format (--enable_small_channel): C0 = 4 for a Conv reading at most 4 channels (NC1HWC0_C04,
# FRACTAL_Z_C04). With the option set, GE keeps only a Conv2D's C04 formats where its kernel offers them (hicann/ge
# op_format_dtype_judge.cc, "only keep C04 formats"); the kernel takes C04 for Cin <= 4 with K = align(4 x kh x kw,
# k0) (hicann/ops-nn conv2d_v2 arch35 tiling: C04_CIN_SIZE, conv2d_v2_base_tiling_check_limits.cpp; the 310P kernel
# is TBE, not in that repository, and is assumed to fold K the same way)
SMALL_CHANNEL_C0 = 4


def conv_gemm(op: OpWork, spec: NpuSpec) -> Gemm:
    """Conv as implicit GEMM in CANN's layouts: M = N*prod(out spatial), K = Cin per group padded to C0 per kernel
    position (the input is NC1HWC0, the weight Fractal_Z), N = Cout per group (padded to 16 by the tiling).

    C0 is the Cube's k0 (32 bytes of the dtype the Cube runs: 16 for fp16, 8 for fp32 where the Cube runs fp32,
    32 for int8). Grouped and depthwise convs are enlarged in the form CANN's conv tilings use: `mag` groups share
    one block (mag = min(lcm(lcm(cin_g, C0) / cin_g, lcm(cout_g, 16) / cout_g), groups)), so a depthwise fp16 conv
    runs ceil(C/16) block-diagonal GEMMs with K = 16 x kernel positions rather than C GEMMs of K = kernel
    positions. A 3-channel stem pads Cin to C0, unless the compile sets ATC's --enable_small_channel
    (`spec.enable_small_channel`): then a Conv of at most `SMALL_CHANNEL_C0` input channels (group 1, fp16 Cube)
    reads NC1HWC0_C04 (Cin padded to 4) and its FRACTAL_Z_C04 weight folds Cin x kernel positions into one K,
    padded to 16 once: a 7x7 RGB stem runs K = 208, not 16 x 49 = 784.
    The output is NC1HWC0 too: its GM bytes are Cout padded to 16."""
    x, w = op.input(0), op.input(1)
    xd, wd = _dims(x, "input X"), _dims(w, "weight W")
    assert x is not None and w is not None
    group = max(1, int(op.attrs.get("group", 1)))
    nsp = len(xd) - 2
    if nsp < 1:
        raise ValueError("Conv input has no spatial dims")
    ks = [int(k) for k in (op.attrs.get("kernel_shape") or wd[2:])]
    out = op.outputs[0] if op.outputs else None
    a_bytes, b_bytes = float(x.nbytes), float(w.nbytes)
    if op.op_type == "ConvTranspose":
        cin_g, cout = xd[1] // group, wd[1] * group
        m_rows = xd[0] * math.prod(xd[2:])
        k, n, batch = cin_g, (cout // group) * math.prod(ks), group
    else:
        if out is not None and len(out.shape) == len(xd) and all(d > 0 for d in out.shape):
            osp = list(out.shape[2:])
        else:
            osp = _conv_out(xd[2:], ks, op.attrs)
        m_rows = xd[0] * math.prod(osp)
        c0 = _k_fractal(spec, x.dtype)
        # W's dims where known; a symbolic Cin per group falls back to X's channels / group
        cin_g = wd[1] if w.shape[1] > 0 else max(1, xd[1] // group)
        cout_g = max(1, wd[0] // group)
        if spec.enable_small_channel and group == 1 and cin_g <= SMALL_CHANNEL_C0 and c0 == spec.cube_block:
            # C04: K = Cin (padded to 4) x kernel positions, padded to the fractal once; GM holds NC1HWC0_C04
            batch, k, n = 1, round_up(SMALL_CHANNEL_C0 * math.prod(ks), c0), round_up(cout_g, spec.cube_block)
            a_bytes *= round_up(xd[1], SMALL_CHANNEL_C0) / max(xd[1], 1)
        else:
            mag = min(math.lcm(math.lcm(cin_g, c0) // cin_g, math.lcm(cout_g, spec.cube_block) // cout_g), group)
            cin_e, cout_e = round_up(mag * cin_g, c0), round_up(mag * cout_g, spec.cube_block)
            batch, k, n = -(-group // mag), cin_e * math.prod(ks), cout_e
            # GM holds the padded layouts: NC1HWC0 activations, Fractal_Z weights (converted once, at compile time)
            a_bytes *= round_up(xd[1], c0) / max(xd[1], 1)
        b_bytes = float(batch * k * n * w.itemsize)
    out_item = out.itemsize if out is not None else x.itemsize
    out_bytes = float(out.nbytes) if out is not None else float(m_rows * n * batch * out_item)
    if op.op_type != "ConvTranspose" and out is not None and len(out.shape) > 1 and out.shape[1] > 0:
        out_bytes *= round_up(out.shape[1], spec.cube_block) / out.shape[1]   # NC1HWC0 out: C0 = 16
    extra = float(sum(t.nbytes for t in op.inputs[2:] if t is not None))
    return Gemm(batch=batch, m=m_rows, n=n, k=k, in_dtype=x.dtype, a_row_bytes=a_bytes / batch / max(m_rows, 1),
                a_bytes=a_bytes, b_bytes=b_bytes, b_itemsize=float(w.itemsize),
                out_itemsize=out_item, out_bytes=out_bytes, extra_read=extra)


def _conv_out(spatial, ks, attrs) -> list[int]:
    n = len(spatial)
    strides = list(attrs.get("strides") or [1] * n)
    dil = list(attrs.get("dilations") or [1] * n)
    pads = list(attrs.get("pads") or [0] * (2 * n))
    auto = str(attrs.get("auto_pad", "NOTSET"))
    out = []
    for i in range(n):
        if auto in ("SAME_UPPER", "SAME_LOWER"):
            out.append(-(-spatial[i] // strides[i]))
        else:
            span = dil[i] * (ks[i] - 1) + 1
            out.append(max(1, (spatial[i] + pads[i] + pads[i + n] - span) // strides[i] + 1))
    return out


_CONV_GELU_EPILOGUE = {"none": "gelu", "tanh": "gelu_tanh", "quick": "quick_gelu"}


def conv(op: OpWork, spec: NpuSpec) -> KernelEstimate:
    """Conv / FusedConv (residual add and activation epilogue). A bias is added by FixPipe on the way out of L0C.

    A FusedConv's residual Z (residual=1) is read from GM once, the output's size (conv_gemm counts every input
    after W as an extra read), and added on the Vector before the activation."""
    g = conv_gemm(op, spec)
    act = op.attrs.get("activation") if op.op_type == "FusedConv" else None
    residual = op.op_type == "FusedConv" and bool(int(op.attrs.get("residual", 0) or 0))
    affine = op.op_type == "FusedConv" and bool(int(op.attrs.get("affine", 0) or 0))
    notes: tuple[str, ...] = ()
    if act is not None and not residual and not affine:
        rest, notes = _fixpipe_relu([str(act)], spec)
        act = rest[0] if rest else None
    if act is None and not residual and not affine:
        return price_gemm(op, spec, g, notes=notes)
    if act == "Gelu":   # FusedConv's GELU epilogue costs what FusedMatMul's does, per approximation
        act = _CONV_GELU_EPILOGUE.get(str(op.attrs.get("approximate", "none")), "gelu")
    recipe = EPILOGUE.get(str(act)) if act is not None else ()
    if recipe is None:
        recipe, notes = (("add", 2.0),), (f"activation {act!r} is not modeled; priced as two adds",)
    names = ((("bn_affine",) if affine else ()) + (("residual_add",) if residual else ())
             + ((str(act),) if act is not None else ()))
    if residual:
        recipe = add_recipes(EPILOGUE["residual_add"], recipe)
    if affine:
        recipe = add_recipes(EPILOGUE["bn_affine"], recipe)
    return price_gemm(op, spec, g, Epilogue(recipe, None, (), names), notes)


# ---- Attention ------------------------------------------------------------------------------------

def _heads(t: TensorInfo, heads: int | None, what: str) -> tuple[int, int, int, int]:
    d = _dims(t, what)
    if len(d) == 4:
        return d[0], d[1], d[2], d[3]
    if len(d) == 3 and heads:
        return d[0], heads, d[1], d[2] // heads
    raise ValueError(f"{what} of shape {d} needs [batch, heads, seq, head_dim] or [batch, seq, hidden] "
                     "with num_heads")


def attention(op: OpWork, spec: NpuSpec) -> KernelEstimate:
    """Flash attention: Q blocks against K/V blocks; scores never leave the chip (L2 on split parts)."""
    q, kk, v = op.input(0), op.input(1), op.input(2)
    mask = op.input(3)
    if q is None or kk is None or v is None:
        raise ValueError("attention needs Q, K and V")
    nh = op.attrs.get("num_heads")
    nkv = op.attrs.get("kv_num_heads") or nh
    b, h, sq, d = _heads(q, int(nh) if nh else None, "Q")
    _, hkv, sk, _ = _heads(kk, int(nkv) if nkv else None, "K")
    causal = bool(op.attrs.get("causal", 0))
    block = spec.cube_block
    kf = _k_fractal(spec, q.dtype)
    split = spec.cube_to_vector_path == "l2"
    vpc = spec.vector_per_cube_core
    item = q.itemsize
    # Largest q x kv block whose scores (fp32, double buffered), probabilities and O accumulator fit UB.
    chosen: Tile | None = None
    mq_top = -(-sq // block) * block
    nk_top = -(-sk // block) * block
    for mq in [s for s in (128, 64, 32, 16) if s <= max(mq_top, block)] or [block]:
        for nk in [s for s in (512, 256, 128, 64, 32, 16) if s <= max(nk_top, block)] or [block]:
            rows = max(1, mq // (vpc if split else 1))
            t = row_tile(rows, nk, spec, [FP32, item], [FP32],
                         [rows * d * FP32, rows * 3 * FP32], what=f"a {mq}x{nk} score block")
            if t.feasible and t.rows >= rows:
                chosen = replace(t, kind="row", m=mq, n=nk)
                break
        if chosen is not None:
            break
    causal_frac = (0.5 + 0.5 * min(1.0, (chosen.m if chosen else block) / max(sq, 1))) if causal else 1.0
    flops = 4.0 * b * h * sq * sk * d * causal_frac
    unique = float(q.nbytes + kk.nbytes + v.nbytes + (mask.nbytes if mask is not None else 0))
    out_bytes = float(sum(o.nbytes for o in op.outputs)) or float(b * h * sq * d * item)
    if chosen is None:
        t = row_tile(1, block, spec, [FP32, item], [FP32], [block * d * FP32], what="a 16x16 score block")
        est = _attention_stages(op, spec, b, h, sq, sk, d, block, block, kf, item, causal_frac, unique, out_bytes,
                                mask, split, vpc, flops, q.dtype, None)
        return replace(est, feasible=False, infeasible_reason=t.reason or "no score block fits UB",
                       notes=est.notes + (t.reason,))
    return _attention_stages(op, spec, b, h, sq, sk, d, chosen.m, chosen.n, kf, item, causal_frac, unique,
                             out_bytes, mask, split, vpc, flops, q.dtype, chosen)


def _attention_stages(op, spec, b, h, sq, sk, d, mq, nk, kf, item, causal_frac, unique, out_bytes, mask, split,
                      vpc, flops, dtype, tile) -> KernelEstimate:
    block = spec.cube_block
    q_blocks = b * h * math.ceil(sq / mq)
    cores = max(1, min(spec.cube_cores, q_blocks))
    upc = math.ceil(q_blocks / cores)
    kv_tiles = math.ceil(sk / nk) * causal_frac
    d_pad = -(-d // block) * block
    cube_per_kv = ((mq // block) * (nk // block) * math.ceil(d / kf) + (mq // block) * (d_pad // block) *
                   math.ceil(nk / kf)) * _fractal_cycles(spec, dtype)
    reads_per_block = mq * d * item + kv_tiles * 2 * nk * d * item
    if mask is not None:
        reads_per_block += mask.nbytes / max(q_blocks, 1)
    total_reads = max(unique, q_blocks * reads_per_block)
    rereads = total_reads - unique
    hit = min(unique, _band_bytes(cores, mq * d * item, 2.0 * sk * d * item)) <= spec.l2_bytes
    gm_frac = (unique + (0 if hit else rereads)) / total_reads
    l2_rate = l2_bytes_per_cycle(spec, spec.cube_cores)
    per_byte = gm_frac / spec.gm_read_bytes_per_cycle_per_core + (1 - gm_frac) / l2_rate
    scores_pc = upc * mq * sk * causal_frac
    mte2 = upc * reads_per_block * per_byte
    cube = upc * kv_tiles * cube_per_kv
    per_score = _ONLINE_SOFTMAX + (_SOFTCAP if float(op.attrs.get("softcap", 0.0) or 0.0) > 0 else ())
    vec = vector_cycles(scores_pc, FP32, per_score, spec) / (vpc if split else 1)
    hand_pc = scores_pc * (FP32 + item) if split else 0.0   # S to the AIV, P back to the AIC
    handoff = hand_pc / l2_rate
    mte3 = upc * mq * d * item / spec.ub_to_gm_bytes_per_cycle_per_core / (vpc if split else 1)
    stages = {"mte2": mte2, "cube": cube, "vector": vec, "handoff": handoff, "mte3": mte3}
    steps = max(1.0, upc * kv_tiles)
    step = {k: val / steps for k, val in stages.items()}
    step["mte3"] = mte3 / upc
    hand_total = float(b * h * sq * sk * causal_frac * (FP32 + item)) if split else 0.0
    return finish(op, spec, kind="cube+vector", dtype=dtype, stages=stages, step=step, cores=cores,
                  gm_read=unique + (0.0 if hit else rereads), gm_write=out_bytes, cube_flops=flops,
                  vec_ops=vector_ops(b * h * sq * sk * causal_frac, per_score),
                  cube_dtype=spec.cube_dtype(dtype), l2_read=rereads if hit else 0.0, handoff_bytes=hand_total,
                  tile=tile, ub_bytes=tile.ub_bytes_needed if tile is not None else 0,
                  notes=_cube_dtype_notes(spec, dtype))
