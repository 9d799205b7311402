"""NumPy reference kernels: what each CANN kernel computes as its ONNX plugin configures it.

Each kernel is `kernel(inputs, attrs) -> list[np.ndarray]`: `inputs` in the ONNX node's order (None or a
0-element array = absent, as the PartitionedCall plugins take it), `attrs` the node's attribute values by
name (the plugin defaults apply to what is missing). Arithmetic is float64; outputs come back in the
kernel's output dtype. Sources (repo @ commit, path) are in `plugins.PLUGINS[op].sources`; the facts each
kernel relies on are cited in its docstring with the short names OT / NN / OP defined in `plugins`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

Kernel = Callable[[Sequence[np.ndarray | None], dict[str, Any]], list[np.ndarray]]

# A bool/int8/uint8 mask replaces masked scores by the lowest float32 (OT prompt_flash_attention/op_kernel/
# arch22/prompt_flash_attention_s1s2_bns1_x910_base.h: 0xFF7FFFFF); a float16 mask is added times -10000.
_MASK_FILL = float(np.finfo(np.float32).min)
_FP16_MASK_SCALE = -10000.0


def _absent(t: np.ndarray | None) -> bool:
    return t is None or t.size == 0


def _arg(inputs: Sequence[np.ndarray | None], i: int) -> np.ndarray | None:
    return inputs[i] if i < len(inputs) and not _absent(inputs[i]) else None


def _to_bnsd(t: np.ndarray, layout: str, heads: int) -> np.ndarray:
    """(B, N, S, D) view of a query/key/value tensor in `layout` (BSH, BSND, BNSD, BNSD_BSND)."""
    if layout in ("BNSD", "BNSD_BSND"):
        if t.ndim != 4 or t.shape[1] != heads:
            raise ValueError(f"{layout} tensor {t.shape} does not have {heads} heads on axis 1")
        return t
    if layout == "BSND":
        if t.ndim != 4 or t.shape[2] != heads:
            raise ValueError(f"BSND tensor {t.shape} does not have {heads} heads on axis 2")
        return t.transpose(0, 2, 1, 3)
    if layout == "BSH":
        if t.ndim != 3 or t.shape[2] % heads:
            raise ValueError(f"BSH tensor {t.shape}: H is not a multiple of {heads} heads")
        b, s, h = t.shape
        return t.reshape(b, s, heads, h // heads).transpose(0, 2, 1, 3)
    raise NotImplementedError(f"input_layout {layout!r}")


def _from_bnsd(t: np.ndarray, layout: str) -> np.ndarray:
    if layout == "BNSD":
        return t
    t = t.transpose(0, 2, 1, 3)  # BSND; BNSD_BSND writes BSND (aclnnPromptFlashAttentionV3.md, attentionOut)
    return t.reshape(t.shape[0], t.shape[1], -1) if layout == "BSH" else t


def _lengths(t: np.ndarray | None, batch: int, full: int) -> np.ndarray:
    """Per-batch valid lengths: one value for all batches, or the first `batch` values (PFA doc, actualSeqLengths)."""
    if t is None:
        return np.full(batch, full, np.int64)
    v = np.asarray(t, np.int64).reshape(-1)
    if v.size == 1:
        return np.full(batch, int(v[0]), np.int64)
    if v.size < batch:
        raise ValueError(f"{v.size} sequence lengths for batch {batch}")
    return np.minimum(v[:batch], full)


def _attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, bias: np.ndarray | None,
            masked: np.ndarray, outside: np.ndarray, zero_invalid_rows: bool) -> np.ndarray:
    """softmax(scale * q k^T + bias) v over (B, N, Sq, Skv), N a multiple of k's heads (GQA groups).

    `outside` keys (beyond the valid length, or outside the token band) never enter the row; `masked` keys
    get the lowest float32, so a row whose every remaining key is masked averages v over those keys, as the
    kernel's fill does. A row with no key at all, or (zero_invalid_rows) every key masked, gives 0."""
    group = q.shape[1] // k.shape[1]
    k = np.repeat(k.astype(np.float64), group, axis=1)
    v = np.repeat(v.astype(np.float64), group, axis=1)
    s = scale * np.einsum("bnqd,bnkd->bnqk", q.astype(np.float64), k)
    if bias is not None:
        s = s + bias  # after the scale: OT ..._s1s2_bns1_x910.h Muls(scaleValue) then Add(pseShift)
    s = np.where(masked, _MASK_FILL, s)
    s = np.where(outside, -np.inf, s)
    row_max = np.max(s, axis=-1, keepdims=True)
    no_key = ~np.isfinite(row_max)
    e = np.exp(s - np.where(no_key, 0.0, row_max))
    e = np.where(outside, 0.0, e)
    total = e.sum(axis=-1, keepdims=True)
    out = np.einsum("bnqk,bnkd->bnqd", e / np.where(total == 0, 1.0, total), v)
    dead = no_key[..., 0]
    if zero_invalid_rows:
        dead = dead | np.all(masked | outside, axis=-1)
    return np.where(dead[..., None], 0.0, out)


