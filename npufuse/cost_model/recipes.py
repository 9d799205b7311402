"""What each op asks of the Vector unit, as instruction classes per element.

The cost of a class (repeats per 256 bytes) is hardware data and lives in the profile
(`vector.repeat_cost`); this module only says which instructions an op's kernel issues, e.g. Sigmoid is
exp + 2 adds + a reciprocal per element. Per-row scalar work (one rsqrt per row of a norm) is negligible
and left out.
"""

from __future__ import annotations

Recipe = tuple[tuple[str, float], ...]   # (instruction class, count per element)

_ADD1: Recipe = (("add", 1),)
_GELU_ERF: Recipe = (("erf", 1), ("add", 4))
_GELU_TANH: Recipe = (("tanh", 1), ("add", 6))
# a sigmoid is exp, two adds and a reciprocal: four ops of class `sigmoid` (NpuSpec.repeat_cost: their cost, and
# ATC's high-precision Sigmoid kernel where the implementation mode runs it, npu_model.impl_mode)
_SIGMOID: Recipe = (("sigmoid", 4),)
_QUICK_GELU: Recipe = _SIGMOID + (("add", 2),)     # x * sigmoid(1.702 x): the scale, the sigmoid, the product

# Elementwise ops: (recipe per output element, fp32 live temporaries per element beside the streams).
ELEMENTWISE: dict[str, tuple[Recipe, int]] = {
    **{op: (_ADD1, 0) for op in (
        "Add", "Sub", "Mul", "Max", "Min", "Neg", "Abs", "Relu", "Equal", "Less", "Greater", "LessOrEqual",
        "GreaterOrEqual", "Where", "And", "Or", "Not", "Xor", "Cast", "CastLike", "Sign", "Floor", "Ceil",
        "Round", "IsNaN", "IsInf", "BitShift", "Mod", "BitwiseAnd", "BitwiseOr", "BitwiseXor", "BitwiseNot")},
    "LeakyRelu": ((("add", 2),), 0),
    "PRelu": ((("add", 2),), 0),
    "Clip": ((("add", 2),), 0),
    "ThresholdedRelu": ((("add", 2),), 0),
    "HardSigmoid": ((("add", 3),), 0),
    "HardSwish": ((("add", 4),), 1),
    "Sigmoid": (_SIGMOID, 1),
    "Silu": (_SIGMOID + (("add", 1),), 1),
    "Swish": (_SIGMOID + (("add", 1),), 1),
    "Tanh": ((("tanh", 1),), 1),
    "Gelu": (_GELU_ERF, 1),
    "FastGelu": (_GELU_TANH, 1),
    "BiasGelu": (_GELU_ERF + (("add", 1),), 1),
    "QuickGelu": (_QUICK_GELU, 1),
    "Erf": ((("erf", 1),), 1),
    "Exp": ((("exp", 1),), 0),
    "Log": ((("ln", 1),), 0),
    "Sqrt": ((("sqrt", 1),), 0),
    "Reciprocal": ((("reciprocal", 1),), 0),
    "Div": ((("div", 1),), 0),
    "Pow": ((("ln", 1), ("exp", 1), ("add", 1)), 1),
    "Softplus": ((("exp", 1), ("ln", 1), ("add", 1)), 1),
    "Softsign": ((("add", 2), ("div", 1)), 1),
    "Elu": ((("exp", 1), ("add", 3)), 1),
    "Selu": ((("exp", 1), ("add", 4)), 1),
    "Celu": ((("exp", 1), ("add", 4)), 1),
    "Mish": ((("exp", 1), ("ln", 1), ("tanh", 1), ("add", 2)), 2),
    "Sin": ((("tanh", 1),), 1),
    "Cos": ((("tanh", 1),), 1),
    "BatchNormalization": ((("add", 2),), 0),  # y = x * s + t with s, t per channel
    "QuantizeLinear": ((("add", 3),), 0),
    "DequantizeLinear": ((("add", 2),), 0),
    "DynamicQuantizeLinear": ((("reduce", 2), ("add", 3)), 1),
}

# Epilogues of npufuse.FusedMatMul / FusedConv activations, per output element.
EPILOGUE: dict[str, Recipe] = {
    "bias": _ADD1,
    "relu": _ADD1,
    "gelu": _GELU_ERF,
    "gelu_tanh": _GELU_TANH,
    "silu": _SIGMOID + (("add", 1),),
    "tanh": (("tanh", 1),),
    "sigmoid": _SIGMOID,
    "quick_gelu": _QUICK_GELU,
    "Relu": _ADD1,
    "Clip": (("add", 2),),
    "LeakyRelu": (("add", 2),),
    "Sigmoid": _SIGMOID,
    "HardSigmoid": (("add", 3),),
    "HardSwish": (("add", 4),),
    "Silu": _SIGMOID + (("add", 1),),
    "residual_add": _ADD1,       # FusedConv's residual input added to the conv's output tile
    # FusedConv affine=1 (fp16/bf16 BN kept exact): two casts, a multiply and an add per element
    "bn_affine": (("add", 4),),
}


def gated_epilogue(activation: str) -> Recipe:
    """npufuse.GatedMLP's Vector work per element of its 2N-wide GEMM output (gate and up columns): the
    activation on the gate half and the product with the up half, i.e. half of (activation + one multiply)."""
    return tuple((cls, count / 2.0) for cls, count in EPILOGUE.get(activation, (("add", 2.0),)) + _ADD1)


