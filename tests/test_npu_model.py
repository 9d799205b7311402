"""NpuSpec profiles (TOML with sources, refusals with one clear line) and tiling under UB / L1 / L0 limits."""

from __future__ import annotations

import dataclasses
from importlib import resources
from pathlib import Path

import pytest

from npufuse.npu_model import (DEFAULT_PROFILE, NpuSpec, ProfileError, list_profiles, load_profile, row_tile,
                               stream_tile)
from npufuse.npu_model.spec import PROFILE_KEYS, tomllib
from npufuse.npu_model.tiling import cube_tile

SHIPPED = ("Ascend910B2", "Ascend910A", "Ascend310P3")
KiB = 1024


def _profile_text(name: str = "Ascend910B2") -> str:
    return resources.files("npufuse.npu_model").joinpath("profiles", f"{name}.toml").read_text("utf-8")


def _write(tmp_path: Path, text: str, name: str = "chip.toml") -> Path:
    p = tmp_path / name
    p.write_text(text, encoding="utf-8")
    return p


# ---- profiles -------------------------------------------------------------------------------------

def test_shipped_profiles_listed_and_default_present():
    names = list_profiles()
    for n in SHIPPED:
        assert n in names
    assert DEFAULT_PROFILE in names


@pytest.mark.parametrize("name", SHIPPED)
def test_every_number_of_a_shipped_profile_has_a_source(name):
    doc = tomllib.loads(_profile_text(name))
    sources = doc["sources"]
    missing = [k for k in PROFILE_KEYS + ("chip",) if not str(sources.get(k, "")).strip()]
    assert not missing, f"{name}: no source for {missing}"


def test_design_table_values():
    b2, a, p3 = (load_profile(n) for n in SHIPPED)
    assert (b2.cube_cores, b2.vector_cores, b2.clock_hz) == (24, 48, 1.8e9)
    assert (b2.ub_bytes, b2.l1_bytes, b2.l0a_bytes, b2.l0b_bytes, b2.l0c_bytes) == (
        192 * KiB, 512 * KiB, 64 * KiB, 64 * KiB, 128 * KiB)
    assert b2.l2_bytes == 192 * KiB * KiB and b2.cube_to_vector_path == "l2"
    assert b2.gm_read_bytes_per_cycle_per_core == 32 and b2.ub_to_gm_bytes_per_cycle_per_core == 64
    assert (a.cube_cores, a.clock_hz, a.ub_bytes, a.l0c_bytes, a.cube_to_vector_path) == (
        32, 1.0e9, 256 * KiB, 256 * KiB, "direct")
    # 310P3: Vector-only kernels run on the 8 AI cores' Vector units and the 7 Vector cores (was 7: the Vector
    # cores alone); its Cube has no fp32 path
    assert (p3.cube_cores, p3.vector_cores, p3.gm_read_bytes_per_cycle_per_core) == (8, 8 + 7, 17)
    assert p3.cube_fp32_as_fp16 and not a.cube_fp32_as_fp16 and not b2.cube_fp32_as_fp16
    assert p3.cube_dtype("float32") == "float16" and b2.cube_dtype("float32") == "float32"
    assert p3.gm_bandwidth_bytes_per_s == pytest.approx(204.8e9) and p3.cube_to_vector_path == "direct"
    for s in (b2, a, p3):
        assert s.cube_fp16_macs_per_cycle == 16 * 16 * 16
        assert s.cube_int8_macs_per_cycle == 2 * s.cube_fp16_macs_per_cycle
        assert s.cube_fp32_macs_per_cycle < s.cube_fp16_macs_per_cycle
        assert s.vector_bytes_per_cycle == 256 and s.alignment_bytes == 32
        assert s.repeat_cost("exp") > s.repeat_cost("add") and s.repeat_cost("erf") > s.repeat_cost("add")
    assert b2.peak_flops("float16") == pytest.approx(2 * 4096 * 24 * 1.8e9)
    assert b2.vector_per_cube_core == 2 and a.vector_per_cube_core == 1
    assert (b2.chip, a.chip, p3.chip) == ("ascend910b", "ascend910", "ascend310p")


def test_names_are_case_insensitive():
    assert load_profile("ascend910b2").name == "Ascend910B2"


