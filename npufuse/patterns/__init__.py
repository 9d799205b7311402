"""The fusion families. Each module holds one family; this registry lists them in matching order."""

from __future__ import annotations

from npufuse.patterns.add_norm import AddLayerNormPattern, AddRMSNormPattern
from npufuse.patterns.attention import FusedAttentionPattern
from npufuse.patterns.base import FusedOpDef, Pattern
from npufuse.patterns.conv_bn_act import ConvBnActivation
from npufuse.patterns.gated_mlp import GatedMLPPattern
from npufuse.patterns.gelu import GeluPattern
from npufuse.patterns.group_norm import GroupNormPattern
from npufuse.patterns.linear_bn import GemmBatchNorm, MatMulBatchNorm
from npufuse.patterns.matmul_epilogue import MatMulEpilogue
from npufuse.patterns.mla_prolog import MlaPrologPattern
from npufuse.patterns.moe_gating import MoeGatingPattern
from npufuse.patterns.norms import LayerNormPattern, RMSNormPattern
from npufuse.patterns.rotary import RotaryPattern
from npufuse.patterns.rotary_pair import RotaryPairPattern
from npufuse.patterns.silu import SiluPattern

# One line per family. Order breaks ties between equal-gain candidates deterministically.
PATTERNS: tuple[Pattern, ...] = (
    ConvBnActivation(), GemmBatchNorm(), MatMulBatchNorm(),
    LayerNormPattern(), RMSNormPattern(), GroupNormPattern(), GeluPattern(), RotaryPattern(), MoeGatingPattern(),
    FusedAttentionPattern(), GatedMLPPattern(), MlaPrologPattern(), RotaryPairPattern(),
    MatMulEpilogue(),
    AddLayerNormPattern(), AddRMSNormPattern(),
    SiluPattern(),
)


def fused_op_defs() -> dict[tuple[str, str], FusedOpDef]:
    """(domain, op_type) -> definition, for every op any pattern emits."""
    return {(d.domain, d.op_type): d for p in PATTERNS for d in p.fused_ops}
