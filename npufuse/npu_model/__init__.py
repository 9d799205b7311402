"""The NPU as data: `NpuSpec` profiles (TOML, with sources) and tile choice under UB / L1 / L0 limits."""

from npufuse.npu_model.spec import (
    DEFAULT_PROFILE,
    NpuSpec,
    ProfileError,
    format_bytes,
    list_profiles,
    load_profile,
)
from npufuse.npu_model.tiling import Tile, cube_tile, row_tile, stream_tile

__all__ = ["DEFAULT_PROFILE", "NpuSpec", "ProfileError", "Tile", "cube_tile", "format_bytes", "list_profiles",
           "load_profile", "row_tile", "stream_tile"]
