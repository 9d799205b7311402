"""A calibration row -> the kernels npufuse would run for it, each with its recorded pricing basis.

- Kernel rows (a GEMM, Conv or flash-attention shape, `mode = "kernel"`): the one kernel, built as the cost model's
  work record straight from the recipe string ("gemm m= n= k= ...", "conv N= Cin= H= W= Cout= k=3x3 stride s pad p",
  "flash attention fwd b= heads= s_q= s_kv= d= ..."), with the dtypes the recipe states (a GEMM writing fp32 C).
- Model rows: the recipe ONNX named in the workloads index (npu_model/calibration/workloads.toml), fused by the
  engine for the target (verification off) at the row's batch / sequence, then every kernel of the fused graph
  priced under the ATC precision mode the row's dtype names (fp16: force_fp16, ATC's default, as the 310P om rows
  ran), through the same estimate as `npufuse report` and `optimize` (cost_model.precision).

The engine fuses a recipe once per run (at the sizes of its first row: which patterns match does not depend on
the batch or sequence) and each row prices that fused graph at its own sizes; builds are cached per (workload,
batch, seq, image size). `disable` names patterns the engine must not apply (`npufuse calibrate --disable`): the
graph a published om ran is ATC's, whose fusions may be fewer than npufuse's.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from npufuse.calibrate.data import Row
from npufuse.cost_model import OpWork, TensorInfo, estimate_op
from npufuse.cost_model.kernel import KernelEstimate
from npufuse.npu_model.spec import NpuSpec

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

CALIBRATION_DIR = Path(__file__).resolve().parent.parent / "npu_model" / "calibration"
INDEX = CALIBRATION_DIR / "workloads.toml"
_DTYPES = {"fp16": "float16", "float16": "float16", "bf16": "bfloat16", "bfloat16": "bfloat16",
           "fp32": "float32", "float32": "float32", "int8": "int8"}
# A model row's dtype -> the ATC precision mode its om was compiled under (kernel rows state their own dtypes).
ROW_PRECISION_MODES = {"float16": "force_fp16", "bfloat16": "allow_mix_precision_bf16",
                       "float32": "must_keep_origin_dtype"}


class Unbuildable(Exception):
    """A row npufuse cannot build: the reason goes in the table instead of a modeled time."""


@dataclass(frozen=True)
class Built:
    """The kernels of one row (views included: they cost nothing)."""

    kernels: tuple[KernelEstimate, ...]
    what: str                  # "kernel" or the recipe file


def is_kernel_row(row: Row) -> bool:
    return row.mode == "kernel" or bool(re.match(r"\s*(gemm|conv|flash attention)\b", row.recipe))


def _num(recipe: str, key: str) -> int:
    m = re.search(rf"(?<![A-Za-z_]){re.escape(key)}\s*=\s*(\d+)", recipe)
    if not m:
        raise Unbuildable(f"recipe {recipe!r} has no {key}=")
    return int(m.group(1))


def _dtype(name: str) -> str:
    return _DTYPES.get(name.lower(), "float16")


def kernel_work(row: Row) -> OpWork:
    """The one kernel a kernel row measured, as cost-model work."""
    r = row.recipe
    dt = _dtype(row.dtype)
    if r.lstrip().startswith("gemm"):
        m, n, k = _num(r, "m"), _num(r, "n"), _num(r, "k")
        out = "float32" if re.search(r"\bC fp32\b", r) else dt
        b_t = bool(re.search(r"B n x k|B\^T", r))
        b = TensorInfo((n, k) if b_t else (k, n), dt)
        return OpWork(row.workload, "Gemm", "", (TensorInfo((m, k), dt), b), (TensorInfo((m, n), out),),
                      {"transB": 1} if b_t else {})
    if r.lstrip().startswith("conv"):
        n, cin, h, w, cout = (_num(r, x) for x in ("N", "Cin", "H", "W", "Cout"))
        km = re.search(r"k\s*=\s*(\d+)x(\d+)", r)
        kh, kw = (int(km.group(1)), int(km.group(2))) if km else (1, 1)
        stride = int(m.group(1)) if (m := re.search(r"stride\s*(\d+)", r)) else 1
        pad = int(m.group(1)) if (m := re.search(r"pad\s*(\d+)", r)) else 0
        ho, wo = (h + 2 * pad - kh) // stride + 1, (w + 2 * pad - kw) // stride + 1
        return OpWork(row.workload, "Conv", "", (TensorInfo((n, cin, h, w), dt), TensorInfo((cout, cin, kh, kw), dt)),
                      (TensorInfo((n, cout, ho, wo), dt),),
                      {"kernel_shape": [kh, kw], "strides": [stride, stride], "pads": [pad] * 4})
    if r.lstrip().startswith("flash attention"):
        b, h, sq, skv, d = (_num(r, x) for x in ("b", "heads", "s_q", "s_kv", "d"))
        out = "float32" if re.search(r"\bO fp32\b", r) else dt
        causal = 1 if re.search(r"(?<!non-)causal", r) else 0
        return OpWork(row.workload, "FusedAttention", "npufuse",
                      (TensorInfo((b, h, sq, d), dt), TensorInfo((b, h, skv, d), dt), TensorInfo((b, h, skv, d), dt)),
                      (TensorInfo((b, h, sq, d), out),), {"num_heads": h, "causal": causal})
    raise Unbuildable(f"kernel recipe {r!r} is not a gemm / conv / flash attention shape")


def read_index(path: Path = INDEX) -> dict[str, dict[str, Any]]:
    """The workloads index: name -> {file, dims, image_size, exact, missing}. {} where there is none."""
    if not path.is_file():
        return {}
    with open(path, "rb") as f:
        doc = tomllib.load(f)
    out = {}
    for name, entry in (doc.get("workload") or {}).items():
        if isinstance(entry, dict):
            out[str(name)] = dict(entry, _dir=str(path.parent))
    return out


class Builder:
    """Builds rows for one target, caching each distinct build."""

    def __init__(self, spec: NpuSpec, index: dict[str, dict[str, Any]] | None = None,
                 disable: tuple[str, ...] = ()) -> None:
        self.spec = spec
        self.index = read_index() if index is None else index
        self.disable = tuple(disable)
        self._before: dict[tuple, Any] = {}
        self._cache: dict[tuple, Built | Unbuildable] = {}
        self._fused: dict[tuple, Any] = {}

    def build(self, row: Row) -> Built:
        key = row.key
        if key not in self._cache:
            try:
                self._cache[key] = self._build(row)
            except Unbuildable as exc:
                self._cache[key] = exc
        got = self._cache[key]
        if isinstance(got, Unbuildable):
            raise got
        return got

    def _build(self, row: Row) -> Built:
        if is_kernel_row(row):
            # the recipe states each tensor's dtype: priced as written
            return Built((estimate_op(kernel_work(row), self.spec.with_precision("origin")),), "kernel")
        entry = self.index.get(row.workload)
        if entry is None:
            raise Unbuildable(f"no recipe for workload {row.workload!r} in {INDEX.name}")
        if entry.get("missing"):
            raise Unbuildable(f"recipe missing: {entry['missing']}")
        return self._model(row, entry)

    def _model(self, row: Row, entry: dict[str, Any]) -> Built:
        from npufuse.cost_model import estimate_ops
        from npufuse.fusion.branches import ops_through_branches
        from npufuse.fusion.costing import CostShapes
        from npufuse.ir.graph import Graph

        file = Path(entry["_dir"]) / str(entry.get("file", ""))
        if not file.is_file():
            alt = Path(entry["_dir"]) / "workloads" / str(entry.get("file", ""))
            if not alt.is_file():
                raise Unbuildable(f"recipe file {entry.get('file')!r} not found")
            file = alt
        image = entry.get("image_size")
        if row.image_size and image and int(image) != row.image_size:
            raise Unbuildable(f"recipe is built for image size {image}, the row is {row.image_size}")
        dims = {}
        for field, name in (entry.get("dims") or {}).items():
            value = {"batch": row.batch, "seq_len": row.seq_len, "image_size": row.image_size}.get(field)
            if value is not None:
                dims[str(name)] = int(value)
        spec = self.row_spec(row)
        result, types, before = self._fuse(file, dims, spec)
        g = Graph(result.model, str(file.parent), types)
        # as `npufuse report` prices it: an If costs its costlier branch (fusion.branches)
        ops = ops_through_branches(g, CostShapes(result.model, dims, fallback=CostShapes(before, dims)), spec,
                                   str(file.parent), dims, [])
        return Built(estimate_ops(ops, spec).kernels, file.name)

    def row_spec(self, row: Row) -> NpuSpec:
        """The spec a model row is priced on: the target under the precision mode of the row's dtype and the
        operator implementation mode of its published compile (`atc_op_select_implmode`, ATC's default where the
        row gives none), with ATC's small-channel format where that compile set it (`atc_enable_small_channel`)."""
        mode = ROW_PRECISION_MODES.get(_dtype(row.dtype))
        if mode is None:
            raise Unbuildable(f"model rows in {row.dtype} are not modeled (no ATC precision mode gives it)")
        return self.spec.with_precision(mode).with_impl_mode(row.implmode, row.impl_optypes) \
            .with_small_channel(row.small_channel)

    def _fuse(self, file: Path, dims: dict[str, int], spec: NpuSpec) -> Any:
        key = (str(file), spec.precision_mode, spec.op_select_implmode, spec.optypelist_for_implmode,
               spec.enable_small_channel)
        if key not in self._fused:
            from npufuse.fusion.engine import OptimizeOptions, optimize, require_patterns
            from npufuse.ir.modelio import load_model
            from npufuse.prepare.infer import infer_value_types
            from npufuse.prepare.normalize import normalize

            model = load_model(file)
            before, types = normalize(model, str(file.parent))
            opts = OptimizeOptions(patterns=require_patterns(None, self.disable), spec=spec, verify=False,
                                   dims=dims)
            result = optimize(model, str(file.parent), opts)
            after_types = dict(types)
            after_types.update({k: v for k, v in infer_value_types(result.model).items() if k not in after_types})
            self._fused[key] = (result, after_types, before)
        return self._fused[key]