def _mask4(mask: np.ndarray, batch: int, sq: int, skv: int) -> np.ndarray:
    """(B|1, 1, Sq, Skv) view of an atten_mask of an accepted shape: (S1, S2), (B|1, S1, S2),
    (B|1, 1, S1, S2) with S1 >= Sq, S2 >= Skv (OT prompt_flash_attention_tiling.cpp CheckAttenMaskShape)."""
    if mask.ndim == 2:
        m = mask[None, None]
    elif mask.ndim == 3:
        m = mask[:, None]
    elif mask.ndim == 4 and mask.shape[1] == 1:
        m = mask
    else:
        raise ValueError(f"atten_mask shape {mask.shape} not accepted")
    if m.shape[0] not in (1, batch) or m.shape[2] < sq or m.shape[3] < skv:
        raise ValueError(f"atten_mask shape {mask.shape} does not cover batch {batch}, {sq} x {skv}")
    return m[:, :, :sq, :skv]


def _mask_terms(mask: np.ndarray, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray | None]:
    """(masked, additive): bool/int masks mask where non-zero; a float16 mask is added times -10000."""
    if np.issubdtype(mask.dtype, np.floating):
        return np.zeros(shape, bool), _FP16_MASK_SCALE * mask.astype(np.float64)
    return np.broadcast_to(mask != 0, shape), None


def _pse(pse: np.ndarray | None, sq: int, skv: int) -> np.ndarray | None:
    """pse_shift (B|1, N, Sq', Skv') with Sq' >= Sq, Skv' >= Skv, cut to (.., Sq, Skv) (PFA/IFA docs)."""
    if pse is None:
        return None
    if pse.ndim != 4 or pse.shape[2] < sq or pse.shape[3] < skv:
        raise ValueError(f"pse_shift shape {pse.shape} does not cover {sq} x {skv}")
    return pse[:, :, :sq, :skv].astype(np.float64)


