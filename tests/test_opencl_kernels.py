"""The OpenCL backend's operations (reference_engine/csrc/backend_opencl.c, opencl_kernels.cl) against
numpy, on the first OpenCL device here (PoCL on the CPU in CI).

The operations are called through the backend's own table (the test hook se_opencl_backend()), as
device_forward.c calls them. Expected values never come from the code under test: weights are
dequantized by gguf.quants, everything else is computed by numpy in float64. Tolerances are stated
per test; the matmul's dequantization is checked bit for bit (an identity matrix of activations
reads every weight back exactly), and batch invariance (a row's result does not depend on the
other rows) bit for bit too.

Without an OpenCL device the device tests skip with the backend's reason (no libOpenCL.so.1, no
platform, no device); the ones about loading and the table's layout run everywhere.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize as gg_dequantize  # noqa: E402

try:
    from stdengine.reference import core
    from test_kernels import WEIGHT_TYPES, block, rng_for, sources, weights
except Exception as e:  # the C core is not built, or the package is not installed
    pytest.skip(f"reference engine C core unavailable: {e}", allow_module_level=True)

T = gguf.GGMLQuantizationType
CSRC = Path(__file__).resolve().parent.parent / "reference_engine" / "csrc"
OK, ERR_INVALID, ERR_NOMEM = 0, -3, -4
ROPE_NORM, ROPE_NEOX = 0, 2
SILU, GELU_TANH = 0, 1

_i32, _i64, _sz, _vp, _f32 = ctypes.c_int32, ctypes.c_int64, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_float
_fn = ctypes.CFUNCTYPE


class DView(ctypes.Structure):
    _c_struct_ = "se_dview"
    _fields_ = [("buf", _vp), ("off", _sz)]


class Backend(ctypes.Structure):
    """backend.h se_backend, in its order (test_backend_mirror checks it against the header)."""

    _c_struct_ = "se_backend"
    _fields_ = [
        ("name", ctypes.c_char_p),
        ("count", _fn(ctypes.c_int)),
        ("describe", _fn(ctypes.c_int, ctypes.c_int, ctypes.c_char_p, _sz, ctypes.POINTER(ctypes.c_uint64))),
        ("open", _fn(_vp, ctypes.c_int)),
        ("close", _fn(None, _vp)),
        ("last_error", _fn(ctypes.c_char_p)),
        ("supports_type", _fn(ctypes.c_int, _i32)),
        ("alloc", _fn(_vp, _vp, _sz)),
        ("release", _fn(None, _vp)),
        ("write", _fn(ctypes.c_int, DView, _vp, _sz)),
        ("read", _fn(ctypes.c_int, DView, _vp, _sz)),
        ("matmul", _fn(ctypes.c_int, _vp, _i32, DView, _sz, _i64, _i64, DView, _i32, DView, _i64)),
        ("rmsnorm", _fn(ctypes.c_int, _vp, DView, DView, DView, _i64, _i64, _f32)),
        ("rope", _fn(ctypes.c_int, _vp, DView, _i32, _i32, _i32, _i32, _i32, _i32, _f32, _f32)),
        (
            "attention",
            _fn(ctypes.c_int, _vp, DView, DView, DView, DView, DView, *[_i32] * 7, _f32, DView),
        ),
        ("kv_bytes", _fn(_sz, _i32, _i32, _i32)),
        ("ffn_act", _fn(ctypes.c_int, _vp, DView, DView, _i64, _i32)),
        ("add", _fn(ctypes.c_int, _vp, DView, DView, _i64)),
        ("finish", _fn(ctypes.c_int, _vp)),
    ]


def backend() -> Backend:
    f = core.lib().se_opencl_backend
    f.argtypes, f.restype = [], ctypes.POINTER(Backend)
    return f().contents


def err(be: Backend) -> str:
    return (be.last_error() or b"").decode()


class Device:
    """An open device and the buffers a test made on it (released at the end)."""

    def __init__(self, be: Backend, index: int):
        self.be = be
        self.d = be.open(index)
        assert self.d, err(be)
        self.bufs: list[int] = []

    def put(self, a: np.ndarray, pad: int = 0) -> DView:
        """A new buffer holding a's bytes after `pad` bytes of other data (views need not start at 0)."""
        a = np.ascontiguousarray(a)
        v = self.empty(pad + a.nbytes, pad)
        self.check(self.be.write(v, a.ctypes.data, a.nbytes))
        return v

    def empty(self, nbytes: int, off: int = 0) -> DView:
        b = self.be.alloc(self.d, nbytes)
        assert b, err(self.be)
        self.bufs.append(b)
        return DView(b, off)

    def get(self, v: DView, shape, dtype=np.float32) -> np.ndarray:
        out = np.empty(shape, dtype=dtype)
        self.check(self.be.read(v, out.ctypes.data, out.nbytes))
        return out

    def check(self, rc: int) -> None:
        assert rc == OK, f"rc {rc}: {err(self.be)}"

    def close(self) -> None:
        for b in self.bufs:
            self.be.release(b)
        self.be.close(self.d)


