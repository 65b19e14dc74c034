"""Running a test on one of the reference engine's SIMD paths, in process (as INFER_REF_ISA would
choose it at start-up), then going back to the path in use before; and which paths this CPU's
flags allow (the kernels' rule, read independently from /proc/cpuinfo)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
from stdengine.reference import kernels as K

from stdengine.recipes import _cpu_flags

# All the CPU flags each path needs, from the lowest path to the highest (csrc/kernels.c,
# cpu_best_isa; Linux lists amx_tile and amx_int8 only where it supports AMX).
PATH_FLAGS = {
    "scalar": set(),
    "avx2": {"avx2", "fma", "f16c"},
    "avx512": {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"},
    "amx": {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "amx_tile", "amx_int8"},
}


def cpu_flags() -> set[str]:
    flags = _cpu_flags()  # the recipes' reader of /proc/cpuinfo
    if not flags:
        pytest.skip("no CPU flags in /proc/cpuinfo")
    return flags


def best_path() -> str:
    """The best path this CPU's flags allow."""
    flags = cpu_flags()
    return [name for name, need in PATH_FLAGS.items() if need <= flags][-1]


def refused(name: str) -> None:
    """The C core refused path name: skip when this CPU lacks the path's flags (a CI run accepts
    only that skip: tests/allowed_skips.txt), fail when it has them all."""
    missing = sorted(PATH_FLAGS[name] - cpu_flags())
    if not missing:
        pytest.fail(f"the CPU lists every flag the {name} path needs, and the C core refused it")
    pytest.skip(f"this CPU lacks {' '.join(missing)}, which the {name} path needs")


@contextlib.contextmanager
def using_isa(name: str) -> Iterator[str]:
    """Run on the named path, then go back to the one in use before (INFER_REF_ISA's choice when
    one is forced, so that later tests in the process keep it); refused() when the core refuses it."""
    before = K.isa()
    if not K.set_isa(name):
        refused(name)
    try:
        assert K.isa() == name
        yield name
    finally:
        K.set_isa(before)
