"""The contract of each CANN ONNX plugin op the ATC form emits, and `check_node`, which tells what is wrong
with an emitted plugin node against it.

Every fact below is read from public source (repo @ commit, path):

- OT = mirror-cann/ops-transformer @ 3a280bcc34d8716c477c5506f3e507c1d0ea3214
- NN = hicann/ops-nn @ e5c3fa9327ea95ba26d06227e746923580d10921
- MA = hicann/ops-math @ c41933244c31e44fd496e3bb3212164f8c48c214
- OP = Ascend/op-plugin @ 0576042bea38dfd138391732182c616d2db7526f

Each `PluginOp.sources` names the files. How a plugin reads an attribute matters: it matches on name AND
ONNX type (`attr.type() == AttributeProto::INT` ...), so an attribute of another type is silently ignored
and the plugin default is used. The PartitionedCall plugins (PromptFlashAttention, IncreFlashAttention)
wire every node input into a subgraph Data node: an input must be connected, absence is a 0-element tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import AttributeProto, TensorProto

OT = "mirror-cann/ops-transformer@3a280bcc34d8716c477c5506f3e507c1d0ea3214"
NN = "hicann/ops-nn@e5c3fa9327ea95ba26d06227e746923580d10921"
MA = "hicann/ops-math@c41933244c31e44fd496e3bb3212164f8c48c214"
OP = "Ascend/op-plugin@0576042bea38dfd138391732182c616d2db7526f"

INT_MAX = 2147483647
CHIPS = ("ascend910b", "ascend910_93", "ascend310p", "ascend950")
_NPU = (("npu", 1),)


def _ai_onnx(*versions: int) -> tuple[tuple[str, int], ...]:
    return _NPU + tuple(("ai.onnx", v) for v in versions)


@dataclass(frozen=True)
class AttrSpec:
    """One attribute the plugin reads: its name(s), the ONNX type it must have, the plugin's default.
    `required`: the plugin fails without it. `must_set`: why leaving it to the plugin default is wrong."""

    name: str
    onnx_type: int
    default: Any = None
    required: bool = False
    must_set: str = ""
    aliases: tuple[str, ...] = ()


@dataclass(frozen=True)
class PluginOp:
    """The contract of one ONNX plugin op."""

    op_type: str
    cann_op: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attrs: tuple[AttrSpec, ...]
    keys: tuple[tuple[str, int], ...]
    chips: tuple[str, ...]
    dtypes: Mapping[str, tuple[str, ...]]  # chip -> allowed dtypes of input 0
    sources: tuple[str, ...]
    arities: tuple[int, ...] = ()  # allowed input counts; empty: see arity_from
    arity_from: tuple[int, int] | None = None  # (first, step): first, first+step, ...
    partitioned_call: bool = False
    notes: tuple[str, ...] = field(default_factory=tuple)

    def attr(self, name: str) -> AttrSpec | None:
        for a in self.attrs:
            if name == a.name or name in a.aliases:
                return a
        return None

    def arity_ok(self, n: int) -> bool:
        if self.arities:
            return n in self.arities
        if self.arity_from:
            first, step = self.arity_from
            return n >= first and (n - first) % step == 0
        return True

    def arity_text(self) -> str:
        if self.arities:
            return "/".join(map(str, self.arities))
        first, step = self.arity_from or (0, 1)
        return f"{first}, {first + step}, {first + 2 * step}, ..."


_I, _F, _S = AttributeProto.INT, AttributeProto.FLOAT, AttributeProto.STRING
_FP = ("float16", "bfloat16", "float32")

PLUGINS: dict[str, PluginOp] = {p.op_type: p for p in (
    PluginOp(
        "NPUPromptFlashAttention", "PromptFlashAttention",
        ("query", "key", "value", "pse_shift", "atten_mask", "actual_seq_lengths", "actual_seq_lengths_kv",
         "deq_scale1", "quant_scale1", "deq_scale2", "quant_scale2", "quant_offset2"),
        ("attention_out",),
        (AttrSpec("num_heads", _I, 0, required=True),
         AttrSpec("input_layout", _S, "", required=True),
         AttrSpec("scale_value", _F, 1.0, must_set="the plugin default 1.0 is no 1/sqrt(head_dim)"),
         AttrSpec("pre_tokens", _I, 0, must_set="the plugin default 0 (the kernel's is 214748647) keeps only the "
                  "diagonal and what next_tokens allows once an atten_mask is given; set 2147483647"),
         AttrSpec("next_tokens", _I, 0),
         AttrSpec("num_key_value_heads", _I, 0),
         AttrSpec("sparse_mode", _I, 0),
         AttrSpec("inner_precise", _I, 1)),
        _ai_onnx(11, 12, 13, 14, 15, 16, 19),
        ("ascend910b", "ascend910_93", "ascend310p"),
        {"ascend910b": ("float16", "bfloat16", "int8"), "ascend910_93": ("float16", "bfloat16", "int8"),
         "ascend310p": ("float16",)},
        (f"{OT} attention/prompt_flash_attention/framework/npu_prompt_flash_attention_onnx_plugin.cpp",
         f"{OT} attention/prompt_flash_attention/op_host/prompt_flash_attention_def.cpp",
         f"{OT} attention/prompt_flash_attention/op_host/prompt_flash_attention_tiling.cpp",
         f"{OT} attention/prompt_flash_attention/docs/aclnnPromptFlashAttentionV3.md"),
        arities=(3, 5, 7, 9, 12), partitioned_call=True,
        notes=(("inputs grow in groups: >3 wires pse_shift+atten_mask, >5 the two seq-length inputs, >7 "
                "deq_scale1+quant_scale1, >9 the last three; any other count leaves a subgraph Data unconnected"),
               ("sparse_mode 0 without atten_mask (absent or 0-element) ignores pre_tokens/next_tokens (tiling "
                "sets both to INT_MAX): next_tokens=0 alone is NOT causal"),
               ("310P: float16 only, atten_mask bool only, no pse/quant inputs, num_key_value_heads 0, "
                "sparse_mode 0, pre_tokens 2147483647, next_tokens 0 or 2147483647; a mask needs Sq == Skv, "
                "both %16 == 0"))),
    PluginOp(
        "NPUIncreFlashAttention", "IncreFlashAttention",
        ("query", "key_0..key_n-1", "value_0..value_n-1", "pse_shift", "atten_mask", "actual_seq_lengths"),
        ("attention_out",),
        (AttrSpec("num_heads", _I, 0, required=True),
         AttrSpec("input_layout", _S, "", required=True),
         AttrSpec("scale_value", _F, 1.0, must_set="the plugin default 1.0 is no 1/sqrt(head_dim)")),
        _ai_onnx(11, 12, 13, 14, 15, 16, 19),
        ("ascend910b", "ascend910_93", "ascend310p"),
        {"ascend910b": ("float16", "bfloat16"), "ascend910_93": ("float16", "bfloat16"),
         "ascend310p": ("float16",)},
        (f"{OT} attention/incre_flash_attention/framework/npu_incre_flash_attention_onnx_plugin.cpp",
         f"{OT} attention/incre_flash_attention/op_graph/incre_flash_attention_proto.h",
         f"{OT} attention/incre_flash_attention/op_host/incre_flash_attention_tiling.cpp",
         f"{OT} attention/incre_flash_attention/docs/aclnnIncreFlashAttentionV4.md"),
        arity_from=(6, 2), partitioned_call=True,
        notes=(("inputs: query, n keys, n values, then pse_shift, atten_mask, actual_seq_lengths (all three "
                "connected; 0-element = absent)"),
               ("the plugin never sets num_key_value_heads: the graph op default (proto.h) is 1, so key/value "
                "must have exactly one head (MQA); MHA/GQA key/value shapes fail in tiling"),
               "query S must be 1; the n key/value tensors are either one (B, ...) tensor or B tensors of batch 1")),
    PluginOp(
        "NPURmsNorm", "RmsNorm", ("x", "gamma"), ("y", "rstd"), (),
        _ai_onnx(11, 12, 13, 14, 15, 16, 17, 18),
        ("ascend910b", "ascend910_93", "ascend310p", "ascend950"),
        {"ascend910b": _FP, "ascend910_93": _FP, "ascend950": _FP, "ascend310p": ("float16", "float32")},
        (f"{NN} norm/rms_norm/framework/npu_rms_norm_onnx_plugin.cpp",
         f"{NN} norm/rms_norm/op_host/rms_norm_def.cpp", f"{NN} norm/rms_norm/docs/aclnnRmsNorm.md"),
        arities=(2,),
        notes=("the plugin reads no attribute and sets epsilon=1e-6",
               "rstd is float32, shape x with the normalised (gamma's) axes set to 1",
               "310P: the last axis of x and gamma >= 32 bytes")),
    PluginOp(
        "NPUAddRmsNorm", "AddRmsNorm", ("x1", "x2", "gamma"), ("y", "rstd", "x"), (),
        _ai_onnx(11, 12, 13, 14, 15, 16, 17, 18),
        ("ascend910b", "ascend910_93", "ascend310p", "ascend950"),
        {"ascend910b": _FP, "ascend910_93": _FP, "ascend950": _FP, "ascend310p": ("float16", "float32")},
        (f"{NN} norm/add_rms_norm/framework/npu_add_rms_norm_onnx_plugin.cpp",
         f"{NN} norm/add_rms_norm/op_host/add_rms_norm_def.cpp", f"{NN} norm/add_rms_norm/docs/aclnnAddRmsNorm.md"),
        arities=(3,),
        notes=("the plugin reads no attribute and sets epsilon=1e-6", "outputs y, rstd (float32), x = x1 + x2")),
    PluginOp(
        "NPUGroupNormSilu", "GroupNormSilu", ("x", "gamma", "beta"), ("y", "mean", "rstd"),
        (AttrSpec("group", _I, 0, required=True, aliases=("num_groups",)),
         AttrSpec("eps", _F, 1e-5)),
        _ai_onnx(11, 12, 13, 14, 15, 16, 17, 18),
        ("ascend910b", "ascend910_93", "ascend310p", "ascend950"),
        {"ascend910b": _FP, "ascend910_93": _FP, "ascend950": _FP, "ascend310p": ("float16", "float32")},
        (f"{NN} norm/group_norm_silu/framework/npu_group_norm_silu_onnx_plugin.cpp",
         f"{NN} norm/group_norm_silu/op_host/group_norm_silu_def.cpp",
         f"{NN} norm/group_norm_silu/docs/aclnnGroupNormSilu.md"),
        arities=(3,),
        notes=("without group/num_groups the plugin passes num_groups=0 (no parse error; the kernel needs it)",
               "activate_silu is not read (kernel default true)", "C % group == 0; mean, rstd shape (N, group)")),
    PluginOp(
        "NPUMoeGatingTopKSoftmax", "MoeGatingTopKSoftmax", ("x", "finished"), ("y", "expert_idx", "row_idx"),
        (AttrSpec("k", _I, -1, required=True),),
        _ai_onnx(11, 12, 13, 14, 15, 16, 17, 18),
        ("ascend910b", "ascend910_93", "ascend310p", "ascend950"),
        {"ascend910b": _FP, "ascend910_93": _FP, "ascend950": _FP, "ascend310p": ("float16",)},
        (f"{OT} moe/moe_gating_top_k_softmax/framework/npu_moe_gating_top_k_softmax_onnx_plugin.cpp",
         f"{OT} moe/moe_gating_top_k_softmax/op_host/moe_gating_top_k_softmax_def.cpp",
         f"{OT} moe/moe_gating_top_k_softmax/docs/aclnnMoeGatingTopKSoftmax.md"),
        arities=(1, 2),
        notes=("the plugin reads k (INT) only and fails without it (k stays -1); no renorm: softmax then top k",
               "expert_idx and row_idx are int32; row_idx[i, j] = j * rows + i (the position in a k-major order)",
               "x 2-D or 3-D, 0 <= k <= min(E, 1024); finished (bool, x's shape less the last axis) optional",
               "310P: float16 only, E a multiple of 16 up to 256, no finished, row_idx all 0; 950: E <= 2048")),
    PluginOp(
        "NPURotaryMul", "RotaryMul", ("x", "r1", "r2"), ("y",), (),
        _ai_onnx(11, 12, 13, 14, 15, 16, 17, 18),
        ("ascend910b", "ascend910_93", "ascend310p"),
        {"ascend910b": _FP, "ascend910_93": _FP, "ascend310p": ("float16", "float32")},
        (f"{MA} common/src/framework/npu_rotary_mul_onnx_plugin.cpp", f"{OP} docs/context/torch_npu-npu_rotary_mul.md"),
        arities=(3,),
        notes=("no attribute: half rotation y = x*r1 + cat(-x2, x1)*r2",
               "x, r1, r2 4-D, D even; 310P (TBE, jit_compile) D == 128")),
    PluginOp(
        "NPURotaryPositionEmbedding", "RotaryPositionEmbedding", ("x", "cos", "sin"), ("y",),
        (AttrSpec("mode", _I, None, required=True),),
        _ai_onnx(11, 12, 13, 14, 15, 16, 17, 18),
        ("ascend910b", "ascend910_93", "ascend310p", "ascend950"),
        {"ascend910b": _FP, "ascend910_93": _FP, "ascend950": _FP, "ascend310p": ("float16", "float32")},
        (f"{OT} posembedding/rotary_position_embedding/framework/npu_rotary_position_embedding_onnx_plugin.cpp",
         f"{OT} posembedding/rotary_position_embedding/op_host/rotary_position_embedding_def.cpp",
         f"{OT} posembedding/rotary_position_embedding/docs/aclnnRotaryPositionEmbedding.md"),
        arities=(3,),
        notes=("mode 0 half, 1 interleave (910B/A3); 2 quarter, 3 interleave-half documented too",
               "910B interleave: cos/sin only 11SD/1S1D/S11D; 310P: half only, D <= 128 and D % 32 == 0")),
    PluginOp(
        "NPUFastGelu", "FastGelu", ("x",), ("y",), (),
        _ai_onnx(11, 12, 13, 14, 15, 16, 17, 18),
        ("ascend910b", "ascend910_93", "ascend950"),
        {"ascend910b": _FP, "ascend910_93": _FP, "ascend950": _FP},
        (f"{NN} activation/fast_gelu/framework/npu_fast_gelu_onnx_plugin.cpp",
         f"{NN} activation/fast_gelu/docs/aclnnFastGelu.md", f"{NN} activation/fast_gelu/tests/assets/golden.py"),
        arities=(1,),
        notes=("y = x / (1 + exp(-1.702 x)): not erf GELU", "aclnnFastGelu.md: Atlas inference (310P) not supported")),
)}


def registered(op_type: str, domain: str, version: int) -> bool:
    """Whether ATC's parser finds a plugin for this node: key `<domain or ai.onnx>::<version>::<op_type>`."""
    p = PLUGINS.get(op_type)
    return p is not None and ((domain or "ai.onnx"), version) in p.keys


