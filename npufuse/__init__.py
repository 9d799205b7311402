"""npufuse: fuse ONNX graphs for Ascend-style NPUs, priced by a cost model and proven numerically."""

__version__ = "0.1.0"

FUSED_DOMAIN = "npufuse"
FUSED_DOMAIN_VERSION = 1
