"""`NpuSpec`: one Ascend-style NPU as data, loaded from a TOML profile that names the source of each number.

Shipped profiles live in `npu_model/profiles/*.toml`; a user passes a file of their own the same way
(`--target my_chip.toml`). A profile with a missing, mistyped or nonsensical field is refused with one
line that names the file, the field and what to do.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

from npufuse.console.units import format_bytes  # noqa: F401  (spec.format_bytes: where profiles are printed)
from npufuse.npu_model.impl_mode import DEFAULT_IMPLMODE, check_implmode, high_precision
from npufuse.npu_model.precision import DEFAULT_MODE, PrecisionModeError, PrecisionPolicy, canonical, policy

DEFAULT_PROFILE = "Ascend910B2"
CUBE_TO_VECTOR_PATHS = ("l2", "direct")
# Vector instruction classes whose relative cost a profile states (see `vector.repeat_cost`).
VECTOR_OP_CLASSES = ("add", "div", "exp", "ln", "sqrt", "rsqrt", "reciprocal", "erf", "tanh", "reduce")


class ProfileError(ValueError):
    """A hardware profile that cannot be used: one line saying what, where, and what to do."""


@dataclass(frozen=True)
class NpuSpec:
    """An Ascend-style NPU. Units are in the field names; sizes are per core unless the name says chip."""

    name: str
    source_path: str
    description: str
    # cores and clock
    cube_cores: int                        # AI Cores (AIC) with a Cube unit
    vector_cores: int                      # cores that run Vector-only kernels (AIV on split parts)
    clock_hz: float
    cube_to_vector_path: str               # 'l2': split AIC/AIV, hand-off through GM/L2; 'direct': L0C -> UB
    # Cube
    cube_fp16_macs_per_cycle: int          # per core: 16x16x16 = 4096
    cube_bf16_macs_per_cycle: int
    cube_fp32_macs_per_cycle: int
    cube_int8_macs_per_cycle: int
    cube_block: int                        # m / n fractal edge (16)
    # Vector
    vector_bytes_per_cycle: int            # per core: one 256-byte repeat per cycle
    vector_repeat_cost: tuple[tuple[str, float], ...]  # instruction class -> repeats per 256 bytes
    # on-chip memory, bytes per core (L2 per chip)
    ub_bytes: int
    l1_bytes: int
    l0a_bytes: int
    l0b_bytes: int
    l0c_bytes: int
    l2_bytes: int
    alignment_bytes: int
    # data movement
    gm_read_bytes_per_cycle_per_core: float    # MTE2: GM/L2 -> UB or L1
    ub_to_gm_bytes_per_cycle_per_core: float   # MTE3 / FixPipe: on chip -> GM
    gm_bandwidth_bytes_per_s: float            # chip HBM bandwidth, read + write
    l2_bandwidth_bytes_per_s: float            # chip L2 bandwidth: re-reads that hit L2, AIC -> AIV hand-off
    kernel_launch_us: float
    # the Cube has no fp32 path: fp32 MatMul/Conv run in fp16 (ATC's default precision_mode on such parts).
    # Optional `cube.fp32_as_fp16` (default false)
    cube_fp32_as_fp16: bool = False
    # the chip's MatMul kernels take the B operand (x2) in FRACTAL_NZ only: a B computed at run time whose last
    # two dims are not 16-aligned goes through a TransData kernel first (cost_model.formats)
    cube_matmul_b_fractal_only: bool = False
    # the chip's LayerNorm takes FRACTAL_NZ only with 16-aligned rows and a normalised dim below 4096: elsewhere it
    # runs in ND between TransData kernels (cost_model.formats)
    vector_layernorm_nz_needs_aligned_rows: bool = False
    # the chip's name in the Ascend kernel catalogue ("ascend910b"): which CANN kernels it has. None: not stated,
    # every kernel is taken as available (a user's own profile may leave it out)
    chip: str | None = None
    # ---- calibrated terms (optional; each default leaves the physics above as the whole price) ----------------
    # graph mode (ATC om, graph sink): the device scheduler launches a kernel while the previous one runs, so a
    # kernel takes max(body + fixed, graph_kernel_us). None: launch added serially (kernel_launch_us), as before
    launch_graph_kernel_us: float | None = None
    # eager mode (one host dispatch per op): body + fixed + eager_kernel_us. None: kernel_launch_us
    launch_eager_kernel_us: float | None = None
    launch_kernel_fixed_us: float = 0.0    # per kernel, never overlapped: pipeline ramp, scheduling, sync
    cube_efficiency_max: float = 1.0       # achieved fraction of the Cube's MAC rate on large work
    cube_efficiency_knee_cycles: float = 0.0   # Cube cycles per core at which the efficiency is half its max
    gm_fraction: float = 1.0               # achievable fraction of gm_bandwidth_bytes_per_s
    vector_cost_factor: float = 1.0        # multiplies every Vector cycle count (all repeat costs)
    # the cost model's execution mode: 'graph' (ATC om, the default) or 'eager' (see `with_mode`)
    execution_mode: str = "graph"
    # ATC's --precision_mode the model is compiled under: the dtype each kernel runs in (npu_model.precision);
    # a profile's top-level `precision_mode` (default ATC's inference default, force_fp16), `--precision-mode`
    precision_mode: str = DEFAULT_MODE
    # ATC's --op_select_implmode and --optypelist_for_implmode (npu_model.impl_mode): which kernels run their
    # high-precision implementation; Sigmoid's costs `sigmoid_high_precision_factor` times its Vector work there
    op_select_implmode: str = DEFAULT_IMPLMODE
    optypelist_for_implmode: tuple[str, ...] = ()
    # ATC's --enable_small_channel=1: a Conv reading at most 4 channels takes them in NC1HWC0_C04 (C0 = 4) with its
    # weight in FRACTAL_Z_C04 (cost_model.cube_ops.conv_gemm); off by default, as in ATC
    enable_small_channel: bool = False
    sigmoid_high_precision_factor: float = 1.0   # profile key vector.sigmoid_high_precision_factor (fitted)
    sources: tuple[tuple[str, str], ...] = field(default=(), compare=False)
    # the profile's [calibration] table (what was fitted, against what), as sorted (key, value) pairs
    calibration: tuple[tuple[str, Any], ...] = field(default=(), compare=False)
    # the user's own kernels (`--kernels FILE`, npu_model.user_kernels), which the chip runs besides CANN's
    user_kernels: tuple[Any, ...] = field(default=(), compare=False)

    # ---- derived figures ------------------------------------------------------------------------

    def with_mode(self, mode: str) -> NpuSpec:
        """The same chip priced in another execution mode ('graph' or 'eager')."""
        if mode not in EXECUTION_MODES:
            raise ValueError(f"execution mode {mode!r}: use one of {', '.join(EXECUTION_MODES)}")
        return replace(self, execution_mode=mode)

    def with_precision(self, mode: str | None) -> NpuSpec:
        """The same chip priced under another ATC precision mode (None: the profile's own); PrecisionModeError
        (a ValueError) where the mode is unknown or the chip cannot run it."""
        if mode is None:
            return self
        policy(mode, self.chip)
        return replace(self, precision_mode=canonical(mode))

    @property
    def precision(self) -> PrecisionPolicy:
        """The policy of this spec's precision mode."""
        return policy(self.precision_mode)

    def physics(self) -> NpuSpec:
        """The same chip with every calibrated term at its neutral default: the sourced physics alone."""
        return replace(self, **{fname: default for _key, fname, _rule, default in CALIBRATED_KEYS})

    def launch_terms_us(self) -> tuple[float, float]:
        """(serial, overlapped) launch cost of one kernel in this spec's execution mode: the kernel takes
        max(body + serial, overlapped). Neutral profile (no calibrated launch keys): (kernel_launch_us, 0)."""
        fixed = self.launch_kernel_fixed_us
        if self.execution_mode == "eager":
            eager = self.kernel_launch_us if self.launch_eager_kernel_us is None else self.launch_eager_kernel_us
            return fixed + eager, 0.0
        if self.launch_graph_kernel_us is None:
            return fixed + self.kernel_launch_us, 0.0
        return fixed, self.launch_graph_kernel_us

    def cube_efficiency(self, cube_cycles: float) -> float:
        """Achieved fraction of the Cube's rate for `cube_cycles` of ideal work per core: efficiency_max x
        c / (c + knee) (the knee stands for what a tile costs beyond its MACs: L1 -> L0 loads, pipeline ramp)."""
        if cube_cycles <= 0:
            return 1.0
        return self.cube_efficiency_max * cube_cycles / (cube_cycles + self.cube_efficiency_knee_cycles)

    def calibration_info(self) -> dict[str, Any]:
        """The [calibration] table as a dict ({} where the profile is not calibrated)."""
        return {k: _thaw(v) for k, v in self.calibration}

    def cube_macs_per_cycle(self, dtype: str) -> int:
        """Cube MACs per cycle per core for an input dtype (other dtypes are priced at the fp32 rate)."""
        d = dtype.lower()
        if d in ("float16", "half"):
            return self.cube_fp16_macs_per_cycle
        if d == "bfloat16":
            return self.cube_bf16_macs_per_cycle
        if d in ("int8", "uint8", "int4", "uint4"):
            return self.cube_int8_macs_per_cycle
        return self.cube_fp32_macs_per_cycle

    def cube_dtype(self, dtype: str) -> str:
        """The dtype the Cube runs an input dtype in: float16 for float32 where the Cube has no fp32 path."""
        if self.cube_fp32_as_fp16 and dtype.lower() in ("float32", "float", "fp32"):
            return "float16"
        return dtype

    def peak_flops(self, dtype: str) -> float:
        """Chip peak of the Cube in flop/s (a MAC is 2 flops)."""
        return 2.0 * self.cube_macs_per_cycle(dtype) * self.cube_cores * self.clock_hz

    def repeat_cost(self, op_class: str) -> float:
        """Vector repeats one 256-byte block of an instruction class costs (1.0 for add/mul). `sigmoid` is the
        quarter of one sigmoid (recipes count it as 4 ops: exp, two adds, a reciprocal), times the high-precision
        factor where ATC runs Sigmoid's high-precision kernel (npu_model.impl_mode)."""
        if op_class == "sigmoid":
            costs = dict(self.vector_repeat_cost)
            base = (costs["exp"] + 2 * costs["add"] + costs["reciprocal"]) / 4
            if self.sigmoid_high_precision_factor != 1.0 and \
                    high_precision("Sigmoid", self.op_select_implmode, self.optypelist_for_implmode):
                return base * self.sigmoid_high_precision_factor
            return base
        return dict(self.vector_repeat_cost)[op_class]

    def with_impl_mode(self, mode: str | None, optypes: Iterable[str] | str = ()) -> NpuSpec:
        """The same chip priced under ATC's --op_select_implmode `mode` (None: ATC's default) and
        --optypelist_for_implmode `optypes`; ImplModeError (a ValueError) for values ATC does not take."""
        mode, ops = check_implmode(mode, optypes)
        return replace(self, op_select_implmode=mode, optypelist_for_implmode=ops)

    def with_small_channel(self, on: bool) -> NpuSpec:
        """The same chip priced as a compile with ATC's --enable_small_channel set (`on`) or not."""
        return replace(self, enable_small_channel=bool(on))

    @property
    def vector_per_cube_core(self) -> int:
        """Vector units that serve one Cube core in a fused kernel (2 AIV per AIC on split parts)."""
        if self.cube_to_vector_path == "l2":
            return max(1, self.vector_cores // self.cube_cores)
        return 1

    def describe(self) -> list[tuple[str, str]]:
        """(field, human value with unit) rows for `npufuse profiles`."""
        coupled = "split AIC/AIV, hand-off through L2" if self.cube_to_vector_path == "l2" else "L0C -> UB direct"
        return [
            ("Profile", self.name),
            ("Source", self.source_path),
            ("Chip (Ascend kernels)", self.chip or "not set: every kernel taken as available"),
            ("Cube cores / Vector cores", f"{self.cube_cores} / {self.vector_cores}"),
            ("Clock", f"{self.clock_hz / 1e9:g} GHz"),
            ("Cube MACs/cycle/core fp16 | bf16 | fp32 | int8",
             f"{self.cube_fp16_macs_per_cycle} | {self.cube_bf16_macs_per_cycle} | "
             f"{self.cube_fp32_macs_per_cycle}{' (runs as fp16)' if self.cube_fp32_as_fp16 else ''} | "
             f"{self.cube_int8_macs_per_cycle}"),
            ("Cube peak fp16", f"{self.peak_flops('float16') / 1e12:.1f} TFLOP/s"),
            ("Vector per core", f"{self.vector_bytes_per_cycle} B/cycle"),
            ("UB per core", format_bytes(self.ub_bytes)),
            ("L1 / L0A / L0B / L0C per core", " / ".join(format_bytes(b) for b in
                                                         (self.l1_bytes, self.l0a_bytes, self.l0b_bytes,
                                                          self.l0c_bytes))),
            ("L2", format_bytes(self.l2_bytes)),
            ("GM read per core", f"{self.gm_read_bytes_per_cycle_per_core:g} B/cycle"),
            ("UB -> GM per core", f"{self.ub_to_gm_bytes_per_cycle_per_core:g} B/cycle"),
            ("GM bandwidth (chip)", f"{self.gm_bandwidth_bytes_per_s / 1e9:g} GB/s"),
            ("L2 bandwidth (chip)", f"{self.l2_bandwidth_bytes_per_s / 1e9:g} GB/s"),
            ("Cube -> Vector", coupled),
            ("Kernel launch", f"{self.kernel_launch_us:g} µs"),
            ("Precision mode (ATC)", self.precision_mode),
            ("Implementation mode (ATC)", self.op_select_implmode + (
                f" for {','.join(self.optypelist_for_implmode)}" if self.optypelist_for_implmode else "")),
            ("Alignment", f"{self.alignment_bytes} B"),
        ] + ([("Sigmoid, high-precision kernel", f"{self.sigmoid_high_precision_factor:g}x the Vector work")]
             if self.sigmoid_high_precision_factor != 1.0 else []) \
            + [(label, text) for key, label, text in self._calibrated_rows()]

    def _calibrated_rows(self) -> list[tuple[str, str, str]]:
        """The calibrated terms a profile sets (none on a neutral profile: its `describe` is unchanged)."""
        rows = []
        for key, fname, _kind, default in CALIBRATED_KEYS:
            value = getattr(self, fname)
            if value != default:
                rows.append((key, key, f"{value:g}"))
        return rows


def _thaw(value: Any) -> Any:
    if isinstance(value, tuple):
        if value and all(isinstance(v, tuple) and len(v) == 2 and isinstance(v[0], str) for v in value):
            return {k: _thaw(v) for k, v in value}
        return [_thaw(v) for v in value]
    return value


def _freeze(value: Any) -> Any:
    if isinstance(value, dict):
        return tuple(sorted((str(k), _freeze(v)) for k, v in value.items()))
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    return value


# ---- the profile schema: TOML key -> field, kind, and the rule it must obey ----------------------------

# kind: 'int' (a positive integer), 'float' (a positive finite number), 'path' (l2 | direct)
_SCHEMA: tuple[tuple[str, str, str], ...] = (
    ("cores.cube_cores", "cube_cores", "int"),
    ("cores.vector_cores", "vector_cores", "int"),
    ("cores.clock_hz", "clock_hz", "float"),
    ("cores.cube_to_vector_path", "cube_to_vector_path", "path"),
    ("cube.fp16_macs_per_cycle", "cube_fp16_macs_per_cycle", "int"),
    ("cube.bf16_macs_per_cycle", "cube_bf16_macs_per_cycle", "int"),
    ("cube.fp32_macs_per_cycle", "cube_fp32_macs_per_cycle", "int"),
    ("cube.int8_macs_per_cycle", "cube_int8_macs_per_cycle", "int"),
    ("cube.block", "cube_block", "int"),
    ("vector.bytes_per_cycle", "vector_bytes_per_cycle", "int"),
    ("memory.ub_bytes", "ub_bytes", "int"),
    ("memory.l1_bytes", "l1_bytes", "int"),
    ("memory.l0a_bytes", "l0a_bytes", "int"),
    ("memory.l0b_bytes", "l0b_bytes", "int"),
    ("memory.l0c_bytes", "l0c_bytes", "int"),
    ("memory.l2_bytes", "l2_bytes", "int"),
    ("memory.alignment_bytes", "alignment_bytes", "int"),
    ("bandwidth.gm_read_bytes_per_cycle_per_core", "gm_read_bytes_per_cycle_per_core", "float"),
    ("bandwidth.ub_to_gm_bytes_per_cycle_per_core", "ub_to_gm_bytes_per_cycle_per_core", "float"),
    ("bandwidth.gm_bandwidth_bytes_per_s", "gm_bandwidth_bytes_per_s", "float"),
    ("bandwidth.l2_bandwidth_bytes_per_s", "l2_bandwidth_bytes_per_s", "float"),
    ("launch.kernel_launch_us", "kernel_launch_us", "float"),
)
# Optional calibrated terms: TOML key, field, rule ('nonneg': >= 0; 'fraction': in (0, 1]; 'float': > 0), default.
CALIBRATED_KEYS: tuple[tuple[str, str, str, Any], ...] = (
    ("launch.graph_kernel_us", "launch_graph_kernel_us", "nonneg", None),
    ("launch.eager_kernel_us", "launch_eager_kernel_us", "nonneg", None),
    ("launch.kernel_fixed_us", "launch_kernel_fixed_us", "nonneg", 0.0),
    ("cube.efficiency_max", "cube_efficiency_max", "fraction", 1.0),
    ("cube.efficiency_knee_cycles", "cube_efficiency_knee_cycles", "nonneg", 0.0),
    ("bandwidth.gm_fraction", "gm_fraction", "fraction", 1.0),
    ("vector.cost_factor", "vector_cost_factor", "float", 1.0),
)
# Optional true/false keys: TOML key, field, what true means (for the message a wrong value gets); default false.
_OPTIONAL_FLAGS: tuple[tuple[str, str, str], ...] = (
    ("cube.fp32_as_fp16", "cube_fp32_as_fp16", "the Cube has no fp32 path: fp32 Cube work runs in fp16"),
    ("cube.matmul_b_fractal_only", "cube_matmul_b_fractal_only", "the chip's MatMul kernels take B in FRACTAL_NZ only"),
    ("vector.layernorm_nz_needs_aligned_rows", "vector_layernorm_nz_needs_aligned_rows",
     "the chip's LayerNorm takes FRACTAL_NZ only with 16-aligned rows"),
)
EXECUTION_MODES = ("graph", "eager")
# Every numeric key a shipped profile must give a source for (tests hold the shipped files to it).
PROFILE_KEYS: tuple[str, ...] = tuple(k for k, _, _ in _SCHEMA) + tuple(
    f"vector.repeat_cost.{c}" for c in VECTOR_OP_CLASSES)


def list_profiles() -> list[str]:
    """Names of the shipped profiles, sorted."""
    root = resources.files("npufuse.npu_model").joinpath("profiles")
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".toml"))


