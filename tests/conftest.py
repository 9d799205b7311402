import os
from pathlib import Path

import onnx
import pytest

LIGHT_DIR = Path(os.path.dirname(onnx.__file__)) / "backend" / "test" / "data" / "light"
FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="session")
def light_dir() -> Path:
    return LIGHT_DIR


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    return FIXTURES
