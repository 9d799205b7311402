"""What a model must be for npufuse to rewrite it, checked before anything runs.

- Its default-domain opset is at least MIN_OPSET: below it the arithmetic ops broadcast only with a `broadcast`
  attribute, the fused ops' function bodies cannot be written, and onnxruntime (which verifies) has no kernels.
- It defines no function in the `npufuse` domain under the name of an npufuse fused op, other than a body npufuse
  wrote (an optimized model optimized again: npufuse knows its bodies by their stamp, see patterns.base.make_body).
  Model-local functions are looked up by (domain, name, overload): a fused node npufuse adds would run the model's
  own body instead of npufuse's, and with --no-verify nothing would notice. Such a model is refused rather than renamed around: the `npufuse` domain is the contract consumers
  (converters, kernel mappings) read, so moving npufuse's ops elsewhere for one model would break them.
"""

from __future__ import annotations

import onnx

from npufuse import FUSED_DOMAIN
from npufuse.errors import InputError
from npufuse.patterns.base import MIN_OPSET, is_npufuse_body


def admit(model: onnx.ModelProto, op_names: frozenset[str]) -> None:
    """Refuse (InputError, one line) a model npufuse cannot rewrite correctly; `op_names`: the fused ops' names."""
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    if opset is not None and opset < MIN_OPSET:
        raise InputError(f"the model imports the default ONNX domain at opset {opset}; npufuse needs opset "
                         f">= {MIN_OPSET} (older ops broadcast differently and onnxruntime cannot run them): convert it "
                         f"first, e.g. onnx.version_converter.convert_version(model, {MIN_OPSET})")
    for f in model.functions:
        if f.domain == FUSED_DOMAIN and f.name in op_names and not is_npufuse_body(f):
            overload = f" (overload {f.overload!r})" if f.overload else ""
            raise InputError(f"the model defines function {FUSED_DOMAIN}.{f.name}{overload}, the name of an npufuse "
                             f"fused op, with a body npufuse did not write (or one changed since, or written before "
                             f"npufuse stamped its bodies): fused {f.name} nodes would run it instead of npufuse's; "
                             f"move that function and its callers to another domain, or optimize the original model")
