"""Calibration rows: one published timing each, checked field by field (a bad row is one line naming it).

Schema (npu_model/calibration/README.md): workload, recipe, profile, batch, metric (throughput_fps | latency_ms |
time_us), value, source; optional seq_len, image_size, dtype, mode (om_graph | kernel | eager_torch_npu | ...),
recipe_exact (default true), use_for_fit (default true), family, notes.
"""

from __future__ import annotations

import hashlib
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from npufuse.errors import InputError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

METRICS = ("throughput_fps", "latency_ms", "time_us")


@dataclass(frozen=True)
class Row:
    """One published timing."""

    where: str                 # file:index, for messages
    workload: str
    recipe: str
    profile: str
    batch: int
    metric: str
    value: float
    source: str
    seq_len: int | None = None
    image_size: int | None = None
    dtype: str = "fp16"
    mode: str = "om_graph"
    exact: bool = True
    use_for_fit: bool = True
    family: str = ""
    # the published compile's ATC --op_select_implmode / --optypelist_for_implmode (None / (): ATC's default)
    implmode: str | None = None
    impl_optypes: tuple[str, ...] = ()
    # the published compile set ATC's --enable_small_channel=1 (field atc_enable_small_channel)
    small_channel: bool = False

    @property
    def time_us(self) -> float:
        """Published time of one batch, µs: a throughput row's 1e6 x batch / value."""
        if self.metric == "throughput_fps":
            return 1e6 * self.batch / self.value
        if self.metric == "latency_ms":
            return self.value * 1e3
        return self.value

    @property
    def key(self) -> tuple:
        """What the modeled time depends on (rows with the same key share one build)."""
        return (self.workload, self.recipe, self.batch, self.seq_len, self.image_size, self.dtype, self.mode,
                self.implmode, self.impl_optypes, self.small_channel)


@dataclass(frozen=True)
class DataFile:
    path: str
    sha256: str
    rows: tuple[Row, ...]


def load(paths: list[str] | tuple[str, ...]) -> list[DataFile]:
    """Every row of every file, checked. InputError (one line) on the first bad file or row."""
    if not paths:
        raise InputError("no calibration data given; pass one or more TOML files of [[measurement]] rows "
                         "(see npufuse/npu_model/calibration/)")
    return [_load_file(Path(p)) for p in paths]


def _load_file(path: Path) -> DataFile:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise InputError(f"{path}: cannot read the calibration data ({exc.strerror}); check the path") from None
    try:
        doc = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise InputError(f"{path}: not valid TOML ({msg}); fix the syntax") from None
    items = doc.get("measurement")
    if not isinstance(items, list) or not items:
        raise InputError(f"{path}: no [[measurement]] rows; each published timing is one [[measurement]] table "
                         "(see npufuse/npu_model/calibration/README.md)")
    rows = tuple(_row(f"{path}: [[measurement]] #{i + 1}", item) for i, item in enumerate(items))
    return DataFile(str(path), hashlib.sha256(raw).hexdigest(), rows)


def _row(where: str, item: Any) -> Row:
    if not isinstance(item, dict):
        raise InputError(f"{where}: not a table")

    def need(key: str, kind: type) -> Any:
        if key not in item:
            raise InputError(f"{where}: field '{key}' is missing; add it (see npufuse/npu_model/calibration/README.md)")
        return _typed(where, key, item[key], kind)

    def opt(key: str, kind: type, default: Any) -> Any:
        return default if key not in item else _typed(where, key, item[key], kind)

    metric = need("metric", str)
    if metric not in METRICS:
        raise InputError(f"{where}: field 'metric' is {metric!r}; it must be one of {', '.join(METRICS)}")
    value = need("value", float)
    if not math.isfinite(value) or value <= 0:
        raise InputError(f"{where}: field 'value' is {value!r}; it must be a positive number")
    batch = need("batch", int)
    seq = opt("seq_len", int, None)
    image = opt("image_size", int, None)
    for key, v in (("batch", batch), ("seq_len", seq), ("image_size", image)):
        if v is not None and v < 1:
            raise InputError(f"{where}: field '{key}' is {v}; it must be a whole number >= 1")
    implmode = opt("atc_op_select_implmode", str, None)
    optypes = opt("atc_optypelist_for_implmode", str, "")
    from npufuse.npu_model.impl_mode import ImplModeError, check_implmode

    try:
        implmode, ops = check_implmode(implmode, optypes)
    except ImplModeError as exc:
        raise InputError(f"{where}: fields 'atc_op_select_implmode' / 'atc_optypelist_for_implmode': {exc}") from None
    return Row(where=where, workload=need("workload", str), recipe=need("recipe", str), profile=need("profile", str),
               batch=batch, metric=metric, value=value, source=need("source", str), seq_len=seq, image_size=image,
               dtype=opt("dtype", str, "fp16"), mode=opt("mode", str, "om_graph"), exact=opt("recipe_exact", bool, True),
               use_for_fit=opt("use_for_fit", bool, True), family=opt("family", str, ""), implmode=implmode,
               impl_optypes=ops, small_channel=opt("atc_enable_small_channel", bool, False))


def _typed(where: str, key: str, value: Any, kind: type) -> Any:
    ok = {str: isinstance(value, str) and bool(value.strip()),
          bool: isinstance(value, bool),
          int: isinstance(value, int) and not isinstance(value, bool),
          float: isinstance(value, (int, float)) and not isinstance(value, bool)}[kind]
    if not ok:
        what = {str: "a non-empty string", bool: "true or false", int: "a whole number", float: "a number"}[kind]
        raise InputError(f"{where}: field '{key}' is {value!r}; it must be {what}")
    return float(value) if kind is float else value
