"""Kernels the user has (`--kernels FILE`): custom fused kernels declared in TOML, which the target's chip then
runs for the regions they match, as it runs the shipped CANN kernels.

    [[kernel]]
    name = "MatMulLayerNorm"            # the user's kernel
    implements = "FusedMatMul"          # an npufuse fused op
    epilogue = ["bias", "layernorm"]    # FusedMatMul: exactly the epilogue steps it computes
    chips = ["ascend910b"]
    # optional
    activation = "gelu"                 # ops with an `activation` attribute (FusedConv, GatedMLP): the one it takes
    dtypes = ["float16", "float32"]     # element types of the op's first input it takes (default: any)
    max_last_dim = 8192                 # the largest last dim of the first input it takes
    last_dim_multiple = 16              # the last dim must be a multiple of this
    [[kernel.measured]]                 # measured times: used where the first input's shape is this one
    shape = [1, 128, 768]               #   (elsewhere the cost model prices the fused op as for any kernel)
    time_us = 12.5
    [kernel.atc]                        # for --emit atc: the ONNX node the kernel's ATC plugin registers
    op_type = "NPUMatMulLayerNorm"
    domain = "npu"                      # default "npu"
    version = 1                         # default 1
    attributes = { epsilon = "epsilon" }   # node attribute = the npufuse attribute it carries

A region matches when its fused node is `implements` in the npufuse domain, with that epilogue (or activation),
on one of `chips`, within the constraints. Then its kernel record names the user's kernel and no shipped kernel's
absence refuses it: the cost model prices it (or takes the measured time) and the engine fuses and verifies it as
any fusion. Validation is strict: an unknown field, an impossible constraint or a fused op npufuse does not have is
one line naming the file and the kernel.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

_KERNEL_KEYS = {"name", "implements", "epilogue", "activation", "chips", "dtypes", "max_last_dim",
                "last_dim_multiple", "measured", "atc"}
_ATC_KEYS = {"op_type", "domain", "version", "attributes"}
_DTYPES = {"float16", "bfloat16", "float32", "int8"}


class KernelsFileError(ValueError):
    """A kernels file that cannot be used: one line, what and where."""


@dataclass(frozen=True)
class AtcNode:
    """The ONNX node a user kernel's ATC plugin registers."""

    op_type: str
    domain: str
    version: int
    attributes: tuple[tuple[str, str], ...]     # (node attribute, npufuse attribute it carries)


@dataclass(frozen=True)
class UserKernel:
    name: str
    implements: str
    chips: tuple[str, ...]
    source: str                                  # the file it was declared in
    epilogue: tuple[str, ...] | None = None
    activation: str | None = None
    dtypes: tuple[str, ...] = ()
    max_last_dim: int | None = None
    last_dim_multiple: int | None = None
    measured: tuple[tuple[tuple[int, ...], float], ...] = ()
    atc: AtcNode | None = None

    def problem(self, op_type: str, attrs: Mapping[str, Any], chip: str | None, dtype: str | None,
                shape: Sequence[Any] | None) -> str | None:
        """None if this kernel runs the fused node (its op type, attributes, first input's dtype and shape) on
        `chip`, else why not (one clause)."""
        if op_type != self.implements:
            return f"{self.name} implements {self.implements}, not {op_type}"
        if chip not in self.chips:
            return f"{self.name} is declared for {', '.join(self.chips)}, not {chip}"
        if self.epilogue is not None and tuple(attrs.get("epilogue") or ()) != self.epilogue:
            return f"{self.name} computes the epilogue {list(self.epilogue)}, not {list(attrs.get('epilogue') or [])}"
        if self.activation is not None and str(attrs.get("activation", "")) != self.activation:
            return f"{self.name} takes the activation {self.activation}, not {attrs.get('activation')}"
        if self.dtypes and dtype not in self.dtypes:
            return f"{self.name} takes {', '.join(self.dtypes)}, not {dtype}"
        last = shape[-1] if shape else None
        if self.max_last_dim is not None and not (isinstance(last, int) and last <= self.max_last_dim):
            return f"{self.name} takes a last dim up to {self.max_last_dim}, not {last}"
        if self.last_dim_multiple is not None and not (isinstance(last, int) and last % self.last_dim_multiple == 0):
            return f"{self.name} takes a last dim that is a multiple of {self.last_dim_multiple}, not {last}"
        return None

    def measured_us(self, shape: Sequence[Any] | None) -> float | None:
        """The measured time of a call whose first input has `shape`, where the file gives one."""
        key = tuple(shape) if shape is not None else None
        return next((t for s, t in self.measured if s == key), None)