# ---------------------------------------------------------------- checking

@dataclass(frozen=True)
class _Ctx:
    """What the graph tells about a node's inputs (all optional)."""

    dtypes: Mapping[str, str]
    shapes: Mapping[str, tuple[int | None, ...]]
    empty: frozenset[str]  # names known to be 0-element tensors


def _dtype_name(elem_type: int) -> str:
    # bfloat16 has no NumPy dtype of its own; name it as the kernel docs do
    if elem_type == TensorProto.BFLOAT16:
        return "bfloat16"
    return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type)).name


def _graph_ctx(graph: onnx.GraphProto | None) -> _Ctx:
    if graph is None:
        return _Ctx({}, {}, frozenset())
    dtypes: dict[str, str] = {}
    shapes: dict[str, tuple[int | None, ...]] = {}
    empty: set[str] = set()
    for vi in list(graph.input) + list(graph.value_info) + list(graph.output):
        t = vi.type.tensor_type
        if t.elem_type:
            dtypes[vi.name] = _dtype_name(t.elem_type)
        if t.HasField("shape"):
            shapes[vi.name] = tuple(d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim)
    tensors = [(i.name, i) for i in graph.initializer]
    tensors += [(n.output[0], a.t) for n in graph.node if n.op_type == "Constant" for a in n.attribute
                if a.name == "value"]
    for name, t in tensors:
        dtypes[name] = _dtype_name(t.data_type)
        shapes[name] = tuple(t.dims)
        if int(np.prod(t.dims)) == 0 and len(t.dims) > 0:
            empty.add(name)
    return _Ctx(dtypes, shapes, frozenset(empty))