def test_describe_rows_have_units():
    rows = dict(load_profile("Ascend910B2").describe())
    assert rows["UB per core"] == "192 KiB"
    assert rows["Clock"] == "1.8 GHz"
    assert "L2" in rows["Cube -> Vector"]
    assert dict(load_profile("Ascend910A").describe())["UB per core"] == "256 KiB"
    assert rows["Chip (Ascend kernels)"] == "ascend910b"


def test_unknown_name_lists_shipped_profiles():
    with pytest.raises(ProfileError) as ei:
        load_profile("Ascend999Z")
    msg = str(ei.value)
    assert "\n" not in msg
    assert "Ascend999Z" in msg and all(n in msg for n in SHIPPED)


def test_user_profile_from_a_path(tmp_path):
    text = _profile_text().replace('name = "Ascend910B2"', 'name = "MyChip"').replace(
        "ub_bytes = 196608", "ub_bytes = 524288")
    p = _write(tmp_path, text)
    spec = load_profile(str(p))
    assert spec.name == "MyChip" and spec.ub_bytes == 512 * KiB and spec.source_path == str(p)
    # a user profile may leave out the name: the file name stands in
    q = _write(tmp_path, text.replace('name = "MyChip"\n', ""), "other_chip.toml")
    assert load_profile(str(q)).name == "other_chip"
    # ... and the chip: then no kernel is refused for availability, and `npufuse profiles` says so
    r = _write(tmp_path, text.replace('chip = "ascend910b"', ""), "no_chip.toml")
    assert load_profile(str(r)).chip is None
    assert "not set" in dict(load_profile(str(r)).describe())["Chip (Ascend kernels)"]
    # a chip name is case-insensitive
    assert load_profile(str(_write(tmp_path, text.replace('"ascend910b"', '"Ascend310P"')))).chip == "ascend310p"


@pytest.mark.parametrize("value", ['"ascend999"', "910", '""'])
def test_unknown_chip_refused_listing_the_known_ones(tmp_path, value):
    msg = _refusal(tmp_path, _profile_text().replace('chip = "ascend910b"', f"chip = {value}"))
    assert "'chip'" in msg and "ascend910b" in msg and "ascend310p" in msg and "left out" in msg


def _refusal(tmp_path: Path, text: str) -> str:
    p = _write(tmp_path, text)
    with pytest.raises(ProfileError) as ei:
        load_profile(str(p))
    msg = str(ei.value)
    assert "\n" not in msg, "a profile refusal is one line"
    assert str(p) in msg
    return msg


def test_missing_field_refused_naming_it(tmp_path):
    msg = _refusal(tmp_path, _profile_text().replace("ub_bytes = 196608", ""))
    assert "memory.ub_bytes" in msg and "missing" in msg


def test_negative_ub_refused_naming_it(tmp_path):
    msg = _refusal(tmp_path, _profile_text().replace("ub_bytes = 196608", "ub_bytes = -196608"))
    assert "memory.ub_bytes" in msg and "positive" in msg


def test_wrong_type_refused(tmp_path):
    msg = _refusal(tmp_path, _profile_text().replace("clock_hz = 1.8e9", 'clock_hz = "fast"'))
    assert "cores.clock_hz" in msg and "number" in msg


def test_l0_larger_than_l1_refused(tmp_path):
    msg = _refusal(tmp_path, _profile_text().replace("l0a_bytes = 65536", "l0a_bytes = 1048576"))
    assert "memory.l0a_bytes" in msg and "l1" in msg.lower()


def test_unknown_cube_to_vector_path_refused(tmp_path):
    msg = _refusal(tmp_path, _profile_text().replace('cube_to_vector_path = "l2"', 'cube_to_vector_path = "bus"'))
    assert "cores.cube_to_vector_path" in msg and "'l2'" in msg and "'direct'" in msg


def test_missing_repeat_cost_refused(tmp_path):
    msg = _refusal(tmp_path, _profile_text().replace("erf = 8.0", ""))
    assert "vector.repeat_cost.erf" in msg


def test_bad_toml_refused(tmp_path):
    msg = _refusal(tmp_path, "[cores\ncube_cores = 3")
    assert "TOML" in msg


