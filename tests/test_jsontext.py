"""console.jsontext.dumps_indented writes exactly what json.dumps(doc, indent=2) writes."""

from __future__ import annotations

import enum
import json
import math

import numpy as np
import pytest

from npufuse.console.jsontext import dumps_indented


class _Level(enum.IntEnum):
    LOW = 1


class _Name(str):
    pass


DOCS = [
    {},
    [],
    "plain",
    0,
    -3,
    1.5,
    math.nan,
    math.inf,
    -math.inf,
    None,
    True,
    {"a": [1, 2.5, 1e-300, 1e300, -0.0, True, False, None, (), {}, [], "é\n\"\\\u2028 \x00"]},
    {"nested": {"deep": {"deeper": [[[]], [{}], [{"x": (1, (2, 3))}]]}}, "t": (1, "two", [3])},
    {1: "int key", 2.5: "float key", None: "none key", "s": "str key"},
    {True: "bool key", False: "other bool key"},   # apart: True and 1 are one key
    {math.inf: 1, -math.inf: 2, math.nan: 3},
    {"enum": _Level.LOW, "strsub": _Name("x"), _Name("k"): [_Level.LOW]},
    {"f64": float(np.float64(0.1)), "nan_list": [math.nan, math.inf]},
]


@pytest.mark.parametrize("doc", DOCS)
def test_same_text_as_json(doc: object) -> None:
    assert dumps_indented(doc) == json.dumps(doc, indent=2)


def test_what_json_rejects_is_rejected_the_same_way() -> None:
    with pytest.raises(TypeError) as ours:
        dumps_indented({"x": np.int64(3)})
    with pytest.raises(TypeError) as theirs:
        json.dumps({"x": np.int64(3)}, indent=2)
    assert str(ours.value) == str(theirs.value)
    with pytest.raises(TypeError):
        dumps_indented({(1, 2): "tuple key"})


def test_a_circular_document_is_named_as_json_names_it() -> None:
    loop: dict = {}
    loop["self"] = loop
    with pytest.raises(ValueError, match="Circular reference detected"):
        dumps_indented(loop)
