"""The matmul kernels of two builds of the reference engine's C core, side by side in one process.

    python -m stdengine.bench.kernels_ab OLD=path/to/_core.so NEW=path/to/_core.so [...]

Build the other one from a worktree: `git worktree add /tmp/old REV && cd /tmp/old &&
python setup.py build_ext --inplace` (the library is reference_engine/_core*.so). Each build's
se_matmul runs in turn on the same random weights (the shapes of SmolLM2's and Gemma's matmuls)
for 1, 4, 8 and 64 tokens, five rounds; the best time of each is printed as GMAC/s on one thread,
weights in cache. A kernel-level figure: end-to-end speed is infer-bench's.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import time

import numpy as np
from stdengine.reference import kernels as K

CASES = [
    ("q4_1", 1536, 576),
    ("q4_1", 576, 1536),
    ("q5_0", 2048, 640),
    ("q8_0", 1024, 640),
    ("q4_k", 640, 2048),
    ("q6_k", 640, 2048),
]  # (type, rows, k)


def load(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    lib.se_matmul.argtypes = [
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int64,
    ]
    lib.se_matmul.restype = None
    return lib


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("builds", nargs="+", metavar="NAME=PATH", help="a name and the path of a _core*.so")
    args = ap.parse_args(argv)
    libs = {name: load(path) for name, path in (b.split("=", 1) for b in args.builds)}
    rng = np.random.default_rng(0)
    print("type rows k tokens " + " ".join(f"{n}_GMAC/s" for n in libs))
    for t, rows, k in CASES:
        w = K.random_weights(t, rows, k, rng)
        for n in (1, 4, 8, 64):
            act = K.quantize(K.traits(t).act_type, rng.standard_normal((n, k)).astype(np.float32))
            y = np.empty((n, rows), np.float32)
            best = dict.fromkeys(libs, float("inf"))
            for _ in range(5):
                for name, lib in libs.items():
                    calls = max(1, 2000 // n)
                    t0 = time.perf_counter()
                    for _ in range(calls):
                        lib.se_matmul(
                            K.type_id(t), w.ctypes.data, k, act.ctypes.data, n, y.ctypes.data, rows, 0, rows
                        )
                    best[name] = min(best[name], (time.perf_counter() - t0) / calls)
            print(
                t, rows, k, n, " ".join(f"{rows * k * n / best[name] / 1e9:.1f}" for name in libs), flush=True
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