# ---- tiling ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", SHIPPED)
@pytest.mark.parametrize("mnk", [(4096, 4096, 4096), (128, 1024, 1024), (7, 300, 77), (3136, 64, 576)])
def test_cube_tile_within_l0_and_l1(name, mnk):
    spec = load_profile(name)
    m, n, k = mnk
    t = cube_tile(m, n, k, 2, spec)
    assert t.feasible and t.kind == "cube"
    assert t.m % 16 == 0 and t.n % 16 == 0 and t.k % 16 == 0 and t.k_l1 % t.k == 0
    assert t.l0a_bytes_needed == 2 * t.m * t.k * 2 <= spec.l0a_bytes        # double buffered
    assert t.l0b_bytes_needed == 2 * t.n * t.k * 2 <= spec.l0b_bytes
    assert t.l0c_bytes_needed == t.m * t.n * 4 <= spec.l0c_bytes            # fp32 accumulator
    assert t.l1_bytes_needed <= spec.l1_bytes
    assert t.bound_by in ("l0a", "l0b", "l0c", "l1", "none")


def test_cube_tile_bound_by_names_the_limit():
    spec = load_profile("Ascend910B2")
    assert cube_tile(4096, 4096, 4096, 2, spec).bound_by in ("l0c", "l0a", "l0b")
    assert cube_tile(16, 16, 16, 2, spec).bound_by == "none"


def test_row_tile_refusal_says_how_much_ub():
    spec = load_profile("Ascend910B2")
    t = row_tile(8, 16384, spec, [2, 2], [4, 4], [32768, 32768], what="a row of 16384 float16 elements")
    assert not t.feasible and t.bound_by == "ub"
    assert t.reason == ("a row of 16384 float16 elements with double buffering needs 320 KiB of UB, more than "
                        "the 192 KiB on Ascend910B2")


def test_row_tile_counts_double_buffering_and_alignment():
    spec = load_profile("Ascend910B2")
    t = row_tile(1000, 1000, spec, [2, 2], [4], [])
    per_row = 2 * 2016 + 2 * 2016 + 4000   # 2000 B rounded up to 32 B, double buffered; one fp32 temp
    assert t.feasible and t.bound_by == "ub" and t.rows == spec.ub_bytes // per_row
    assert t.ub_bytes_needed == t.rows * per_row <= spec.ub_bytes
    assert row_tile(3, 1000, spec, [2, 2], [4], []).bound_by == "none"


def test_stream_tile_is_aligned_and_fits():
    spec = load_profile("Ascend310P3")
    t = stream_tile(10**7, spec, [2, 2, 2])
    assert t.feasible and t.bound_by == "ub"
    assert (t.elems * 2) % 32 == 0 and t.ub_bytes_needed <= spec.ub_bytes
    assert stream_tile(100, spec, [2, 2]).bound_by == "none"


def test_bigger_ub_never_makes_a_row_infeasible():
    base = load_profile("Ascend910B2")
    for cols in (1024, 4096, 8192, 12288, 16384, 32768):
        seen_feasible = False
        for ub in range(64 * KiB, 1024 * KiB + 1, 32 * KiB):
            spec = dataclasses.replace(base, ub_bytes=ub)
            ok = row_tile(4, cols, spec, [2, 2], [4, 4], [2 * cols, 2 * cols]).feasible
            assert ok or not seen_feasible, f"cols={cols}: feasible below {ub} bytes of UB but not at it"
            seen_feasible |= ok


def test_spec_is_a_frozen_dataclass():
    spec = load_profile("Ascend910B2")
    assert isinstance(spec, NpuSpec)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.ub_bytes = 1  # type: ignore[misc]


def test_fp32_as_fp16_is_an_optional_boolean(tmp_path):
    text = _profile_text("Ascend310P3")
    msg = _refusal(tmp_path, text.replace("fp32_as_fp16 = true", 'fp32_as_fp16 = "yes"'))
    assert "'cube.fp32_as_fp16'" in msg and "true" in msg
    left_out = load_profile(str(_write(tmp_path, text.replace("fp32_as_fp16 = true", ""), "p.toml")))
    assert not left_out.cube_fp32_as_fp16 and left_out.cube_dtype("float32") == "float32"
