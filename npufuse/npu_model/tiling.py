"""Tile choice under the on-chip limits of an `NpuSpec`.

Three shapes of work:
- Cube work (GEMM, implicit-GEMM conv): an m x n output tile in L0C, k-steps that fit L0A / L0B with double
  buffering, and k-panels of A and B staged in L1 with double buffering; m and n are multiples of the
  fractal edge (16), k a multiple of the Cube's k fractal.
- Row work (norms, softmax): whole rows of the reduced axis in UB; the in/out streams double buffered,
  live temporaries single, constants (gamma, beta) once.
- Stream work (elementwise): a flat run of elements in UB; the streams double buffered.
Every UB buffer is rounded up to the profile's alignment (32 bytes). A tile says which limit bound it:
'ub', 'l0a', 'l0b', 'l0c', 'l1', or 'none' (the whole problem fits), or that no tile fits and why.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

from npufuse.console.units import format_bytes
from npufuse.npu_model.spec import NpuSpec

DOUBLE_BUFFER = 2        # depth of every streamed buffer (ping-pong)
ACC_BYTES = 4            # L0C accumulates in fp32 / int32


def round_up(x: int, q: int) -> int:
    return -(-int(x) // q) * q


def round_down(x: int, q: int) -> int:
    return (int(x) // q) * q


@dataclass(frozen=True)
class Tile:
    """One tile choice: sizes, the on-chip bytes it needs, which limit bound it, or why none fits."""

    kind: str                    # 'cube' | 'row' | 'stream'
    feasible: bool
    bound_by: str                # 'ub' | 'l0a' | 'l0b' | 'l0c' | 'l1' | 'none'
    ub_bytes_needed: int = 0
    reason: str = ""             # why no tile fits (infeasible), or a note on the choice
    # Cube tiles
    m: int = 0                   # output rows per tile (multiple of 16)
    n: int = 0                   # output columns per tile (multiple of 16)
    k: int = 0                   # k-step held in L0A / L0B
    k_l1: int = 0                # k-panel held in L1
    l1_bytes_needed: int = 0
    l0a_bytes_needed: int = 0
    l0b_bytes_needed: int = 0
    l0c_bytes_needed: int = 0
    # Row / stream tiles
    rows: int = 0                # whole rows per tile (row work)
    cols: int = 0                # elements per row (row work)
    elems: int = 0               # elements per tile (stream work; rows * cols for row work)
    depth: int = DOUBLE_BUFFER
    strategy: str = ""           # row work that needed a fall-back: 'single-buffered' or 'two-pass'

    def describe(self) -> str:
        """A short human form: '128x256 k64/320 (L0C)', '8 rows x 1024 (none)', '16384 elems (UB)'."""
        if not self.feasible:
            return f"no tile fits ({self.reason})"
        limit = self.bound_by.upper() if self.bound_by != "none" else "fits whole"
        if self.kind == "cube":
            return f"{self.m}x{self.n} k{self.k}/{self.k_l1} ({limit})"
        if self.kind == "row" and self.strategy == "two-pass":
            return f"two-pass, row split in chunks of {self.cols} ({limit}, {format_bytes(self.ub_bytes_needed)} UB)"
        if self.kind == "row":
            single = ", single-buffered" if self.strategy == "single-buffered" else ""
            return f"{self.rows} rows x {self.cols} ({limit}{single}, {format_bytes(self.ub_bytes_needed)} UB)"
        return f"{self.elems} elems ({limit}, {format_bytes(self.ub_bytes_needed)} UB)"

    def to_dict(self) -> dict:
        # every field is a plain scalar: read directly, not through asdict's deep copy (a 100k-node graph's
        # report has 100k tiles)
        d = {k: v for k in _TILE_FIELDS if (v := getattr(self, k)) not in (0, "") or k in ("feasible", "bound_by")}
        d["summary"] = self.describe()
        return d


_TILE_FIELDS = tuple(f.name for f in fields(Tile))


# ---- Cube ----------------------------------------------------------------------------------------------

# m / n tile sizes the Cube search tries, whatever the problem: a tile larger than the problem just covers
# it (so a bigger problem never gets a choice a smaller one lacked, which keeps costs monotone in size).
CUBE_TILE_SIZES = (16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)


def cube_tile_for(m_tile: int, n_tile: int, k: int, in_bytes: int, spec: NpuSpec, k_frac: int,
                  m: int | None = None, n: int | None = None) -> Tile:
    """The k-steps (L0A/L0B) and k-panel (L1) for a fixed m_tile x n_tile output tile.

    Given the problem's m and n, a tile larger than the problem is clamped to it (rounded up to the fractal):
    it holds only the real rows and columns.
    """
    in_bytes = max(1, in_bytes)
    if m is not None:
        m_tile = min(m_tile, round_up(max(m, 1), spec.cube_block))
    if n is not None:
        n_tile = min(n_tile, round_up(max(n, 1), spec.cube_block))
    k_full = round_up(max(k, 1), k_frac)
    l0c = m_tile * n_tile * ACC_BYTES
    if l0c > spec.l0c_bytes:
        return Tile("cube", False, "l0c", reason=f"an {m_tile}x{n_tile} fp32 accumulator needs "
                    f"{format_bytes(l0c)} of L0C, more than the {format_bytes(spec.l0c_bytes)} on {spec.name}",
                    m=m_tile, n=n_tile, l0c_bytes_needed=l0c)
    k_a = round_down(spec.l0a_bytes // (DOUBLE_BUFFER * m_tile * in_bytes), k_frac)
    k_b = round_down(spec.l0b_bytes // (DOUBLE_BUFFER * n_tile * in_bytes), k_frac)
    k0 = min(k_a, k_b, k_full)
    if k0 < k_frac:
        which = "l0a" if k_a <= k_b else "l0b"
        return Tile("cube", False, which, reason=f"an {m_tile}x{k_frac} operand step does not fit "
                    f"{which.upper()} with double buffering on {spec.name}", m=m_tile, n=n_tile)
    per_k = DOUBLE_BUFFER * (m_tile + n_tile) * in_bytes
    k1 = min(round_down(spec.l1_bytes // per_k, k0), round_up(k_full, k0))
    if k1 < k0:
        return Tile("cube", False, "l1", reason=f"A and B panels of k={k0} do not fit L1 "
                    f"({format_bytes(spec.l1_bytes)}) with double buffering on {spec.name}", m=m_tile, n=n_tile)
    # Which limit stopped the tile from growing.
    m_all = m is None or m_tile >= round_up(m, spec.cube_block)
    n_all = n is None or n_tile >= round_up(n, spec.cube_block)
    grow_m = 2 * m_tile * n_tile * ACC_BYTES > spec.l0c_bytes
    if not (m_all and n_all) and grow_m:
        bound = "l0c"
    elif k0 < k_full:
        bound = "l0a" if k_a <= k_b else "l0b"
    elif k1 < k_full:
        bound = "l1"
    else:
        bound = "none"
    return Tile("cube", True, bound, 0, "", m=m_tile, n=n_tile, k=k0, k_l1=k1,
                l1_bytes_needed=per_k * k1, l0a_bytes_needed=DOUBLE_BUFFER * m_tile * k0 * in_bytes,
                l0b_bytes_needed=DOUBLE_BUFFER * n_tile * k0 * in_bytes, l0c_bytes_needed=l0c)


def cube_tile(m: int, n: int, k: int, in_bytes: int, spec: NpuSpec, k_frac: int = 16,
              score: Callable[[Tile], float] | None = None, m_sizes: Sequence[int] | None = None) -> Tile:
    """The best feasible Cube tile for an m x n x k GEMM.

    `score` (lower is better) is the caller's cost of a tile, e.g. the modeled kernel time; by default the
    tile with the most MACs per operand byte, m*n/(m+n), wins (fewest operand re-reads). `m_sizes`
    restricts the m tile (a fused norm epilogue limits it to the rows that fit UB).
    """
    ms = list(m_sizes) if m_sizes is not None else [x for x in CUBE_TILE_SIZES if x % spec.cube_block == 0]
    ns = [x for x in CUBE_TILE_SIZES if x % spec.cube_block == 0] or [spec.cube_block]
    best: tuple[float, int, Tile] | None = None
    first_refusal: Tile | None = None
    for mt in ms:
        for nt in ns:
            t = cube_tile_for(mt, nt, k, in_bytes, spec, k_frac, m, n)
            if not t.feasible:
                first_refusal = first_refusal or t
                continue
            s = score(t) if score is not None else -float(mt * nt) / (mt + nt)
            key = (s, mt * nt)   # ties (tiles larger than the problem): the smaller tile
            if best is None or key < best[:2]:
                best = (key[0], key[1], t)
    if best is None:
        return first_refusal or Tile("cube", False, "l0c", reason=f"no Cube tile fits on {spec.name}")
    return best[2]


# ---- Vector --------------------------------------------------------------------------------------------

def _aligned(nbytes: float, align: int) -> int:
    return round_up(int(-(-nbytes // 1)), align) if nbytes > 0 else 0


def row_tile(rows: int, cols: int, spec: NpuSpec, stream_bytes: Sequence[float], temp_bytes: Sequence[float] = (),
             fixed_bytes: Sequence[float] = (), what: str = "", ub_bytes: int | None = None,
             depth: int = DOUBLE_BUFFER) -> Tile:
    """Whole rows of `cols` elements in UB: the most rows (up to `rows`) that fit.

    stream_bytes: bytes per element of each streamed buffer (inputs and outputs), kept `depth` deep;
    temp_bytes: bytes per element of each live temporary (one copy); fixed_bytes: whole buffers loaded once
    (gamma, beta). `what` names a row for the refusal ("a row of 16384 float16 elements").
    """
    ub = spec.ub_bytes if ub_bytes is None else ub_bytes
    a = spec.alignment_bytes
    per_row = sum(depth * _aligned(cols * b, a) for b in stream_bytes) + sum(
        _aligned(cols * b, a) for b in temp_bytes)
    fixed = sum(_aligned(b, a) for b in fixed_bytes)
    need_one = per_row + fixed
    if need_one > ub:
        what = what or f"a row of {cols} elements"
        how = "with double buffering" if depth == DOUBLE_BUFFER else "single-buffered"
        return Tile("row", False, "ub", need_one, f"{what} {how} needs {format_bytes(need_one)} "
                    f"of UB, more than the {format_bytes(ub)} on {spec.name}", rows=0, cols=cols, depth=depth)
    fit = (ub - fixed) // max(per_row, 1)
    r = max(1, min(rows, fit))
    return Tile("row", True, "ub" if fit < rows else "none", per_row * r + fixed, rows=r, cols=cols,
                elems=r * cols, depth=depth)


def row_strategies(rows: int, cols: int, spec: NpuSpec, stream_bytes: Sequence[float],
                   temp_bytes: Sequence[float] = (), fixed_bytes: Sequence[float] = (), what: str = "") -> list[Tile]:
    """The feasible ways CANN's norm kernels tile whole-row work, in its order of preference.

    Whole rows double buffered (`row_tile`) where one fits; else whole rows single-buffered (loads, compute and
    stores of a tile no longer overlap); and always, where the row does not fit double buffered, split-row
    two-pass: the row in chunks that fit double buffered with their share of the per-column constants, a first
    pass for the statistics and a second that normalises (the input is read twice). The caller prices each
    and takes the cheapest. Empty where not even 32 elements fit; the refusal is then `row_tile`'s.
    """
    whole = row_tile(rows, cols, spec, stream_bytes, temp_bytes, fixed_bytes, what)
    if whole.feasible:
        return [whole]
    out = []
    single = row_tile(rows, cols, spec, stream_bytes, temp_bytes, fixed_bytes, what, depth=1)
    if single.feasible:
        out.append(Tile("row", True, single.bound_by, single.ub_bytes_needed, whole.reason, rows=single.rows,
                        cols=cols, elems=single.elems, depth=1, strategy="single-buffered"))
    a = spec.alignment_bytes
    per_elem = DOUBLE_BUFFER * sum(stream_bytes) + sum(temp_bytes) + sum(fixed_bytes) / max(cols, 1)
    slack = (DOUBLE_BUFFER * len(stream_bytes) + len(temp_bytes) + len(fixed_bytes)) * a
    chunk = min(round_down(int((spec.ub_bytes - slack) // max(per_elem, 1e-9)), a), round_up(cols, a))
    if chunk >= a:
        need = sum(DOUBLE_BUFFER * _aligned(chunk * b, a) for b in stream_bytes) + sum(
            _aligned(chunk * b, a) for b in temp_bytes) + sum(_aligned(b * chunk / max(cols, 1), a)
                                                              for b in fixed_bytes)
        out.append(Tile("row", True, "ub", need, whole.reason, rows=1, cols=chunk, elems=chunk,
                        strategy="two-pass"))
    return out


def stream_tile(elems: int, spec: NpuSpec, stream_bytes: Sequence[float], temp_bytes: Sequence[float] = (),
                fixed_bytes: Sequence[float] = (), ub_bytes: int | None = None) -> Tile:
    """A flat run of elements (elementwise work): the most elements, up to `elems`, that fit UB.

    Tiles are whole multiples of `alignment_bytes` elements so that every buffer stays 32-byte aligned.
    """
    ub = spec.ub_bytes if ub_bytes is None else ub_bytes
    a = spec.alignment_bytes
    per_elem = DOUBLE_BUFFER * sum(stream_bytes) + sum(temp_bytes)
    fixed = sum(_aligned(b, a) for b in fixed_bytes)
    quantum = a  # elements: a multiple of 32 elements is a multiple of 32 bytes for any element size
    slack = (DOUBLE_BUFFER * len(stream_bytes) + len(temp_bytes)) * a  # rounding of fractional buffers
    room = ub - fixed - slack
    fit = round_down(int(room // max(per_elem, 1e-9)), quantum) if room > 0 else 0
    if fit < quantum:
        need = int(per_elem * quantum) + fixed
        return Tile("stream", False, "ub", need, f"{quantum} elements with double buffering need "
                    f"{format_bytes(need)} of UB, more than the {format_bytes(ub)} on {spec.name}")
    want = round_up(max(elems, 1), quantum)
    e = min(want, fit)
    need = sum(DOUBLE_BUFFER * _aligned(e * b, a) for b in stream_bytes) + sum(
        _aligned(e * b, a) for b in temp_bytes) + fixed
    return Tile("stream", True, "ub" if fit < want else "none", need, elems=e)
