"""Per-op and per-fusion cost on an NpuSpec, and the fuse/skip decision.

    from npufuse.cost_model import OpWork, TensorInfo, FusionCandidate, estimate_op, decide, estimate_ops

Modeling assumptions (the numbers live in the profile TOML files, each with its source):
- Per kernel, per core, double buffered: t = max(stage totals) + fill/drain + launch, where the stages are
  MTE2 in, Cube, Vector, Cube->Vector hand-off and MTE3 out; bounded below by the chip roofline (Cube
  flops / peak, GM bytes / GM bandwidth, L2 bytes / L2 bandwidth). See `kernel.py`.
- Cube work goes to the Cube cores in output tiles (tile searched for the lowest time within L0A/L0B/L0C
  and L1); Conv is an implicit GEMM (M = N*Hout*Wout, K = Cin/group*prod(kernel), N = Cout/group, one
  GEMM per group); MatMul batch dims multiply; a partial tile costs a whole fractal on the Cube.
- First reads of an operand come from GM (spread over the Cube cores), re-reads by other tiles from L2 when
  the panels in use fit L2 (swizzled tile order), else from GM again.
- fp32 and bf16 Cube rates are profile fields (assumption: fp32 at 1/4 of fp16; no bf16 on 910A/310P).
- Vector: 256-byte repeats per cycle per core, each instruction class weighted by `vector.repeat_cost`
  (exp/div/sqrt cost more than add/mul); norms and softmax compute in fp32.
- Vector-only kernels split evenly over the Vector cores; a norm/softmax needs a whole row of the reduced
  axis in UB (input and output double buffered, two fp32 work rows, gamma/beta once), 32-byte aligned.
- Fused kernels keep intermediates on chip: no GM round trip, one launch. On split AIC/AIV parts (910B)
  the Cube->Vector hand-off is written to and read back from L2 at the L2 rate; on L0C->UB parts it is free
  but a norm epilogue's whole rows must fit the UB beside the Cube (fewer than 16 rows starves the Cube).
- Conv/Gemm bias and a FusedMatMul's leading bias are added by FixPipe (no Vector work).
- Views (Reshape, Squeeze, Unsqueeze, Identity, Flatten, Shape, Constant, Size, Dropout) cost nothing and
  launch nothing; unknown op types get a generic one-add-per-element estimate with a note, never an error.
- Kernel boundaries are charged at GM rates (L2 residency between separate kernels is not modeled).
"""

from npufuse.cost_model.decide import FusionDecision, decide
from npufuse.cost_model.estimate import ModelEstimate, estimate_op, estimate_ops
from npufuse.cost_model.kernel import KernelEstimate
from npufuse.cost_model.workload import FusionCandidate, OpWork, TensorInfo

__all__ = ["FusionCandidate", "FusionDecision", "KernelEstimate", "ModelEstimate", "OpWork", "TensorInfo",
           "decide", "estimate_op", "estimate_ops"]
