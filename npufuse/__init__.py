"""npufuse: fuse ONNX graphs for Ascend-style NPUs, priced by a cost model and proven numerically.

The Python API mirrors the command line (docs/api.md):

    import npufuse
    result = npufuse.optimize("model.onnx", output="model.npufuse.onnx")

`optimize`, `report`, `check`, `save_golden`, `profiles` and `OptimizeResult` live in `npufuse.api` and are
imported on first use, so `import npufuse` stays cheap (no onnx, numpy or onnxruntime until then).
"""

from __future__ import annotations

from npufuse.errors import DriftError, InconclusiveError, InputError, NpufuseError

__version__ = "0.1.0"

FUSED_DOMAIN = "npufuse"
FUSED_DOMAIN_VERSION = 1

__all__ = ["DriftError", "InconclusiveError", "InputError", "NpufuseError", "OptimizeResult", "ReportDocument",
           "__version__", "check", "optimize", "profiles", "report", "save_golden"]

_API = frozenset({"optimize", "report", "check", "save_golden", "profiles", "OptimizeResult", "ReportDocument"})


def __getattr__(name: str) -> object:   # PEP 562: the API is imported on first use
    if name in _API:
        from npufuse import api

        return getattr(api, name)
    raise AttributeError(f"module 'npufuse' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _API)