def prompt_flash_attention(inputs: Sequence[np.ndarray | None], attrs: dict[str, Any]) -> list[np.ndarray]:
    """PromptFlashAttention as NPUPromptFlashAttention configures it (inputs q, k, v [, pse_shift, atten_mask]
    [, actual_seq_lengths, actual_seq_lengths_kv]; the quantisation inputs must be absent).

    - Plugin defaults (OT .../framework/npu_prompt_flash_attention_onnx_plugin.cpp): scale_value 1.0,
      pre_tokens 0, next_tokens 0, num_key_value_heads 0 (= num_heads), sparse_mode 0, inner_precise 1.
    - out = softmax(scale_value * Q K^T + pse_shift, masked) V; pse_shift is added after the scale
      (OT .../op_kernel/arch22/prompt_flash_attention_s1s2_bns1_x910.h). The design doc
      (docs/PFA算子设计介绍.md) says pse before the scale; the kernel code is followed here.
    - atten_mask: bool/int8/uint8, non-zero = masked out; shapes (S1,S2), (B|1,S1,S2), (B|1,1,S1,S2) with
      S1 >= Sq, S2 >= Skv, the top-left block used (tiling CheckAttenMaskShape; aclnnPromptFlashAttentionV3.md).
    - sparse_mode 0: with no atten_mask (absent or 0-element) pre_tokens/next_tokens are IGNORED (tiling sets
      both to INT_MAX), so next_tokens=0 alone is not causal. With a mask, key j of query i is computed only
      when -pre_tokens <= j - i <= next_tokens, and the mask applies within. sparse_mode 1: the mask alone;
      2: causal from the top-left (j <= i); 3: causal from the bottom-right (j - i <= Skv - Sq);
      4: band pre/next taken from the bottom-right. Modes 2-4 take the optimised 2048x2048 mask, whose
      content is not read here.
    - actual_seq_lengths(_kv): valid lengths per batch (1 value = all batches); keys beyond are left out,
      query rows beyond are not computed (0 here).
    - A row whose every key is masked: the lowest-float fill makes it the mean of V over those keys
      (inner_precise 0/1); inner_precise 2/3 (row-invalid correction) gives 0. A row with no key in the
      band is not computed (0 here).
    """
    q, k, v = inputs[0], inputs[1], inputs[2]
    if any(_arg(inputs, i) is not None for i in range(7, 12)):
        raise NotImplementedError("quantised PromptFlashAttention")
    n = int(attrs["num_heads"])
    layout = str(attrs.get("input_layout", "BSH"))
    nkv = int(attrs.get("num_key_value_heads", 0)) or n
    scale = float(attrs.get("scale_value", 1.0))
    pre, nxt = int(attrs.get("pre_tokens", 0)), int(attrs.get("next_tokens", 0))
    sparse, inner = int(attrs.get("sparse_mode", 0)), int(attrs.get("inner_precise", 1))
    if n % nkv:
        raise ValueError(f"num_heads {n} not a multiple of num_key_value_heads {nkv}")
    Q, K, V = _to_bnsd(q, layout, n), _to_bnsd(k, layout, nkv), _to_bnsd(v, layout, nkv)
    b, _, sq, _ = Q.shape
    skv = K.shape[2]
    q_len = _lengths(_arg(inputs, 5), b, sq)
    kv_len = _lengths(_arg(inputs, 6), b, skv)
    mask = _arg(inputs, 4)
    shape = (b, 1, sq, skv)
    masked, bias = np.zeros(shape, bool), _pse(_arg(inputs, 3), sq, skv)
    if mask is not None and sparse in (0, 1):
        masked, add = _mask_terms(_mask4(mask, b, sq, skv), shape)
        if add is not None:
            bias = add if bias is None else bias + add
    elif sparse in (1, 2, 3, 4) and mask is None:
        raise ValueError(f"sparse_mode {sparse} needs an atten_mask")
    i = np.arange(sq)[:, None]
    j = np.arange(skv)[None, :]
    outside = np.zeros(shape, bool)
    for bi in range(b):
        delta = int(kv_len[bi] - q_len[bi])  # bottom-right offset (tiling GetPreNextTokensLeftUp)
        lo, hi = {0: (pre, nxt) if mask is not None else (None, None), 1: (None, None), 2: (None, 0),
                  3: (None, delta), 4: (pre - delta, nxt + delta)}[sparse]
        band = (j >= kv_len[bi]) | (i >= q_len[bi])
        if hi is not None:
            band |= (j - i) > hi
        if lo is not None:
            band |= (i - j) > lo
        outside[bi, 0] = band
    out = _attend(Q, K, V, scale, bias, masked, outside, zero_invalid_rows=inner in (2, 3))
    return [_from_bnsd(out, layout).astype(q.dtype)]