def plugin_attrs(node: onnx.NodeProto) -> dict[str, Any]:
    """The attribute values the ATC plugin passes to the kernel for `node`: its defaults, overridden by the
    node's attributes it reads with the ONNX type it reads (others ignored, as the plugin ignores them)."""
    return _values(node, PLUGINS[node.op_type])


def _values(node: onnx.NodeProto, spec: PluginOp) -> dict[str, Any]:
    out = {a.name: a.default for a in spec.attrs}
    for a in node.attribute:
        s = spec.attr(a.name)
        if s is not None and a.type == s.onnx_type:
            out[s.name] = onnx.helper.get_attribute_value(a)
            if isinstance(out[s.name], bytes):
                out[s.name] = out[s.name].decode()
    return out


def check_node(node: onnx.NodeProto, chip: str, graph: onnx.GraphProto | None = None,
               precision_mode: str | None = None) -> list[str]:
    """What is wrong with the plugin node `node` for `chip` (one of CHIPS); [] when nothing is.

    Checks the domain, the input count and empty-string inputs, the output count, every attribute (missing,
    wrong ONNX type, not read by the plugin, plugin default that changes the meaning) and the chip's
    documented limits. With `graph` (the node's graph, shapes inferred or not) it also checks dtypes and
    shapes, and knows which inputs are 0-element tensors (= absent). `precision_mode` (ATC's --precision_mode the
    model will be compiled under; None: the graph's dtypes as they are): a float32 input is what the mode makes
    of it for that kernel (force_fp16 and allow_fp32_to_fp16 run a Cube kernel that has no float32 in float16:
    "如果网络模型中算子不支持float32，则直接降低精度到float16", GE's precision_mode documentation)."""
    spec = PLUGINS.get(node.op_type)
    if spec is None:
        return [f"{node.op_type} is not an ONNX plugin op this table knows"]
    out: list[str] = []
    where = f"{node.op_type} '{node.name}'"
    if node.domain not in ("npu", "", "ai.onnx"):
        out.append(f"{where}: domain '{node.domain}' has no plugin key (use 'npu', '' or 'ai.onnx')")
    n_in = len(node.input)
    if not spec.arity_ok(n_in):
        out.append(f"{where}: {n_in} inputs; the plugin takes exactly {spec.arity_text()}")
    for i, name in enumerate(node.input):
        if name == "":
            what = "a 0-element tensor must stand for an absent input" if spec.partitioned_call else \
                "every input is required"
            out.append(f"{where}: input {i} is the empty string; {what}")
    if not 1 <= len(node.output) <= len(spec.outputs):
        out.append(f"{where}: {len(node.output)} outputs; the kernel has {len(spec.outputs)} ({', '.join(spec.outputs)})")
    seen: set[str] = set()
    for a in node.attribute:
        s = spec.attr(a.name)
        if s is None:
            why = " (the plugin fixes epsilon at 1e-6)" if a.name in ("epsilon", "eps") else ""
            out.append(f"{where}: attribute '{a.name}' is not read by the plugin{why}")
            continue
        if a.type != s.onnx_type:
            out.append(f"{where}: attribute '{a.name}' is {AttributeProto.AttributeType.Name(a.type)}; the plugin "
                       f"reads only {AttributeProto.AttributeType.Name(s.onnx_type)} and silently ignores it")
            continue
        seen.add(s.name)
    for s in spec.attrs:
        if s.name in seen:
            continue
        if s.required:
            out.append(f"{where}: required attribute '{s.name}' ({AttributeProto.AttributeType.Name(s.onnx_type)}) "
                       "is missing")
        elif s.must_set:
            out.append(f"{where}: attribute '{s.name}' not set: {s.must_set}")
    if chip not in CHIPS:
        out.append(f"unknown chip '{chip}' (one of {', '.join(CHIPS)})")
        return out
    if chip not in spec.chips:
        out.append(f"{where}: {spec.cann_op} has no kernel for {chip}")
        return out
    ctx = _graph_ctx(graph)
    x_dtype = ctx.dtypes.get(node.input[0]) if node.input else None
    if x_dtype and precision_mode and x_dtype not in spec.dtypes.get(chip, ()):
        x_dtype = compiled_dtype(spec, x_dtype, precision_mode)
    if x_dtype and x_dtype not in spec.dtypes.get(chip, ()):
        out.append(f"{where}: {spec.cann_op} on {chip} takes {'/'.join(spec.dtypes[chip])}, not {x_dtype}")
    extra = _EXTRA.get(spec.op_type)
    if extra:
        out += [f"{where}: {m}" for m in extra(node, _values(node, spec), chip, ctx)]
    return out


