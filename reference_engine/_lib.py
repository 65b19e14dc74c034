"""Loads the reference engine's C core (built by `pip install .` as stdengine/reference/_core*.so)."""

from __future__ import annotations

import ctypes
import importlib.machinery
from functools import cache
from pathlib import Path

from stdengine.errors import EngineUnavailable


@cache
def lib() -> ctypes.CDLL:
    here = Path(__file__).parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = here / f"_core{suffix}"
        if path.exists():
            return ctypes.CDLL(str(path))
    raise EngineUnavailable(
        "the reference engine's C core is not built",
        hint="reinstall with `pip install .` (or `python setup.py build_ext --inplace` in a checkout)",
    )
