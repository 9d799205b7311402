"""Numeric verification: each rewrite on its own, and the whole model, against onnxruntime."""
