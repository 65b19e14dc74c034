"""Running a test on one of the reference engine's SIMD paths, in process (as INFER_REF_ISA would
choose it at start-up), then going back to the path in use before."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
from stdengine.reference import kernels as K


@contextlib.contextmanager
def using_isa(name: str) -> Iterator[str]:
    """Run on the named path (skip when this CPU cannot), then go back to the one in use before
    (INFER_REF_ISA's choice when one is forced, so that later tests in the process keep it)."""
    before = K.isa()
    if not K.set_isa(name):
        pytest.skip(f"this CPU cannot run the {name} path")
    try:
        assert K.isa() == name
        yield name
    finally:
        K.set_isa(before)
