"""ATC's operator implementation modes: which kernels run their high-precision implementation.

Some CANN kernels have two implementations (ATC's `--op_select_implmode` documentation, hicann/ge
docs/zh/user_guides/atc_tools/CLI_options/--op_select_implmode.md): high precision ("in fp16, Taylor expansion or
Newton iteration for more accuracy") and high performance. `--op_select_implmode` takes high_performance (the
default), high_precision, high_performance_for_all or high_precision_for_all; the plain two act only on the ops the
built-in `impl_mode/high_*.ini` lists (or on `--optypelist_for_implmode`'s ops, where given), the `_for_all` ones on
every op that has both (hicann/ops-nn scripts/kernel/binary_config/all_ops_impl_mode.ini: Sigmoid, Gelu, Exp,
Tanh, SoftmaxV2, LayerNorm, ...).

What npufuse prices from this: Sigmoid (alone, and inside SiLU / Swish / quick-GELU epilogues). Its default is the
high-precision kernel: ModelZoo-PyTorch's EfficientNet recipes pass `--optypelist_for_implmode="Sigmoid"
--op_select_implmode=high_performance` to get the fast one (EfficientNetV2, EfficientNet-B7), so the default list
does not hold it. How much slower it is is not documented; the profile's `vector.sigmoid_high_precision_factor`
is fitted (docs/calibration.md): on Ascend310P3, EfficientNet-B0 compiled without the flag is priced within 10%
at every published batch with a factor of 5, and the models published with the flag fit at 1. The other ops with
two modes are priced as one implementation: there is no published pair to fit them on.
"""

from __future__ import annotations

from collections.abc import Iterable

DEFAULT_IMPLMODE = "high_performance"
IMPLMODES = ("high_performance", "high_precision", "high_performance_for_all", "high_precision_for_all")
# The ops whose implementation mode the cost model distinguishes (see the module docstring).
PRICED_OPS = ("Sigmoid",)


class ImplModeError(ValueError):
    """An --op-select-implmode value ATC does not take, or an op list that is not one."""


def check_implmode(mode: str | None, optypes: Iterable[str] | str = ()) -> tuple[str, tuple[str, ...]]:
    """(mode, op types) as ATC takes them: `mode` None is ATC's default; op types are CANN op type names
    (`Sigmoid`), a list or ATC's comma-separated string, each kept once, in the order given."""
    mode = DEFAULT_IMPLMODE if mode is None else mode
    if isinstance(optypes, str):
        optypes = optypes.split(",") if optypes else ()
    if mode not in IMPLMODES:
        raise ImplModeError(f"{mode!r} is not an ATC --op_select_implmode value; use one of {', '.join(IMPLMODES)}")
    ops: list[str] = []
    for op in optypes:
        op = op.strip()
        if not op or not op.replace("_", "").isalnum():
            raise ImplModeError(f"{op!r} is not an operator type; give CANN op type names, e.g. Sigmoid,Gelu")
        if op not in ops:
            ops.append(op)
    if ops and mode.endswith("_for_all"):
        raise ImplModeError(f"--optypelist-for-implmode names ops for high_performance or high_precision, not for "
                            f"{mode} (which sets every op); drop one of the two")
    return mode, tuple(ops)


def high_precision(op_type: str, mode: str, optypes: tuple[str, ...]) -> bool:
    """Whether ATC runs `op_type` (one of PRICED_OPS) in its high-precision implementation under `mode` and the op
    list `optypes` (`--optypelist_for_implmode`)."""
    if mode == "high_performance_for_all":
        return False
    if mode == "high_precision_for_all":
        return True
    if op_type in optypes:
        return mode == "high_precision"
    return True   # not on the built-in high-performance list: its default, the high-precision kernel