# the plugin kernels that run on the Cube: ATC's "matrix" operators, which allow_fp32_to_fp16 lowers too
CUBE_KERNELS = frozenset({"PromptFlashAttention", "IncreFlashAttention"})


def compiled_dtype(spec: PluginOp, dtype: str, precision_mode: str) -> str:
    """The dtype ATC compiles `spec`'s kernel in for an input of `dtype` under `precision_mode`."""
    from npufuse.npu_model.precision import policy

    p = policy(precision_mode)
    return p.convert(dtype, p.matrix_in if spec.cann_op in CUBE_KERNELS else p.vector)


def check_model(model: onnx.ModelProto, chip: str) -> list[str]:
    """`check_node` over every plugin node of `model`'s main graph, plus the parser's key lookup
    (`<domain>::<opset_import version>::<op_type>`)."""
    opsets = {o.domain: o.version for o in model.opset_import}
    out: list[str] = []
    for node in model.graph.node:
        if node.op_type not in PLUGINS:
            continue
        dom = node.domain or ("ai.onnx" if "ai.onnx" in opsets else "")
        ver = opsets.get(dom, opsets.get("" if dom == "ai.onnx" else dom))
        if ver is None or not registered(node.op_type, dom, ver):
            out.append(f"{node.op_type} '{node.name}': no plugin key {dom or 'ai.onnx'}::{ver}::{node.op_type}")
        out += check_node(node, chip, model.graph)
    return out


