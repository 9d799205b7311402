"""NumPy reference kernels shared by the fused ops: the semantics an NPU kernel author implements.

They compute in float64 and return the input's dtype, so they are a reference, not a peer, of the
float32 kernels onnxruntime runs.
"""

from __future__ import annotations

import math
import string
from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def conv_pads(in_spatial: Sequence[int], kernel: Sequence[int], strides: Sequence[int],
              dilations: Sequence[int], pads: Sequence[int] | None, auto_pad: str) -> list[int]:
    """ONNX Conv padding as [begin..., end...], resolving auto_pad the way the spec does."""
    nd = len(kernel)
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        begin, end = [], []
        for i in range(nd):
            out = math.ceil(in_spatial[i] / strides[i])
            total = max(0, (out - 1) * strides[i] + (kernel[i] - 1) * dilations[i] + 1 - in_spatial[i])
            small, big = total // 2, total - total // 2
            begin.append(small if auto_pad == "SAME_UPPER" else big)
            end.append(big if auto_pad == "SAME_UPPER" else small)
        return begin + end
    if auto_pad == "VALID" or not pads:
        return [0] * (2 * nd)
    return list(pads)


def conv(x: np.ndarray, w: np.ndarray, b: np.ndarray | None = None, *, strides: Sequence[int] | None = None,
         pads: Sequence[int] | None = None, dilations: Sequence[int] | None = None, group: int = 1,
         auto_pad: str = "NOTSET", kernel_shape: Sequence[int] | None = None) -> np.ndarray:
    """ONNX Conv (1-D/2-D/3-D, grouped, dilated, strided, padded), as an einsum over sliding windows."""
    nd = w.ndim - 2
    kernel = list(kernel_shape or w.shape[2:])
    strides = list(strides or [1] * nd)
    dilations = list(dilations or [1] * nd)
    p = conv_pads(x.shape[2:], kernel, strides, dilations, pads, auto_pad)
    xp = np.pad(x.astype(np.float64), [(0, 0), (0, 0)] + [(p[i], p[i + nd]) for i in range(nd)])
    span = [(kernel[i] - 1) * dilations[i] + 1 for i in range(nd)]
    win = sliding_window_view(xp, span, axis=tuple(range(2, 2 + nd)))
    win = win[(slice(None), slice(None)) + tuple(slice(None, None, s) for s in strides)
              + tuple(slice(None, None, d) for d in dilations)]
    n, c = x.shape[:2]
    m = w.shape[0]
    cg, mg = c // group, m // group
    win = win.reshape((n, group, cg) + win.shape[2:])
    wg = w.astype(np.float64).reshape((group, mg, cg) + tuple(kernel))
    out_l, ker_l = string.ascii_lowercase[14:14 + nd], string.ascii_uppercase[:nd]
    y = np.einsum(f"ngc{out_l}{ker_l},gmc{ker_l}->ngm{out_l}", win, wg, optimize=True)
    y = y.reshape((n, m) + y.shape[3:])
    if b is not None:
        y = y + b.astype(np.float64).reshape((1, m) + (1,) * nd)
    return y.astype(x.dtype)


def erf(x: np.ndarray) -> np.ndarray:
    """The error function element by element in float64 (math.erf: exact to double precision; a reference
    kernel favours clarity over speed)."""
    return np.frompyfunc(math.erf, 1, 1)(x).astype(np.float64) if x.size else x.astype(np.float64)


def gelu(x: np.ndarray, approximate: str = "none") -> np.ndarray:
    """GELU in float64: exact (erf) or the tanh approximation."""
    x = x.astype(np.float64)
    if approximate == "tanh":
        return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))
    return 0.5 * x * (1.0 + erf(x / math.sqrt(2.0)))


def layer_norm(x: np.ndarray, epsilon: float, axis: int = -1) -> np.ndarray:
    """(x - mean) / sqrt(var + eps) over axes [axis, rank), in float64, without the affine."""
    xf = x.astype(np.float64)
    axes = tuple(range(axis % x.ndim, x.ndim))
    d = xf - xf.mean(axis=axes, keepdims=True)
    return d / np.sqrt((d * d).mean(axis=axes, keepdims=True) + float(epsilon))


def rms_norm(x: np.ndarray, epsilon: float, axis: int = -1) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) over axes [axis, rank), in float64, without the scale."""
    xf = x.astype(np.float64)
    axes = tuple(range(axis % x.ndim, x.ndim))
    return xf / np.sqrt((xf * xf).mean(axis=axes, keepdims=True) + float(epsilon))


def optional(inputs: Sequence[np.ndarray | None], i: int) -> np.ndarray | None:
    """Input `i` of a node whose trailing optional inputs may be omitted."""
    return inputs[i] if len(inputs) > i else None


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def hard_sigmoid(x: np.ndarray, alpha: float = 0.2, beta: float = 0.5) -> np.ndarray:
    return np.clip(alpha * x + beta, 0.0, 1.0)


# activation name -> f(x, params) in float64; params are the activation's ONNX attributes.
ACTIVATIONS = {
    "Relu": lambda x, p: np.maximum(x, 0.0),
    "Clip": lambda x, p: np.clip(x, p.get("min", -np.inf), p.get("max", np.inf)),
    "LeakyRelu": lambda x, p: np.where(x >= 0, x, p.get("alpha", 0.01) * x),
    "Sigmoid": lambda x, p: sigmoid(x),
    "HardSigmoid": lambda x, p: hard_sigmoid(x, p.get("alpha", 0.2), p.get("beta", 0.5)),
    "HardSwish": lambda x, p: x * hard_sigmoid(x, 1.0 / 6.0, 0.5),
    "Silu": lambda x, p: x * sigmoid(x),
}


def activation(name: str, x: np.ndarray, params: dict[str, float]) -> np.ndarray:
    """Apply a named activation (see ACTIVATIONS) in float64 and return x's dtype."""
    return ACTIVATIONS[name](x.astype(np.float64), params).astype(x.dtype)
