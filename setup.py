"""Builds the reference engine's C core as a plain shared library loaded with ctypes.

It is declared as an Extension only so that `pip install .` compiles it with no manual step;
it has no Python API. SIMD paths are selected at run time (se_kernels_init in reference_engine/csrc/kernels.c),
so the flags here are portable ones.
"""

from pathlib import Path

from setuptools import Extension, setup

CSRC = Path("reference_engine/csrc")

core = Extension(
    "stdengine.reference._core",
    sources=sorted(str(p) for p in CSRC.glob("*.c")),
    include_dirs=[str(CSRC)],
    depends=sorted(str(p) for p in CSRC.glob("*.h")),  # an edited header rebuilds the sources
    extra_compile_args=["-O3", "-std=c11", "-Wall", "-Wextra", "-fno-math-errno", "-pthread"],
    extra_link_args=["-pthread", "-lm"],
)

setup(ext_modules=[core])
