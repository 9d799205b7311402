"""Emitters: the forms an optimized model is written in (the portable ONNX form, the ATC form, ATC's fusion switch file)."""
