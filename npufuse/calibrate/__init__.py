"""`npufuse calibrate`: fit a handful of a profile's terms to published timings, validated leave-one-model-out.

- `data`: load and check the calibration rows (npu_model/calibration/*.toml, or a user's own in that schema);
- `workloads`: a row -> the kernels npufuse would run for it (a kernel shape, or a recipe ONNX fused by the engine);
- `evaluate`: re-price those kernels under other terms from their recorded basis (no cost model run);
- `fit`: robust least squares on log time, and leave-one-model-out validation;
- `profile_out`: the profile TOML with the fitted terms and their provenance.
"""