def load_profile(name_or_path: str) -> NpuSpec:
    """Load a shipped profile by name (case-insensitive) or a user's TOML file by path."""
    text = str(name_or_path)
    shipped = {n.lower(): n for n in list_profiles()}
    if text.lower() in shipped:
        name = shipped[text.lower()]
        res = resources.files("npufuse.npu_model").joinpath("profiles", f"{name}.toml")
        return _parse(res.read_bytes(), f"<npufuse>/npu_model/profiles/{name}.toml", name)
    path = Path(text).expanduser()
    if path.is_file():
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise ProfileError(f"{path}: cannot read the profile ({exc.strerror}); check the path and "
                               "its permissions") from None
        return _parse(data, str(path), path.stem)
    raise ProfileError(f"unknown hardware profile {text!r}: it is neither a shipped profile "
                       f"({', '.join(sorted(shipped.values()))}) nor an existing TOML file; "
                       "pass one of those names or the path of your own profile")


def _parse(data: bytes, where: str, default_name: str) -> NpuSpec:
    try:
        doc = tomllib.loads(data.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ProfileError(f"{where}: not valid TOML ({msg}); fix the syntax or start from a shipped "
                           "profile (`npufuse profiles`)") from None
    values: dict[str, Any] = {}
    for key, fname, kind in _SCHEMA:
        values[fname] = _check(where, key, _lookup(doc, key), kind)
    costs = []
    for c in VECTOR_OP_CLASSES:
        key = f"vector.repeat_cost.{c}"
        costs.append((c, _check(where, key, _lookup(doc, key), "float")))
    values["vector_repeat_cost"] = tuple(costs)
    for key, fname, meaning in _OPTIONAL_FLAGS:
        flag = _lookup(doc, key)
        if flag is not _MISSING:
            if not isinstance(flag, bool):
                raise ProfileError(f"{where}: field '{key}' is {flag!r}; it must be true ({meaning}) or false")
            values[fname] = flag
    for key, fname, rule, _default in CALIBRATED_KEYS:
        value = _lookup(doc, key)
        if value is not _MISSING:
            values[fname] = _check_calibrated(where, key, value, rule)
    factor = _lookup(doc, "vector.sigmoid_high_precision_factor")
    if factor is not _MISSING:
        values["sigmoid_high_precision_factor"] = _check(where, "vector.sigmoid_high_precision_factor", factor,
                                                         "float")
    for small in ("l0a_bytes", "l0b_bytes"):
        if values[small] > values["l1_bytes"]:
            raise ProfileError(f"{where}: field 'memory.{small}' ({values[small]}) is larger than "
                               f"'memory.l1_bytes' ({values['l1_bytes']}); L0A/L0B are filled from L1, "
                               "so L1 must be at least as large: fix one of the two")
    align = values["alignment_bytes"]
    if align & (align - 1):
        raise ProfileError(f"{where}: field 'memory.alignment_bytes' is {align}; it must be a power of two "
                           "(32 on Ascend parts)")
    if values["cube_block"] & (values["cube_block"] - 1):
        raise ProfileError(f"{where}: field 'cube.block' is {values['cube_block']}; it must be a power of "
                           "two (16 on Ascend parts)")
    name = doc.get("name", default_name)
    if not isinstance(name, str) or not name.strip():
        raise ProfileError(f"{where}: field 'name' must be a non-empty string; name the profile or drop the "
                           "key to use the file name")
    description = doc.get("description", "")
    chip = _chip(where, doc.get("chip"))
    mode = doc.get("precision_mode", DEFAULT_MODE)
    try:
        policy(mode if isinstance(mode, str) else repr(mode), chip)
    except PrecisionModeError as exc:
        raise ProfileError(f"{where}: field 'precision_mode': {exc}") from None
    values["precision_mode"] = canonical(mode)
    sources = doc.get("sources", {})
    if not isinstance(sources, dict):
        raise ProfileError(f"{where}: '[sources]' must be a table of key = \"where the number came from\"")
    calibration = doc.get("calibration", {})
    if not isinstance(calibration, dict):
        raise ProfileError(f"{where}: '[calibration]' must be a table (as `npufuse calibrate` writes it)")
    return NpuSpec(name=name.strip(), source_path=where, description=str(description), chip=chip,
                   sources=tuple(sorted((str(k), str(v)) for k, v in sources.items())),
                   calibration=_freeze(calibration), **values)


def _check_calibrated(where: str, key: str, value: Any, rule: str) -> float:
    """An optional calibrated term: a finite number, >= 0 ('nonneg'), in (0, 1] ('fraction') or > 0 ('float')."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(float(value)):
        raise ProfileError(f"{where}: field '{key}' is {value!r}; it must be a finite number")
    v = float(value)
    if rule == "nonneg" and v < 0:
        raise ProfileError(f"{where}: field '{key}' is {value!r}; it must be zero or positive (µs or cycles)")
    if rule == "fraction" and not 0 < v <= 1:
        raise ProfileError(f"{where}: field '{key}' is {value!r}; it must be a fraction in (0, 1]")
    if rule == "float" and v <= 0:
        raise ProfileError(f"{where}: field '{key}' is {value!r}; it must be a positive number")
    return v


def _chip(where: str, value: Any) -> str | None:
    """The optional top-level `chip`: a chip name of the Ascend kernel catalogue, lower case."""
    if value is None:
        return None
    from npufuse.npu_model.ascend_kernels import known_chips

    known = known_chips()
    if not isinstance(value, str) or value.strip().lower() not in known:
        raise ProfileError(f"{where}: field 'chip' is {value!r}; it must be one of the chips of the Ascend kernel "
                           f"catalogue ({', '.join(known)}), e.g. \"ascend910b\" for a 910B part, or left out "
                           "(then every kernel is taken as available)")
    return value.strip().lower()


def _lookup(doc: dict, dotted: str) -> Any:
    node: Any = doc
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


_MISSING = object()


def _check(where: str, key: str, value: Any, kind: str) -> Any:
    section, _, leaf = key.rpartition(".")
    if value is _MISSING:
        raise ProfileError(f"{where}: field '{key}' is missing; add `{leaf} = ...` under [{section}] "
                           "(see a shipped profile, `npufuse profiles`)")
    if kind == "path":
        if value not in CUBE_TO_VECTOR_PATHS:
            raise ProfileError(f"{where}: field '{key}' is {value!r}; it must be 'l2' (split AIC/AIV, as on "
                               "910B) or 'direct' (L0C -> UB, as on 910A / 310P)")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProfileError(f"{where}: field '{key}' is {value!r} ({type(value).__name__}); it must be a "
                           f"{'whole number' if kind == 'int' else 'number'}")
    if kind == "int" and not (isinstance(value, int) or float(value).is_integer()):
        raise ProfileError(f"{where}: field '{key}' is {value!r}; it must be a whole number")
    if not math.isfinite(float(value)) or value <= 0:
        raise ProfileError(f"{where}: field '{key}' is {value!r}; it must be a positive "
                           f"{'whole number' if kind == 'int' else 'number'}")
    return int(value) if kind == "int" else float(value)