def at(v: DView, nbytes: int) -> DView:
    return DView(v.buf, v.off + nbytes)


@pytest.fixture(scope="module")
def be() -> Backend:
    return backend()


@pytest.fixture(scope="module")
def dev(be):
    if be.count() == 0:
        pytest.skip(f"no OpenCL device: {err(be)}")
    d = Device(be, int(os.environ.get("INFER_TEST_OPENCL_DEVICE", "0")))
    yield d
    d.close()


# ------------------------------------------------------------------ loading, devices


def in_child(statement: str, **env: str) -> tuple[str, str]:
    """Runs `statement` (with `be`, the backend) in a fresh process with env set (the backend reads
    its variables once per process): its first output line, and the backend's last_error()."""
    code = f"import test_opencl_kernels as t; be = t.backend(); {statement}; print(t.err(be))"
    full = dict(os.environ, **env)
    full["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), full.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, check=True)
    first, rest = out.stdout.split("\n", 1)
    return first, rest


def test_backend_mirror_matches_backend_h(tmp_path):
    """The ctypes mirror above has backend.h's layout (offsets printed by gcc against the header)."""
    gcc = shutil.which("gcc")
    assert gcc, "gcc is needed (the C core is built with it)"
    lines = [
        f'printf("%zu %zu\\n", offsetof({cls._c_struct_}, {name}), sizeof({cls._c_struct_}));'
        for cls in (DView, Backend)
        for name, *_ in cls._fields_
    ]
    src = tmp_path / "layout.c"
    head = '#define SE_ENGINE_INTERNAL\n#include <stddef.h>\n#include <stdio.h>\n#include "backend.h"\n'
    src.write_text(head + "int main(void) {\n" + "\n".join(lines) + "\nreturn 0;\n}\n")
    exe = tmp_path / "layout"
    subprocess.run([gcc, "-std=c11", f"-I{CSRC}", str(src), "-o", str(exe)], check=True)
    out = subprocess.check_output([str(exe)], text=True)
    got = [tuple(map(int, line.split())) for line in out.splitlines()]
    want = [
        (getattr(cls, name).offset, ctypes.sizeof(cls))
        for cls in (DView, Backend)
        for name, *_ in cls._fields_
    ]
    assert got == want


def test_without_the_library_there_is_no_device_and_the_error_says_so():
    """INFER_OPENCL_LIB names the loader to dlopen: a missing one leaves count() at 0 with the reason."""
    n, msg = in_child("print(be.count())", INFER_OPENCL_LIB="/nonexistent/libOpenCL.so.1")
    assert n == "0"
    assert "/nonexistent/libOpenCL.so.1 not found" in msg and "install an OpenCL driver" in msg


def test_a_kernel_build_failure_gives_the_compiler_log(be, dev):
    """INFER_OPENCL_OPTIONS reaches the device's compiler: a broken macro fails the open with its log."""
    d, msg = in_child("print(be.open(0))", INFER_OPENCL_OPTIONS="-DATT_CHUNK=no_such_identifier")
    assert d == "None"
    assert "the kernels failed to build" in msg and "CL_BUILD_PROGRAM_FAILURE" in msg
    assert "no_such_identifier" in msg.split("the compiler said:", 1)[1]


def test_devices_are_described(be, dev):
    assert be.name == b"opencl"
    for i in range(be.count()):
        name, mem = ctypes.create_string_buffer(256), ctypes.c_uint64()
        assert be.describe(i, name, 256, ctypes.byref(mem)) == OK
        assert " / " in name.value.decode() and mem.value > 0
    assert be.describe(be.count(), name, 256, ctypes.byref(mem)) == ERR_INVALID
    assert "no device" in err(be)


def test_alloc_failure_says_the_bytes(be, dev):
    assert not be.alloc(dev.d, 1 << 60)
    assert str(1 << 60) in err(be) and "out of device memory" in err(be)


def test_views_are_checked_against_their_buffers(be, dev):
    x = dev.put(np.ones(8, np.float32))
    y = dev.empty(4 * 7)
    assert be.add(dev.d, x, y, 8) == ERR_INVALID
    assert "y needs 32 bytes at offset 0 of a buffer of 28 bytes" in err(be)
    assert be.add(dev.d, at(x, 2), x, 1) == ERR_INVALID
    assert "not on a float" in err(be)
    assert be.read(at(x, 4), np.empty(8, np.float32).ctypes.data, 32) == ERR_INVALID


# ------------------------------------------------------------------ matmul


def matmul_shape(t) -> tuple[int, int]:
    """(rows, k): a few blocks, and for the float types a k that is not a multiple of 32."""
    return (5, 37) if block(t) == 1 else (5, block(t) * (2 if block(t) == 256 else 3))


def run_matmul(dev, t, raw: np.ndarray, k: int, x: np.ndarray, ldy: int | None = None) -> np.ndarray:
    rows, n_tok = raw.shape[0], x.shape[0]
    ldy = ldy or rows
    W = dev.put(raw, pad=3)  # weights at any byte offset
    xv = dev.put(x.astype(np.float32), pad=4)
    y = dev.empty(4 * (8 + n_tok * ldy), 4 * 8)
    dev.check(dev.be.matmul(dev.d, int(t), W, raw.shape[1], k, rows, xv, n_tok, y, ldy))
    return dev.get(y, (n_tok, ldy))[:, :rows]


@pytest.mark.parametrize("t", WEIGHT_TYPES, ids=lambda t: t.name)
def test_matmul_dequantizes_like_gguf(dev, t):
    """x = the identity: y[t][r] = W[r][t], which must be gguf's dequantized weight bit for bit."""
    rows, k = matmul_shape(t)
    assert dev.be.supports_type(int(t))
    for source in sources(t):
        raw = weights(t, rows, k, rng_for("ocl-deq", t, source), source)
        want = gg_dequantize(raw, t).astype(np.float32).reshape(rows, k)
        got = run_matmul(dev, t, raw, k, np.eye(k, dtype=np.float32))
        np.testing.assert_array_equal(got.T, want, err_msg=f"{t.name} from {source} blocks")


@pytest.mark.parametrize("t", WEIGHT_TYPES, ids=lambda t: t.name)
def test_matmul_against_float64(dev, t):
    """Random activations: |y - W x| <= 1e-5 * sum_i |W[r][i] x[t][i]| (float sums over k)."""
    rows, k = matmul_shape(t)
    rng = rng_for("ocl-mm", t)
    raw = weights(t, rows, k, rng, sources(t)[-1])
    w = gg_dequantize(raw, t).astype(np.float64).reshape(rows, k)
    x = rng.standard_normal((6, k)).astype(np.float32)
    got = run_matmul(dev, t, raw, k, x, ldy=rows + 3)
    want = x.astype(np.float64) @ w.T
    bound = 1e-5 * (np.abs(x.astype(np.float64)) @ np.abs(w).T) + 1e-30
    assert np.all(np.abs(got - want) <= bound), (
        f"{t.name}: worst {np.max(np.abs(got - want) / bound)} of the bound"
    )


@pytest.mark.parametrize("t", [T.F32, T.Q4_1, T.Q8_0, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_matmul_rows_do_not_depend_on_the_batch(dev, t):
    """Each token alone (n_tok = 1, views at its row) gives its row of the 9-token batch bit for bit."""
    rows, k = 33, block(t) * 2 if block(t) > 1 else 70
    rng = rng_for("ocl-batch", t)
    raw = weights(t, rows, k, rng, sources(t)[-1])
    x = rng.standard_normal((9, k)).astype(np.float32)
    W, xv = dev.put(raw), dev.put(x)
    y = dev.empty(4 * 9 * rows)
    dev.check(dev.be.matmul(dev.d, int(t), W, raw.shape[1], k, rows, xv, 9, y, rows))
    batch = dev.get(y, (9, rows))
    for i in range(9):
        yi = dev.empty(4 * rows)
        dev.check(dev.be.matmul(dev.d, int(t), W, raw.shape[1], k, rows, at(xv, 4 * k * i), 1, yi, rows))
        np.testing.assert_array_equal(dev.get(yi, rows), batch[i], err_msg=f"token {i}")


def test_matmul_refuses_a_type_it_has_no_kernel_for(be, dev):
    assert not be.supports_type(int(T.Q8_K))
    W, x, y = dev.empty(292), dev.empty(4 * 256), dev.empty(4)
    assert be.matmul(dev.d, int(T.Q8_K), W, 292, 256, 1, x, 1, y, 1) == ERR_INVALID
    assert "q8_K" in err(be)


# ------------------------------------------------------------------ norms, rope, activations, add


def test_rmsnorm(dev):
    """rows of n: x / sqrt(mean(x^2) + eps) * w within 2e-6 relative; in place (y = x) the same."""
    rng = np.random.default_rng(5)
    n, rows, eps = 576, 7, 1e-5
    x = (rng.standard_normal((rows, n)) * rng.uniform(0.01, 50, (rows, 1))).astype(np.float32)
    w = rng.uniform(-2, 2, n).astype(np.float32)
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt((x64**2).mean(axis=1, keepdims=True) + eps) * w
    xv, wv = dev.put(x, pad=8), dev.put(w, pad=4)
    y = dev.empty(x.nbytes)
    dev.check(dev.be.rmsnorm(dev.d, y, xv, wv, n, rows, eps))
    got = dev.get(y, (rows, n))
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-7 * np.abs(want).max())
    dev.check(dev.be.rmsnorm(dev.d, xv, xv, wv, n, rows, eps))
    np.testing.assert_array_equal(dev.get(xv, (rows, n)), got)


def rope_angles(pos: np.ndarray, base: float, freq_scale: float, n_rot: int) -> np.ndarray:
    """blocks.c rope_table's angles: theta stepped by repeated float32 multiplication."""
    theta_scale = np.float32(base) ** np.float32(-2.0 / n_rot)
    theta = pos.astype(np.float32)
    out = []
    for _ in range(n_rot // 2):
        out.append(theta * np.float32(freq_scale))
        theta = theta * theta_scale
    return np.stack(out, axis=1).astype(np.float64)  # [n_tok][n_rot/2]


@pytest.mark.parametrize("mode", [ROPE_NORM, ROPE_NEOX], ids=["norm", "neox"])
def test_rope(dev, mode):
    """Rotation of the first n_rot dims of each head by the CPU's angles, within 1e-5 of the row's
    largest value (cos and sin on the device: a few ulp), the other dims untouched."""
    rng = np.random.default_rng(6)
    n_tok, n_head, hd, n_rot, pos0, base, fs = 5, 3, 64, 48, 1000, 10000.0, 0.5
    x = rng.standard_normal((n_tok, n_head, hd)).astype(np.float32)
    a = rope_angles(pos0 + np.arange(n_tok), base, fs, n_rot)[:, None, :]
    half = n_rot // 2
    i0 = np.arange(half) * 2 if mode == ROPE_NORM else np.arange(half)
    i1 = i0 + 1 if mode == ROPE_NORM else i0 + half
    want = x.astype(np.float64)
    x0, x1 = want[..., i0].copy(), want[..., i1].copy()
    want[..., i0] = x0 * np.cos(a) - x1 * np.sin(a)
    want[..., i1] = x0 * np.sin(a) + x1 * np.cos(a)
    xv = dev.put(x, pad=12)
    dev.check(dev.be.rope(dev.d, xv, n_tok, n_head, hd, n_rot, mode, pos0, base, fs))
    got = dev.get(xv, x.shape)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(x).max())
    np.testing.assert_array_equal(got[..., n_rot:], x[..., n_rot:])


@pytest.mark.parametrize("act", [SILU, GELU_TANH], ids=["silu", "gelu_tanh"])
def test_ffn_act(dev, act):
    """g = act(g) * u within 1e-5 relative (+1e-7 absolute) of float64."""
    rng = np.random.default_rng(7)
    n = 3001
    g = np.concatenate([rng.uniform(-12, 12, n - 5), [0, -100, 100, 1e-8, -1e-8]]).astype(np.float32)
    u = rng.standard_normal(n).astype(np.float32)
    g64 = g.astype(np.float64)
    if act == SILU:
        a = g64 / (1 + np.exp(-g64))
    else:
        a = 0.5 * g64 * (1 + np.tanh(np.sqrt(2 / np.pi) * (g64 + 0.044715 * g64**3)))
    want = a * u
    gv, uv = dev.put(g, pad=4), dev.put(u)
    dev.check(dev.be.ffn_act(dev.d, gv, uv, n, act))
    np.testing.assert_allclose(dev.get(gv, n), want, rtol=1e-5, atol=1e-7)


def test_add(dev):
    rng = np.random.default_rng(8)
    x, y = rng.standard_normal((2, 1000)).astype(np.float32)
    xv, yv = dev.put(x, pad=4), dev.put(y, pad=8)
    dev.check(dev.be.add(dev.d, xv, yv, 1000))
    np.testing.assert_array_equal(dev.get(xv, 1000), x + y)


# ------------------------------------------------------------------ attention


def attention_ref(q, K, V, pos0: int, window: int, scale: float) -> np.ndarray:
    """q [n_tok][n_head][hd]; K, V [n_pos][n_kv][hd] (every position so far): float64 softmax."""
    n_tok, n_head, hd = q.shape
    group = n_head // K.shape[1]
    out = np.zeros(q.shape)
    for t in range(n_tok):
        p = pos0 + t
        lo = max(0, p - window + 1) if window > 0 else 0
        for h in range(n_head):
            s = K[lo : p + 1, h // group].astype(np.float64) @ q[t, h].astype(np.float64) * scale
            e = np.exp(s - s.max())
            out[t, h] = e @ V[lo : p + 1, h // group] / e.sum()
    return out


@pytest.mark.parametrize("window", [0, 3], ids=["full", "window3"])
@pytest.mark.parametrize("hd", [64, 80], ids=["hd64", "hd80"])
def test_attention(dev, window, hd):
    """Grouped heads (4 query heads over 2 kv heads), the cache kept across calls (5 tokens, then 4),
    within 2e-5 of float64; then the same 9 tokens in one call give the last 4 rows bit for bit."""
    rng = np.random.default_rng(9)
    n_ctx, n_head, n_kv, n = 16, 4, 2, 9
    scale = 1 / np.sqrt(hd)
    q = rng.standard_normal((n, n_head, hd)).astype(np.float32)
    k = rng.standard_normal((n, n_kv, hd)).astype(np.float32)
    v = rng.standard_normal((n, n_kv, hd)).astype(np.float32)
    kvb = dev.be.kv_bytes(n_ctx, n_kv, hd)
    assert kvb >= n_ctx * n_kv * hd * 4

    def run(splits) -> np.ndarray:
        kc, vc = dev.empty(kvb), dev.empty(kvb)
        qv, kv, vv = dev.put(q, pad=4), dev.put(k, pad=8), dev.put(v)
        out = dev.empty(q.nbytes + 4, 4)
        t0 = 0
        for nt in splits:
            rq, rk = 4 * n_head * hd * t0, 4 * n_kv * hd * t0
            dev.check(
                dev.be.attention(
                    dev.d,
                    at(qv, rq),
                    at(kv, rk),
                    at(vv, rk),
                    kc,
                    vc,
                    n_ctx,
                    nt,
                    t0,
                    n_head,
                    n_kv,
                    hd,
                    window,
                    scale,
                    at(out, rq),
                )
            )
            t0 += nt
        return dev.get(out, q.shape)

    split = run([5, 4])
    want = attention_ref(q, k, v, 0, window, scale)
    np.testing.assert_allclose(split, want, rtol=0, atol=2e-5)
    whole = run([9])
    np.testing.assert_array_equal(whole[5:], split[5:])


def test_attention_refuses_positions_past_the_cache(be, dev):
    kvb = be.kv_bytes(8, 1, 64)
    kc, vc, q = dev.empty(kvb), dev.empty(kvb), dev.empty(4 * 64 * 4)
    assert be.attention(dev.d, q, q, q, kc, vc, 8, 4, 6, 1, 1, 64, 0, 0.125, q) == ERR_INVALID
    assert "bad arguments" in err(be)