# ------------------------------------------------------ op-specific rules

def _present(node: onnx.NodeProto, i: int, ctx: _Ctx) -> bool | None:
    """True/False when known whether input i carries data; None when the graph does not tell."""
    if i >= len(node.input) or node.input[i] == "":
        return False
    if node.input[i] in ctx.empty:
        return False
    return True if node.input[i] in ctx.shapes else None


def _pfa(node: onnx.NodeProto, v: dict[str, Any], chip: str, ctx: _Ctx) -> list[str]:
    out = []
    layouts = ("BSH", "BSND", "BNSD", "BNSD_BSND") + (("TND",) if chip == "ascend910b" else ())
    if v["input_layout"] and v["input_layout"] not in layouts:
        out.append(f"input_layout '{v['input_layout']}' not in {'/'.join(layouts)} on {chip}")
    n, nkv = int(v["num_heads"]), int(v["num_key_value_heads"])
    if nkv and n and n % nkv:
        out.append(f"num_heads {n} is not a multiple of num_key_value_heads {nkv}")
    if v["sparse_mode"] not in range(5):
        out.append(f"sparse_mode {v['sparse_mode']} unsupported (0-4; 5-8 documented as not supported)")
    if v["inner_precise"] not in range(4):
        out.append(f"inner_precise {v['inner_precise']} not in 0-3")
    mask = _present(node, 4, ctx)
    if mask is False and v["sparse_mode"] == 0 and any(
            a.name == "next_tokens" and a.type == _I and a.i < INT_MAX for a in node.attribute):
        out.append("next_tokens is set but there is no atten_mask: with sparse_mode 0 the kernel then ignores "
                   "pre_tokens/next_tokens (no causal band); pass a mask")
    if v["sparse_mode"] in (1, 2, 3, 4) and mask is False:
        out.append(f"sparse_mode {v['sparse_mode']} needs an atten_mask")
    if chip == "ascend310p":
        if nkv not in (0,):
            out.append(f"num_key_value_heads {nkv}: 310P supports only 0 (no GQA)")
        if v["sparse_mode"] != 0:
            out.append("310P supports sparse_mode 0 only")
        if v["next_tokens"] not in (0, INT_MAX):
            out.append(f"next_tokens {v['next_tokens']}: 310P takes only 0 or 2147483647")
        if v["pre_tokens"] != INT_MAX:
            out.append(f"pre_tokens {v['pre_tokens']}: 310P takes only 2147483647")
        if _present(node, 3, ctx):
            out.append("pse_shift given: 310P takes none")
        if any(_present(node, i, ctx) for i in range(7, 12)):
            out.append("quantisation inputs given: 310P takes none")
        mdt = ctx.dtypes.get(node.input[4]) if mask else None
        if mdt and mdt != "bool":
            out.append(f"atten_mask is {mdt}: 310P takes bool only")
    return out