def incre_flash_attention(inputs: Sequence[np.ndarray | None], attrs: dict[str, Any]) -> list[np.ndarray]:
    """IncreFlashAttention as NPUIncreFlashAttention configures it: inputs query, key_0..key_{n-1},
    value_0..value_{n-1}, pse_shift, atten_mask, actual_seq_lengths (OT .../framework/
    npu_incre_flash_attention_onnx_plugin.cpp).

    - The plugin passes num_heads, input_layout, scale_value (default 1.0) only; num_key_value_heads stays at
      the graph op's default 1 (OT .../op_graph/incre_flash_attention_proto.h), so `attrs` without it means
      one KV head; 0 means num_heads (OT .../op_host/incre_flash_attention_tiling.cpp).
    - query S must be 1. One key/value tensor holds every batch; n > 1 tensors are one per batch (batch 1
      each, S may differ) (aclnnIncreFlashAttentionV4.md).
    - actual_seq_lengths: valid key length per batch (1 value = all batches).
    - atten_mask (B,S), (B,1,S), (B,1,1,S), non-zero = masked; pse_shift (B|1, N, 1, S) added after the scale.
    """
    count = len(inputs)
    if count < 6 or (count - 4) % 2:
        raise ValueError(f"{count} inputs: IncreFlashAttention takes 2n + 4")
    nt = (count - 4) // 2
    keys, values = inputs[1:1 + nt], inputs[1 + nt:1 + 2 * nt]
    pse, mask, lens = (_arg(inputs, 1 + 2 * nt + i) for i in range(3))
    n = int(attrs["num_heads"])
    layout = str(attrs.get("input_layout", "BSH"))
    nkv = int(attrs.get("num_key_value_heads", 1)) or n
    scale = float(attrs.get("scale_value", 1.0))
    Q = _to_bnsd(inputs[0], layout, n)
    b, _, sq, _ = Q.shape
    if sq != 1:
        raise ValueError(f"query S is {sq}; IncreFlashAttention takes S == 1")
    ks = [_to_bnsd(t, layout, nkv) for t in keys]
    vs = [_to_bnsd(t, layout, nkv) for t in values]
    if nt == 1:
        K, V = ks[0], vs[0]
        full = np.full(b, K.shape[2], np.int64)
    else:
        if nt != b or any(t.shape[0] != 1 for t in ks):
            raise ValueError(f"{nt} key tensors for batch {b}: one per batch, each of batch 1")
        smax = max(t.shape[2] for t in ks)

        def padded(t: np.ndarray) -> np.ndarray:  # per-batch S may differ: pad, lengths keep them apart
            return np.pad(t, [(0, 0), (0, 0), (0, smax - t.shape[2]), (0, 0)])

        K = np.concatenate([padded(t) for t in ks])
        V = np.concatenate([padded(t) for t in vs])
        full = np.array([t.shape[2] for t in ks], np.int64)
    skv = K.shape[2]
    kv_len = np.minimum(_lengths(lens, b, skv), full)
    shape = (b, 1, 1, skv)
    masked, bias = np.zeros(shape, bool), _pse(pse, 1, skv)
    if mask is not None:
        m = mask.reshape(mask.shape[0], -1)[:, :skv].reshape(mask.shape[0], 1, 1, skv)
        masked, add = _mask_terms(m, shape)
        if add is not None:
            bias = add if bias is None else bias + add
    outside = np.arange(skv)[None, None, None, :] >= kv_len[:, None, None, None]
    out = _attend(Q, K, V, scale, bias, masked, np.broadcast_to(outside, shape), zero_invalid_rows=False)
    return [_from_bnsd(out, layout).astype(inputs[0].dtype)]


_RMS_EPS = 1e-6  # set by the plugins whatever the node says (NN norm/rms_norm/framework/..., add_rms_norm/...)


