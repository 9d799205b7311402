"""npufuse: fuse ONNX graphs for Ascend-style NPUs, priced by a cost model and proven numerically.

The Python API mirrors the command line (docs/api.md):

    import npufuse
    result = npufuse.optimize("model.onnx", output="model.npufuse.onnx")

`optimize`, `report`, `check`, `save_golden`, `profiles` and `OptimizeResult` live in `npufuse.api` and are
imported on first use, so `import npufuse` stays cheap (no onnx, numpy or onnxruntime until then).
The exceptions (`NpufuseError`, `InputError`, `InconclusiveError`, `DriftError`) live in `npufuse.errors`.
"""

from __future__ import annotations

__version__ = "0.1.0"

FUSED_DOMAIN = "npufuse"
FUSED_DOMAIN_VERSION = 1

__all__ = ["DriftError", "InconclusiveError", "InputError", "NpufuseError", "OptimizeResult", "ReportDocument",
           "__version__", "check", "optimize", "profiles", "report", "save_golden"]

# Where each public name lives; imported on first use (PEP 562), so `import npufuse` imports nothing else.
_LAZY = {"optimize": "api", "report": "api", "check": "api", "save_golden": "api", "profiles": "api",
         "OptimizeResult": "api", "ReportDocument": "api",
         "NpufuseError": "errors", "InputError": "errors", "InconclusiveError": "errors", "DriftError": "errors"}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'npufuse' has no attribute {name!r}")
    from importlib import import_module

    return getattr(import_module(f"npufuse.{module}"), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