def _heads(shape: tuple[int | None, ...], layout: str, per_head: int | None) -> int | None:
    if layout in ("BNSD", "BNSD_BSND") and len(shape) == 4:
        return shape[1]
    if layout == "BSND" and len(shape) == 4:
        return shape[2]
    if layout == "BSH" and len(shape) == 3 and shape[2] and per_head:
        return shape[2] // per_head
    return None


def _ifa(node: onnx.NodeProto, v: dict[str, Any], chip: str, ctx: _Ctx) -> list[str]:
    out = []
    layout, n = v["input_layout"], int(v["num_heads"])
    if layout and layout not in ("BSH", "BSND", "BNSD"):
        out.append(f"input_layout '{layout}' not in BSH/BSND/BNSD")
    q = ctx.shapes.get(node.input[0]) if node.input else None
    if q and len(q) >= 3:
        s = q[2] if layout == "BNSD" else q[1]
        if s not in (1, None):
            out.append(f"query S is {s}; IncreFlashAttention takes S == 1")
    d = q[-1] // n if q and layout == "BSH" and q[-1] and n else (q[-1] if q else None)
    if len(node.input) >= 6:
        k = ctx.shapes.get(node.input[1])
        kv_heads = _heads(k, layout, d) if k else None
        if kv_heads not in (None, 1):
            out.append(f"key has {kv_heads} heads, but the plugin leaves num_key_value_heads at the op default 1 "
                       "(MQA only)")
    return out