# npufuse.RotaryEmbedding per output element: x*cos, rotate(x)*sin, the sum, and the Neg of half the columns.
ROTARY: Recipe = (("add", 3.5),)


_LN: Recipe = (("reduce", 2), ("add", 7))          # mean, centre, square, variance, scale, gamma, beta, casts
_RMS: Recipe = (("reduce", 1), ("add", 5))         # square, sum, scale, gamma, casts
_SOFTMAX: Recipe = (("reduce", 2), ("add", 3), ("exp", 1))
NORM_EPILOGUES = {"layernorm": _LN, "rmsnorm": _RMS}

# Row ops: a whole row of the reduced axis sits in UB. (recipe per element, axis attribute default)
ROW_OPS: dict[str, Recipe] = {
    "LayerNormalization": _LN, "LayerNorm": _LN, "GroupNormalization": _LN, "InstanceNormalization": _LN,
    "RMSNormalization": _RMS, "RMSNorm": _RMS, "SimplifiedLayerNormalization": _RMS,
    "SkipLayerNormalization": _LN + (("add", 1),), "AddLayerNorm": _LN + (("add", 1),),
    "SkipSimplifiedLayerNormalization": _RMS + (("add", 1),), "AddRMSNorm": _RMS + (("add", 1),),
    "Softmax": _SOFTMAX, "LogSoftmax": _SOFTMAX + (("ln", 1),),
    # npufuse.GroupNorm / GroupNormSilu: the row is a group (C/G channels, all positions); SiLU is its epilogue
    "GroupNorm": _LN, "GroupNormSilu": _LN + EPILOGUE["silu"],
    # npufuse.MoeGatingTopKSoftmax: the row is a token's E router logits; softmax, then TopK's selection passes
    "MoeGatingTopKSoftmax": _SOFTMAX + (("reduce", 4),),
}
ROW_TEMPS_FP32 = 2  # live fp32 rows of a norm / softmax: the row cast to fp32 and one work row

# Streaming reductions (no whole row needed: partial sums carry across tiles), per input element.
REDUCTIONS: dict[str, Recipe] = {
    "ReduceSum": (("reduce", 1),), "ReduceMean": (("reduce", 1),), "ReduceMax": (("reduce", 1),),
    "ReduceMin": (("reduce", 1),), "ReduceProd": (("reduce", 1),), "ReduceL1": (("reduce", 1), ("add", 1)),
    "ReduceL2": (("reduce", 1), ("add", 1)), "ReduceSumSquare": (("reduce", 1), ("add", 1)),
    "ReduceLogSum": (("reduce", 1),), "ReduceLogSumExp": (("reduce", 1), ("exp", 1)),
    "ArgMax": (("reduce", 2),), "ArgMin": (("reduce", 2),), "GlobalAveragePool": (("reduce", 1),),
    "GlobalMaxPool": (("reduce", 1),), "TopK": (("reduce", 4),), "CumSum": (("add", 1),),
}

# Pure data movement: (recipe per element moved, reads only as much of input 0 as the output holds).
MOVES: dict[str, tuple[Recipe, bool]] = {
    "Transpose": (_ADD1, False), "Concat": ((), False), "Split": ((), False), "Pad": ((), False),
    "DepthToSpace": (_ADD1, False), "SpaceToDepth": (_ADD1, False), "Trilu": (_ADD1, False),
    "ReverseSequence": ((), False), "Resize": ((("add", 4),), False), "Upsample": ((("add", 4),), False),
    "Slice": ((), True), "Gather": ((), True), "GatherElements": ((), True), "GatherND": ((), True),
    "Expand": ((), True), "Tile": ((), True), "ScatterND": ((), False), "ScatterElements": ((), False),
    "ConstantOfShape": ((), True), "Range": (_ADD1, True), "EyeLike": ((), True), "OneHot": (_ADD1, True),
    "NonZero": ((("reduce", 1),), False), "Compress": ((), False),
    # GE's format conversion (cost_model.formats): every element moved once into the padded fractal layout
    "TransData": (_ADD1, False),
}

# The attribute the pricing of a whole model puts on a Concat / Split that ATC lays out in place (fusion.inplace): a
# view on a profile with an Ascend chip, priced as nothing (elsewhere the kernel it is). Never in a written model.
INPLACE_ATTR = "npufuse.atc_inplace"

# Views: no kernel, no bytes (the runtime aliases the buffer or folds the value at load time).
VIEWS = frozenset({"Reshape", "Squeeze", "Unsqueeze", "Identity", "Flatten", "Shape", "Constant", "Size",
                   "Dropout", "Optional", "OptionalGetElement"})

MATMULS = frozenset({"MatMul", "Gemm", "MatMulInteger", "QLinearMatMul", "FusedMatMul", "FusedGemm",
                     "MatMulNBits"})
CONVS = frozenset({"Conv", "ConvInteger", "QLinearConv", "FusedConv", "ConvTranspose"})
ATTENTIONS = frozenset({"FusedAttention", "Attention", "MultiHeadAttention", "GroupQueryAttention"})
POOLS = frozenset({"MaxPool", "AveragePool", "LpPool"})


def add_recipes(*recipes: Recipe) -> Recipe:
    """Concatenate recipes (the epilogue of a fused op is the sum of its parts)."""
    out: list[tuple[str, float]] = []
    for r in recipes:
        out.extend(r)
    return tuple(out)