def _fail(path: str, where: str, what: str) -> KernelsFileError:
    return KernelsFileError(f"{path}: {where}: {what}")


def parse_kernels(text: str, path: str, fused_ops: Mapping[str, tuple[str, ...]],
                  epilogue_steps: Sequence[str], chips: Sequence[str]) -> tuple[UserKernel, ...]:
    """The kernels of a kernels file. `fused_ops`: npufuse op type -> its attributes (what `implements` may name);
    `epilogue_steps`: FusedMatMul's steps; `chips`: the chip names the catalogue knows."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise KernelsFileError(f"{path}: not valid TOML ({exc}); see docs/kernels.md") from None
    unknown = set(doc) - {"kernel"}
    if unknown:
        raise _fail(path, "top level", f"unknown table {sorted(unknown)[0]!r}; a kernels file holds [[kernel]] "
                                       "entries")
    entries = doc.get("kernel")
    if not isinstance(entries, list) or not entries:
        raise _fail(path, "top level", "no [[kernel]] entry")
    out, names = [], set()
    for i, e in enumerate(entries):
        out.append(_kernel(e, f"kernel {i + 1}", path, fused_ops, epilogue_steps, chips))
        if out[-1].name in names:
            raise _fail(path, f"kernel {out[-1].name!r}", "declared twice")
        names.add(out[-1].name)
    return tuple(out)


def _str_list(e: dict, key: str, where: str, path: str) -> tuple[str, ...] | None:
    if key not in e:
        return None
    v = e[key]
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise _fail(path, where, f"{key} must be a list of strings")
    return tuple(v)


def _positive_int(e: dict, key: str, where: str, path: str) -> int | None:
    v = e.get(key)
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
        raise _fail(path, where, f"{key} must be a positive integer, not {v!r}")
    return v


def _kernel(e: Any, where: str, path: str, fused_ops: Mapping[str, tuple[str, ...]], steps: Sequence[str],
            chips: Sequence[str]) -> UserKernel:
    if not isinstance(e, dict):
        raise _fail(path, where, "a [[kernel]] entry must be a table")
    name = e.get("name")
    if not isinstance(name, str) or not name:
        raise _fail(path, where, "needs a name")
    where = f"kernel {name!r}"
    unknown = set(e) - _KERNEL_KEYS
    if unknown:
        raise _fail(path, where, f"unknown field {sorted(unknown)[0]!r} (known: {', '.join(sorted(_KERNEL_KEYS))})")
    implements = e.get("implements")
    if implements not in fused_ops:
        raise _fail(path, where, f"implements {implements!r}, which is no npufuse fused op (known: "
                                 f"{', '.join(sorted(fused_ops))})")
    attrs = fused_ops[implements]
    epilogue = _str_list(e, "epilogue", where, path)
    if epilogue is not None:
        if "epilogue" not in attrs:
            raise _fail(path, where, f"{implements} has no epilogue")
        bad = [s for s in epilogue if s not in steps]
        if bad or not epilogue:
            raise _fail(path, where, f"epilogue step {bad[0] if bad else '(none)'!r} is not one of {', '.join(steps)}")
    activation = e.get("activation")
    if activation is not None and ("activation" not in attrs or not isinstance(activation, str)):
        raise _fail(path, where, f"{implements} has no activation attribute to match")
    chip_list = _str_list(e, "chips", where, path)
    if not chip_list:
        raise _fail(path, where, "needs chips = [...] (e.g. \"ascend910b\")")
    bad_chip = [c for c in chip_list if c not in chips]
    if bad_chip:
        raise _fail(path, where, f"unknown chip {bad_chip[0]!r} (known: {', '.join(chips)})")
    dtypes = _str_list(e, "dtypes", where, path) or ()
    bad_dt = [d for d in dtypes if d not in _DTYPES]
    if bad_dt:
        raise _fail(path, where, f"unknown dtype {bad_dt[0]!r} (known: {', '.join(sorted(_DTYPES))})")
    max_last, multiple = _positive_int(e, "max_last_dim", where, path), _positive_int(e, "last_dim_multiple", where,
                                                                                     path)
    if max_last is not None and multiple is not None and multiple > max_last:
        raise _fail(path, where, f"last_dim_multiple {multiple} > max_last_dim {max_last}: no shape satisfies both")
    return UserKernel(name, implements, chip_list, path, epilogue, activation, dtypes, max_last, multiple,
                      _measured(e.get("measured"), where, path), _atc(e.get("atc"), where, path, attrs))


def _measured(v: Any, where: str, path: str) -> tuple[tuple[tuple[int, ...], float], ...]:
    if v is None:
        return ()
    if not isinstance(v, list):
        raise _fail(path, where, "measured must be [[kernel.measured]] tables")
    out = []
    for m in v:
        if not isinstance(m, dict) or set(m) != {"shape", "time_us"}:
            raise _fail(path, where, "each [[kernel.measured]] holds shape = [...] and time_us = ... only")
        shape, t = m["shape"], m["time_us"]
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0
                                                  for d in shape):
            raise _fail(path, where, f"measured shape {shape!r} must be positive integers")
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
            raise _fail(path, where, f"measured time_us {t!r} must be a positive number")
        out.append((tuple(shape), float(t)))
    return tuple(out)


def _atc(v: Any, where: str, path: str, attrs: tuple[str, ...]) -> AtcNode | None:
    if v is None:
        return None
    if not isinstance(v, dict):
        raise _fail(path, where, "atc must be a table")
    unknown = set(v) - _ATC_KEYS
    if unknown:
        raise _fail(path, where, f"unknown atc field {sorted(unknown)[0]!r} (known: {', '.join(sorted(_ATC_KEYS))})")
    op_type, domain, version = v.get("op_type"), v.get("domain", "npu"), v.get("version", 1)
    if not isinstance(op_type, str) or not op_type:
        raise _fail(path, where, "atc needs op_type, the ONNX op type the kernel's ATC plugin registers")
    if not isinstance(domain, str) or domain in ("", "ai.onnx", "npufuse"):
        raise _fail(path, where, f"atc domain {domain!r}: a plugin registers its own domain (e.g. \"npu\")")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise _fail(path, where, f"atc version {version!r} must be a positive integer")
    mapping = v.get("attributes", {})
    if not isinstance(mapping, dict) or not all(isinstance(k, str) and isinstance(x, str) for k, x in mapping.items()):
        raise _fail(path, where, "atc attributes maps node attribute names to npufuse attribute names (strings)")
    bad = [x for x in mapping.values() if x not in attrs]
    if bad:
        raise _fail(path, where, f"atc attribute source {bad[0]!r} is no attribute of the fused op ({', '.join(attrs)})")
    return AtcNode(op_type, domain, version, tuple(sorted(mapping.items())))


def load_kernels(path: str | Path, fused_ops: Mapping[str, tuple[str, ...]], epilogue_steps: Sequence[str],
                 chips: Sequence[str]) -> tuple[UserKernel, ...]:
    p = Path(path)
    if not p.is_file():
        raise KernelsFileError(f"{p}: no such kernels file; see docs/kernels.md for its format")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise KernelsFileError(f"{p}: cannot read it ({exc})") from None
    return parse_kernels(text, str(p), fused_ops, epilogue_steps, chips)


def find_kernel(kernels: Sequence[UserKernel], op_type: str, attrs: Mapping[str, Any], chip: str | None,
                dtype: str | None, shape: Sequence[Any] | None) -> UserKernel | None:
    """The first declared kernel that runs this fused node on `chip`, or None."""
    return next((k for k in kernels if k.problem(op_type, attrs, chip, dtype, shape) is None), None)


DtypeOf = Callable[[str], "str | None"]