def _norm_310p(node: onnx.NodeProto, v: dict[str, Any], chip: str, ctx: _Ctx) -> list[str]:
    if chip != "ascend310p" or not node.input:
        return []
    shape, dt = ctx.shapes.get(node.input[0]), ctx.dtypes.get(node.input[0])
    if shape and shape[-1] and dt in ("float16", "float32") and shape[-1] * np.dtype(dt).itemsize < 32:
        return [f"310P needs the last axis >= 32 bytes (got {shape[-1]} x {dt})"]
    return []


def _gns(node: onnx.NodeProto, v: dict[str, Any], chip: str, ctx: _Ctx) -> list[str]:
    out = []
    g = int(v["group"])
    if g <= 0 and any(a.name in ("group", "num_groups") and a.type == _I for a in node.attribute):
        out.append(f"group {g} must be > 0")
    if float(v["eps"]) <= 0:
        out.append("eps must be > 0")
    shape = ctx.shapes.get(node.input[0]) if node.input else None
    if shape and len(shape) >= 2 and shape[1] and g > 0 and shape[1] % g:
        out.append(f"C={shape[1]} is not divisible by group {g}")
    return out


def _moe_gating(node: onnx.NodeProto, v: dict[str, Any], chip: str, ctx: _Ctx) -> list[str]:
    out = []
    k = int(v["k"])
    shape = ctx.shapes.get(node.input[0]) if node.input else None
    experts = shape[-1] if shape else None
    if shape and len(shape) not in (2, 3):
        out.append(f"x is {len(shape)}-D; MoeGatingTopKSoftmax takes 2-D or 3-D")
    if k < 0 or k > 1024 or (experts and k > experts):
        out.append(f"k {k} outside 0..min(E={experts}, 1024)")
    if chip == "ascend310p":
        if experts and (experts % 16 or experts > 256):
            out.append(f"E={experts}: 310P takes a multiple of 16 up to 256")
        if _present(node, 1, ctx):
            out.append("finished given: 310P takes none")
    if chip == "ascend950" and experts and experts > 2048:
        out.append(f"E={experts}: 950 takes at most 2048")
    return out


