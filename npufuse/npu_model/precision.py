"""ATC's precision modes: the dtype each kind of kernel runs a model's float tensors in.

An fp32 ONNX is not run in fp32 on Ascend: ATC compiles it under a precision mode (`--precision_mode`, or
`--precision_mode_v2` in newer CANN), and for inference its default is force_fp16 / fp16: every operator that has
an fp16 implementation runs in fp16 (GE's own documentation of the option, hicann/ge
docs/zh/api/graph_engine_api/cpp/ge/options_params/precision_tuning.md: "在线推理场景下，参数默认值为
force_fp16" / "fp16"). Pricing the graph in the dtypes it was exported in would price twice the bytes ATC moves.

A mode is a policy per kind of kernel (matrix kernels on the Cube; vector kernels), mapping a tensor's float dtype
to the dtype that kernel runs it in. What each ATC value means, from the same document:
- force_fp16 (v2: fp16): an op that has fp16 and fp32 runs in fp16.
- allow_fp32_to_fp16: matrix ops in fp16; vector ops keep fp32 (they have it).
- must_keep_origin_dtype (v2: origin): the graph's own dtypes (an fp32 Conv on a chip without an fp32 Cube path
  is the chip's business: `cube.fp32_as_fp16` in its profile).
- force_fp32 / cube_fp16in_fp32out (v2: cube_fp16in_fp32out): matrix ops read fp16 and write fp32; vector ops
  run fp16 inputs in fp32.
- allow_mix_precision / allow_mix_precision_fp16 (v2: mixed_float16): fp32 ops on the built-in list drop to fp16,
  ops off the list follow their producer. Every inference op of CANN's kernel libraries is on it
  (`.PrecisionReduceFlag(true)` in hicann/ops-nn and ops-math op_host/*_def.cpp: softmax_v2, layer_norm_v4,
  gelu, sigmoid, swish, add, mul, div, exp, batch_norm_v3; the false ones are losses and optimizer updates), so for
  inference graphs it prices as force_fp16.
- allow_fp32_to_bf16, allow_mix_precision_bf16 (v2: mixed_bfloat16): the same with bfloat16, on chips that have it.
- cube_hif8 / mixed_hif8 (v2, Ascend 950's HiFloat8): not modeled.

Casts keep their dtypes (the type is their attribute, not a choice ATC makes); integer and bool tensors are never
touched.
"""

from __future__ import annotations

from dataclasses import dataclass

F32, F16, BF16 = "float32", "float16", "bfloat16"

# Chips of the kernel catalogue without bfloat16 (Ascend 310P, 910A): a bf16 mode there is refused.
NO_BF16_CHIPS = frozenset({"ascend310p", "ascend910"})
DEFAULT_MODE = "force_fp16"


@dataclass(frozen=True)
class PrecisionPolicy:
    """What one ATC precision mode does to a kernel's float tensors: (from dtype, to dtype) pairs."""

    mode: str                                  # the canonical --precision_mode value
    matrix_in: tuple[tuple[str, str], ...]     # inputs of Cube (matrix) kernels
    matrix_out: tuple[tuple[str, str], ...]    # their outputs
    vector: tuple[tuple[str, str], ...]        # every tensor of vector kernels
    needs_bf16: bool = False

    def convert(self, dtype: str, pairs: tuple[tuple[str, str], ...]) -> str:
        for src, dst in pairs:
            if dtype == src:
                return dst
        return dtype

    @property
    def changes_nothing(self) -> bool:
        return not (self.matrix_in or self.matrix_out or self.vector)


_TO_F16 = ((F32, F16),)
_TO_BF16 = ((F32, BF16),)
_POLICIES = {
    "force_fp16": PrecisionPolicy("force_fp16", _TO_F16, _TO_F16, _TO_F16),
    "allow_fp32_to_fp16": PrecisionPolicy("allow_fp32_to_fp16", _TO_F16, _TO_F16, ()),
    "must_keep_origin_dtype": PrecisionPolicy("must_keep_origin_dtype", (), (), ()),
    "force_fp32": PrecisionPolicy("force_fp32", ((F32, F16), (BF16, F16)), ((F16, F32), (BF16, F32)),
                                  ((F16, F32), (BF16, F32))),
    "allow_mix_precision": PrecisionPolicy("allow_mix_precision", _TO_F16, _TO_F16, _TO_F16),
    "allow_fp32_to_bf16": PrecisionPolicy("allow_fp32_to_bf16", _TO_BF16, _TO_BF16, (), needs_bf16=True),
    "allow_mix_precision_bf16": PrecisionPolicy("allow_mix_precision_bf16", _TO_BF16, _TO_BF16, _TO_BF16,
                                                needs_bf16=True),
}
# Other spellings ATC takes for the same policy: the v2 option's values and the newer aliases.
_ALIASES = {
    "fp16": "force_fp16",
    "origin": "must_keep_origin_dtype",
    "cube_fp16in_fp32out": "force_fp32",
    "allow_mix_precision_fp16": "allow_mix_precision",
    "mixed_float16": "allow_mix_precision",
    "mixed_bfloat16": "allow_mix_precision_bf16",
}
_NOT_MODELED = ("cube_hif8", "mixed_hif8")
MODE_NAMES = tuple(sorted(set(_POLICIES) | set(_ALIASES) | set(_NOT_MODELED)))


class PrecisionModeError(ValueError):
    """A precision mode npufuse cannot price: one line saying which and what to use."""


def policy(mode: str, chip: str | None = None) -> PrecisionPolicy:
    """The policy of an ATC precision mode value (either option's spelling), checked against `chip`."""
    name = str(mode).strip().lower()
    if name in _NOT_MODELED:
        raise PrecisionModeError(f"precision mode {mode!r} (HiFloat8) is not modeled; use fp16, "
                                 "allow_fp32_to_fp16 or origin")
    canonical = _ALIASES.get(name, name)
    found = _POLICIES.get(canonical)
    if found is None:
        raise PrecisionModeError(f"unknown precision mode {mode!r}: use one of ATC's --precision_mode or "
                                 f"--precision_mode_v2 values ({', '.join(m for m in MODE_NAMES if m not in _NOT_MODELED)})")
    if found.needs_bf16 and chip in NO_BF16_CHIPS:
        raise PrecisionModeError(f"precision mode {mode!r} runs bfloat16, which {chip} does not have; use "
                                 "force_fp16 (ATC's default) or allow_fp32_to_fp16")
    return found


def canonical(mode: str) -> str:
    """ATC's --precision_mode spelling of `mode` (either option's value)."""
    name = str(mode).strip().lower()
    return _ALIASES.get(name, name)