def _rms(x: np.ndarray, gamma: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    axes = tuple(range(x.ndim - gamma.ndim, x.ndim))
    rstd = 1.0 / np.sqrt(np.mean(x * x, axis=axes, keepdims=True) + _RMS_EPS)
    return x * rstd * gamma, rstd


def rms_norm(inputs: Sequence[np.ndarray | None], attrs: dict[str, Any]) -> list[np.ndarray]:
    """RmsNorm: y = x / sqrt(mean(x^2) + 1e-6) * gamma over gamma's (trailing) axes; rstd float32 of x's rank
    with those axes 1 (NN norm/rms_norm/docs/aclnnRmsNorm.md). Node attributes are ignored, as the plugin
    ignores them: epsilon is 1e-6."""
    x, gamma = inputs[0], inputs[1]
    y, rstd = _rms(x.astype(np.float64), gamma.astype(np.float64))
    return [y.astype(x.dtype), rstd.astype(np.float32)]


def add_rms_norm(inputs: Sequence[np.ndarray | None], attrs: dict[str, Any]) -> list[np.ndarray]:
    """AddRmsNorm: x = x1 + x2, then RmsNorm(x, gamma) with epsilon 1e-6; outputs y, rstd (float32), x
    (NN norm/add_rms_norm/docs/aclnnAddRmsNorm.md)."""
    x1, x2, gamma = inputs[0], inputs[1], inputs[2]
    x = x1.astype(np.float64) + x2.astype(np.float64)
    y, rstd = _rms(x, gamma.astype(np.float64))
    return [y.astype(x1.dtype), rstd.astype(np.float32), x.astype(x1.dtype)]


def group_norm_silu(inputs: Sequence[np.ndarray | None], attrs: dict[str, Any]) -> list[np.ndarray]:
    """GroupNormSilu: x (N, C, *) in `group` groups of channels; y = silu((x - mean) * rstd * gamma + beta),
    mean and rstd = 1/sqrt(var + eps) of shape (N, group) (NN norm/group_norm_silu/docs/aclnnGroupNormSilu.md).
    The plugin reads `group` or `num_groups` (INT) and `eps` (FLOAT, default 1e-5); SiLU is always applied."""
    x, gamma, beta = inputs[0], inputs[1], inputs[2]
    g = int(attrs.get("group", attrs.get("num_groups", 0)))
    eps = float(attrs.get("eps", 1e-5))
    n, c = x.shape[:2]
    if g <= 0 or c % g:
        raise ValueError(f"group {g} does not divide C={c}")
    xg = x.astype(np.float64).reshape(n, g, -1)
    mean = xg.mean(axis=-1)
    rstd = 1.0 / np.sqrt(xg.var(axis=-1) + eps)
    norm = ((xg - mean[..., None]) * rstd[..., None]).reshape(x.shape)
    aff = (1, c) + (1,) * (x.ndim - 2)
    z = norm * gamma.astype(np.float64).reshape(aff) + beta.astype(np.float64).reshape(aff)
    y = z / (1.0 + np.exp(-z))
    return [y.astype(x.dtype), mean.astype(x.dtype), rstd.astype(x.dtype)]


def moe_gating_top_k_softmax(inputs: Sequence[np.ndarray | None], attrs: dict[str, Any]) -> list[np.ndarray]:
    """MoeGatingTopKSoftmax as NPUMoeGatingTopKSoftmax configures it (the plugin passes `k` only; OT moe/
    moe_gating_top_k_softmax/framework/npu_moe_gating_top_k_softmax_onnx_plugin.cpp): softmax over the last axis
    (computed in float32 by the kernel: op_kernel/*_fullload.h casts x up), then the k largest probabilities,
    sorted; outputs y (x's dtype), expert_idx (int32), row_idx (int32) = arange(rows * k).reshape(k, rows).T over
    the rows of x (docs/aclnnMoeGatingTopKSoftmax.md). Ties: to the lower index here (as ONNX TopK); the kernel's
    documentation does not say. `finished` (rows whose experts become E) is not implemented."""
    x = inputs[0]
    if _arg(inputs, 1) is not None:
        raise NotImplementedError("MoeGatingTopKSoftmax with a finished input")
    k = int(attrs["k"])
    if not 0 <= k <= min(x.shape[-1], 1024):
        raise ValueError(f"k {k} outside 0..min(E={x.shape[-1]}, 1024)")
    x64 = x.astype(np.float64)
    e = np.exp(x64 - x64.max(axis=-1, keepdims=True))
    p = e / e.sum(axis=-1, keepdims=True)
    idx = np.argsort(-p.astype(np.float32).astype(np.float64), axis=-1, kind="stable")[..., :k]
    y = np.take_along_axis(p, idx, axis=-1)
    rows = int(np.prod(x.shape[:-1]))
    row_idx = np.arange(rows * k).reshape(k, rows).T.reshape(*x.shape[:-1], k)
    return [y.astype(x.dtype), idx.astype(np.int32), row_idx.astype(np.int32)]


def _rotate(x: np.ndarray, mode: int) -> tuple[np.ndarray, np.ndarray]:
    """(x', rotate(x')) of aclnnRotaryPositionEmbedding.md's four modes (x' is x but for mode 3)."""
    d = x.shape[-1]
    if mode == 0:
        return x, np.concatenate([-x[..., d // 2:], x[..., :d // 2]], axis=-1)
    if mode == 1:
        r = np.stack([-x[..., 1::2], x[..., ::2]], axis=-1)
        return x, r.reshape(x.shape)
    if mode == 2:
        q = d // 4
        parts = [x[..., i * q:(i + 1) * q] for i in range(4)]
        return x, np.concatenate([-parts[1], parts[0], -parts[3], parts[2]], axis=-1)
    if mode == 3:
        a, b = x[..., ::2], x[..., 1::2]
        return np.concatenate([a, b], axis=-1), np.concatenate([-b, a], axis=-1)
    raise ValueError(f"rotary mode {mode}")


def rotary_mul(inputs: Sequence[np.ndarray | None], attrs: dict[str, Any]) -> list[np.ndarray]:
    """RotaryMul (half rotation; the plugin sets no attribute): y = x*r1 + cat(-x2, x1)*r2, x1/x2 the halves
    of the last axis (MA common/src/framework/npu_rotary_mul_onnx_plugin.cpp; OP docs/context/
    torch_npu-npu_rotary_mul.md)."""
    x, r1, r2 = inputs[0], inputs[1], inputs[2]
    xf = x.astype(np.float64)
    _, rot = _rotate(xf, 0)
    return [(xf * r1.astype(np.float64) + rot * r2.astype(np.float64)).astype(x.dtype)]


def rotary_position_embedding(inputs: Sequence[np.ndarray | None], attrs: dict[str, Any]) -> list[np.ndarray]:
    """RotaryPositionEmbedding: y = x*cos + rotate(x)*sin; mode (required INT) 0 half, 1 interleave
    (pairs (x0, x1) -> (-x1, x0)), 2 quarter, 3 interleave-half (OT posembedding/rotary_position_embedding/
    docs/aclnnRotaryPositionEmbedding.md)."""
    x, cos, sin = inputs[0], inputs[1], inputs[2]
    if "mode" not in attrs:
        raise ValueError("NPURotaryPositionEmbedding needs attribute mode")
    base, rot = _rotate(x.astype(np.float64), int(attrs["mode"]))
    return [(base * cos.astype(np.float64) + rot * sin.astype(np.float64)).astype(x.dtype)]


def fast_gelu(inputs: Sequence[np.ndarray | None], attrs: dict[str, Any]) -> list[np.ndarray]:
    """FastGelu: y = x / (1 + exp(-1.702 x)) (NN activation/fast_gelu/docs/aclnnFastGelu.md and
    tests/assets/golden.py) -- a sigmoid approximation, not erf GELU."""
    x = inputs[0]
    xf = x.astype(np.float64)
    with np.errstate(over="ignore"):
        y = xf / (1.0 + np.exp(-1.702 * xf))
    return [y.astype(x.dtype)]


KERNELS: dict[str, Kernel] = {
    "NPUPromptFlashAttention": prompt_flash_attention,
    "NPUIncreFlashAttention": incre_flash_attention,
    "NPURmsNorm": rms_norm,
    "NPUAddRmsNorm": add_rms_norm,
    "NPUGroupNormSilu": group_norm_silu,
    "NPUMoeGatingTopKSoftmax": moe_gating_top_k_softmax,
    "NPURotaryMul": rotary_mul,
    "NPURotaryPositionEmbedding": rotary_position_embedding,
    "NPUFastGelu": fast_gelu,
}