def _rotary_mul(node: onnx.NodeProto, v: dict[str, Any], chip: str, ctx: _Ctx) -> list[str]:
    shape = ctx.shapes.get(node.input[0]) if node.input else None
    if not shape:
        return []
    out = []
    if len(shape) != 4:
        out.append(f"x is {len(shape)}-D; RotaryMul takes 4-D")
    if shape[-1] and shape[-1] % 2:
        out.append(f"D={shape[-1]} is odd")
    if chip == "ascend310p" and shape[-1] not in (None, 128):
        out.append(f"D={shape[-1]}: 310P (TBE RotaryMul) takes D == 128")
    return out


def _rope(node: onnx.NodeProto, v: dict[str, Any], chip: str, ctx: _Ctx) -> list[str]:
    out = []
    modes = {"ascend310p": (0,), "ascend950": (0, 1, 2, 3)}.get(chip, (0, 1))
    if v["mode"] is not None and v["mode"] not in modes:
        out.append(f"mode {v['mode']} unsupported on {chip} (takes {modes})")
    shape = ctx.shapes.get(node.input[0]) if node.input else None
    d = shape[-1] if shape else None
    if shape and len(shape) not in (3, 4):
        out.append(f"x is {len(shape)}-D; 3-D or 4-D expected")
    if d and d % 2:
        out.append(f"D={d} is odd")
    if d and chip == "ascend310p" and (d > 128 or d % 32):
        out.append(f"D={d}: 310P takes D <= 128 and a multiple of 32")
    if d and chip in ("ascend910b", "ascend910_93") and d >= 896:
        out.append(f"D={d}: 910B/A3 take D < 896")
    return out


_EXTRA: dict[str, Callable[[onnx.NodeProto, dict[str, Any], str, _Ctx], list[str]]] = {
    "NPUPromptFlashAttention": _pfa,
    "NPUIncreFlashAttention": _ifa,
    "NPURmsNorm": _norm_310p,
    "NPUAddRmsNorm": _norm_310p,
    "NPUGroupNormSilu": _gns,
    "NPUMoeGatingTopKSoftmax": _moe_gating,
    "NPURotaryMul": _rotary_mul,
    "NPURotaryPositionEmbedding": _rope,
}
