"""The ATC form: what CANN's ONNX parser (ATC) accepts, its offline pre-check, and reference kernels of the CANN plugin ops."""
