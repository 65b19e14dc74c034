"""ctypes bindings of the reference engine's C core (csrc/engine.h): contexts, decoding, sampling.

    >>> from stdengine.reference.model import Model
    >>> from stdengine.reference.core import Context, SamplingParams
    >>> model = Model.load("SmolLM2-135M-Instruct.Q4_1.gguf")
    >>> ctx = Context(model, n_ctx=2048, n_threads=2)
    >>> logits = ctx.decode([1, 504, 3458])          # the last token's logits, shape (n_vocab,)
    >>> tok = ctx.sample(SamplingParams(temp=0))      # greedy
    >>> ctx.decode([tok]); ctx.n_past
    4

Each decode and each sample is one ctypes call with precomputed integer addresses: the whole
forward pass (all layers, the thread pool, the KV cache) and the sampler run in C.
A Context is not thread-safe: use one per thread (they may share a Model).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any

import numpy as np
from stdengine.reference._lib import lib

from stdengine.adapter import SamplingParams
from stdengine.errors import ConfigError, ContextOverflow, EngineFailure, InvalidRequest, UnsupportedOption
from stdengine.gguf_file import GGML_TYPES

if TYPE_CHECKING:
    from stdengine.reference.model import Model

# engine.h's enums and structs, mirrored here: tests/test_c_mirrors.py compiles a C program against
# the headers and checks every value, field offset and size below (each struct names its C type
# in _c_struct_).
OK, ERR_CONTEXT_OVERFLOW, ERR_BAD_TOKEN, ERR_INVALID, ERR_NOMEM, ERR_MISSING = 0, -1, -2, -3, -4, -5
ERR_DEVICE = -6
MAX_CTX, MAX_THREADS = 1 << 22, 255  # se_context_new's limits (llama.c, threadpool.c)
ROPE_NORM, ROPE_NEOX = 0, 2
SLOTS = {
    name: i
    for i, name in enumerate(
        [
            "TOKEN_EMBD",
            "OUTPUT_NORM",
            "OUTPUT",
            "ATTN_NORM",
            "ATTN_Q",
            "ATTN_K",
            "ATTN_V",
            "ATTN_OUTPUT",
            "ATTN_Q_NORM",
            "ATTN_K_NORM",
            "ATTN_POST_NORM",
            "FFN_NORM",
            "FFN_GATE",
            "FFN_UP",
            "FFN_DOWN",
            "FFN_POST_NORM",
        ]
    )
}

_i32, _i64, _f32, _vp = ctypes.c_int32, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


@dataclass(frozen=True)
class HParams:
    """The model's shape, as the C core sees it (se_hparams)."""

    arch: int
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_rot: int
    rope_type: int
    norm_eps: float
    rope_base: float
    rope_freq_scale: float
    attn_scale: float
    embd_scale: float


class _HParams(ctypes.Structure):
    _c_struct_ = "se_hparams"
    _fields_ = [
        (n, _i32)
        for n in (
            "arch",
            "n_vocab",
            "n_embd",
            "n_layer",
            "n_head",
            "n_head_kv",
            "head_dim",
            "n_ff",
            "n_rot",
            "rope_type",
        )
    ] + [(n, _f32) for n in ("norm_eps", "rope_base", "rope_freq_scale", "attn_scale", "embd_scale")]


class _ContextParams(ctypes.Structure):
    _c_struct_ = "se_context_params"
    _fields_ = [
        ("n_ctx", _i32),
        ("n_batch", _i32),
        ("n_ubatch", _i32),
        ("n_threads", _i32),
        ("n_threads_batch", _i32),
        ("type_k", _i32),
        ("type_v", _i32),
    ]


# The KV cache's element types the C core keeps (ggml's type ids), by the options' names.
CACHE_TYPES = {"f32": 0, "f16": 1}


class _SamplingParams(ctypes.Structure):
    _c_struct_ = "se_sampling_params"
    _fields_ = [
        ("temp", _f32),
        ("top_k", _i32),
        ("top_p", _f32),
        ("min_p", _f32),
        ("repeat_penalty", _f32),
        ("repeat_last_n", _i32),
        ("presence_penalty", _f32),
        ("frequency_penalty", _f32),
        ("seed", _i64),
    ]


# The C struct's fields, read by name from any object that has them (stdengine.adapter.SamplingParams).
_SAMPLING_FIELDS = tuple(field[0] for field in _SamplingParams._fields_)
QUICK_TOP_K = 128  # a sampler with top_k up to this picks from computed logits in microseconds


@cache
def api() -> ctypes.CDLL:
    """The C library with the engine's signatures declared."""
    c = lib()
    sig = {
        "se_version": ([], ctypes.c_char_p),
        "se_arch_count": ([], _i32),
        "se_arch_name": ([_i32], ctypes.c_char_p),
        "se_arch_layer_slot": ([_i32, _i32], ctypes.c_int),
        "se_model_new": ([_vp], _vp),
        "se_model_set_tensor": ([_vp, _i32, _i32, _vp, _i32, _i64, _i64], ctypes.c_int),
        "se_model_set_layer": ([_vp, _i32, _f32, _i32], ctypes.c_int),
        "se_model_finalize": ([_vp, _vp, _vp], ctypes.c_int),
        "se_model_set_file_mapped": ([_vp, ctypes.c_int32], ctypes.c_int),
        "se_model_set_batch_panels": ([_vp, ctypes.c_int32], ctypes.c_int),
        "se_model_panels_bytes": ([_vp], ctypes.c_size_t),
        "se_model_free": ([_vp], None),
        "se_context_new": ([_vp, _vp], _vp),
        "se_context_free": ([_vp], None),
        "se_context_logits": ([_vp], _vp),
        "se_context_n_past": ([_vp], _i32),
        "se_context_tokens": ([_vp], _vp),
        "se_context_reset": ([_vp], None),
        "se_context_truncate": ([_vp, _i32], ctypes.c_int),
        "se_decode": ([_vp, _vp, _i32, _vp], ctypes.c_int),
        "se_decode_batch": ([_vp, _i32, _vp, _vp], ctypes.c_int),
        "se_sample": ([_vp, _vp], _i32),
        "se_context_set_lazy_head": ([_vp, _i32], ctypes.c_int),
        "se_context_set_banned": ([_vp, _vp, _i32], ctypes.c_int),
        "se_context_head": ([_vp], ctypes.c_int),
        "se_context_head_pending": ([_vp], ctypes.c_int),
        "se_context_screen_stats": ([_vp, _vp], None),
        "se_context_plan_sample": ([_vp, _vp], ctypes.c_int),
        "se_set_share_rows_skew": ([ctypes.c_int], ctypes.c_int),
        "se_rows_taken_from_others": ([], _i64),
        "se_model_screen_bytes": ([_vp], ctypes.c_size_t),
        "se_context_screen": ([_vp, _i32, _vp, _vp, _i32], _i32),
        "se_context_screen_bounds": ([_vp, _i32], _vp),
        "se_screen_bounds_test": ([_vp, _i64, _i64, _vp, _i32, _vp, _vp], ctypes.c_int),
        "se_screen_rows_test": ([_vp, _i64, _i64, _vp], ctypes.c_int),
        "se_screen_head_test": ([_vp, _i64, _i64, _vp, _vp], ctypes.c_int),
        "se_screen_planes_test": ([_vp, _i64, _i64, _i32, _vp, _i64], ctypes.c_int64),
        "se_context_head_from_planes": ([_vp], ctypes.c_int),
        "se_traits": ([ctypes.c_int], _vp),
        "se_row_size": ([ctypes.c_int, _i64], ctypes.c_size_t),
        "se_isa_name": ([], ctypes.c_char_p),
        "se_device_count": ([], _i32),
        "se_device_backend": ([_i32], ctypes.c_char_p),
        "se_device_describe": (
            [_i32, ctypes.c_char_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_uint64)],
            ctypes.c_int,
        ),
        "se_backend_error": ([], ctypes.c_char_p),
        "se_model_offload": ([_vp, _i32, _i32], ctypes.c_int),
        "se_model_gpu_layers": ([_vp, ctypes.POINTER(_i32)], _i32),
    }
    for name, (args, res) in sig.items():
        f = getattr(c, name)
        f.argtypes, f.restype = args, res
    return c


@cache
def api_holding_gil() -> ctypes.PyDLL:
    """The same library through ctypes.PyDLL, whose calls keep the GIL: for calls of a few
    microseconds on the serving path. Releasing the GIL and taking it back costs more than such
    a call, and on a busy 2-core server the taking back waits behind the other threads' Python."""
    c = api()
    held = ctypes.PyDLL(c._name, handle=c._handle)
    for name in ("se_sample", "se_context_head_pending"):
        f = getattr(held, name)
        f.argtypes, f.restype = getattr(c, name).argtypes, getattr(c, name).restype
    return held


class Traits(ctypes.Structure):
    """kernels.h se_type_traits, read-only through se_traits (the C table may have more fields after these)."""

    _c_struct_ = "se_type_traits"
    _fields_ = [
        ("name", ctypes.c_char_p),
        ("blck", ctypes.c_int),
        ("size", ctypes.c_int),
        ("act_type", ctypes.c_int),
        ("to_float", _vp),
        ("from_float", _vp),
        ("dot", _vp),
    ]


def type_traits(type_id: int) -> Traits | None:
    """The C trait table's row for a ggml type id; None for a type the kernels do not know."""
    p = api().se_traits(type_id)
    return Traits.from_address(p) if p else None


def type_supported(type_id: int) -> bool:
    """The kernels know this ggml type (can at least dequantize it)."""
    t = type_traits(type_id)
    return t is not None and bool(t.to_float)


def type_has_matmul(type_id: int) -> bool:
    """The kernels can multiply by a weight of this type."""
    t = type_traits(type_id)
    if t is None or not t.dot:
        return False
    a = type_traits(t.act_type)
    return a is not None and bool(a.from_float)


def supported_types() -> list[str]:
    return [t.name.decode() for i in GGML_TYPES if (t := type_traits(i)) is not None and t.dot]


def row_size(type_id: int, n: int) -> int:
    return int(api().se_row_size(type_id, n))


@cache
def architectures() -> dict[str, int]:
    """The C core's architecture table (model.c): general.architecture name -> se_arch id."""
    c = api()
    return {c.se_arch_name(i).decode(): i for i in range(1, c.se_arch_count() + 1)}


def arch_layer_slots(arch: str) -> frozenset[str]:
    """The tensor slots every layer of the architecture needs (those its forward pass reads)."""
    arch_id = architectures()[arch]
    return frozenset(name for name, slot in SLOTS.items() if api().se_arch_layer_slot(arch_id, slot) == 1)


def hparams_struct(hp: HParams) -> _HParams:
    return _HParams(**{f[0]: getattr(hp, f[0]) for f in _HParams._fields_})


def isa_name() -> str:
    """The kernels' SIMD path in use: scalar, avx2, avx512 or amx."""
    return api().se_isa_name().decode()


ISAS = ("scalar", "avx2", "avx512", "amx")  # the kernels' SIMD paths, slowest first (kernels.c)


def set_share_rows_skew(on: bool) -> bool:
    """Test hook: with on, batched passes give every matmul step's rows to the last thread first,
    so that the others compute only rows they take from it (se_set_share_rows_skew); returns the
    previous setting. Call it between passes."""
    return bool(api().se_set_share_rows_skew(int(on)))


def rows_taken_from_others() -> int:
    """The matmul rows threads have taken from another thread's share, in this process so far."""
    return int(api().se_rows_taken_from_others())


def check_isa_env(env: Mapping[str, str] | None = None) -> None:
    """INFER_REF_ISA, when set, must name a path this CPU can run: the C core alone would fall back
    to the best path, silently; the engine refuses instead (ConfigError, before any model loads)."""
    env = os.environ if env is None else env
    want = env.get("INFER_REF_ISA", "")
    if not want:
        return
    if want not in ISAS:
        raise ConfigError(
            f"INFER_REF_ISA={want!r} is not a SIMD path of the reference engine",
            hint="set INFER_REF_ISA to scalar|avx2|avx512|amx (a path this CPU can run), or unset it for the best one",
            key="INFER_REF_ISA",
        )
    # the C core read the same variable at start-up: it runs the wanted path or, when this CPU
    # cannot, falls back to a lower one (the best here)
    have = isa_name()
    if ISAS.index(have) < ISAS.index(want):
        runnable = ISAS[: ISAS.index(have) + 1]
        raise ConfigError(
            f"INFER_REF_ISA={want} asks for a SIMD path this CPU cannot run",
            hint=f"this CPU runs {'|'.join(runnable)}: set INFER_REF_ISA to one of them, or unset it for the best one",
            key="INFER_REF_ISA",
        )


# -- devices (backend.h) ---------------------------------------------------------------------------

# The backends' names as users see them (llama-bench's `backends` field: "CUDA", "Vulkan", ...)
BACKEND_NAMES = {"opencl": "OpenCL", "host": "host"}


@dataclass(frozen=True)
class Device:
    """A device the C core can offload layers to: its index (across every backend, the order of
    backend.h's table), backend, "platform / device" name and memory in bytes."""

    index: int
    backend: str
    name: str
    memory: int

    def __str__(self) -> str:
        mem = f", {self.memory / 2**30:.1f} GiB" if self.memory else ""
        return f"{self.index}: {BACKEND_NAMES.get(self.backend, self.backend)} {self.name}{mem}"


def backend_error() -> str:
    """What the C core's last failed device call on this thread said ("" when none did)."""
    return (api().se_backend_error() or b"").decode("utf-8", errors="replace")


def devices() -> tuple[Device, ...]:
    """The devices of this machine (the OpenCL runtime is loaded at the first call, and its answer
    kept by the C core). Empty when there is no OpenCL library or no device: devices_missing()
    then says why."""
    c = api()
    found = []
    name = ctypes.create_string_buffer(512)
    mem = ctypes.c_uint64(0)
    for i in range(c.se_device_count()):
        if c.se_device_describe(i, name, len(name), ctypes.byref(mem)) != OK:
            continue
        backend = (c.se_device_backend(i) or b"?").decode()
        found.append(Device(i, backend, name.value.decode("utf-8", errors="replace"), int(mem.value)))
    return tuple(found)


def devices_missing() -> str:
    """Why devices() is empty, in the C core's words (no OpenCL library, no device)."""
    return backend_error() if api().se_device_count() == 0 else ""


def choose_device(spec: str | None) -> Device:
    """The device --device / INFER_DEVICE names: an index, or a substring of its name
    (case-insensitive; the first that matches); None = the first device. Raises UnsupportedOption
    when there is no device at all or none matches."""
    found = devices()
    if not found:
        raise UnsupportedOption(
            f"engine 'reference' cannot honour n_gpu_layers here: no OpenCL device ({devices_missing()})",
            hint="install an OpenCL driver (a GPU vendor's, or Debian's pocl-opencl-icd on a CPU) "
            "and ocl-icd-libopencl1, or drop -ngl (or pass -ngl 0)",
            options=["n_gpu_layers"],
        )
    if spec is None or spec == "":
        return found[0]
    if spec.isdigit():
        if int(spec) < len(found):
            return found[int(spec)]
    else:
        for d in found:
            if spec.lower() in f"{d.backend} {d.name}".lower():
                return d
    raise UnsupportedOption(
        f"no device matches --device {spec!r}",
        hint="name one of these by index or by a part of its name: " + "; ".join(str(d) for d in found),
        options=["device"],
    )


class Context:
    """An inference context: KV cache, scratch buffers and a thread pool, allocated once.

    Context(model, n_ctx=2048, n_threads=None, n_threads_batch=None, n_batch=2048, n_ubatch=512,
            cache_type_k="f32", cache_type_v="f32", screen_head=False)
      n_threads: threads for single-token decodes (default: the CPU count);
      n_threads_batch: threads for batches (default: n_threads);
      n_batch / n_ubatch: a decode is split into batches of n_batch tokens, each evaluated in
      forward passes of n_ubatch tokens (n_ubatch <= n_batch; clamped to n_ctx);
      cache_type_k / cache_type_v: the KV cache's keys and values, "f32" (exact) or "f16" (half
      the memory: each value rounded to nearest even when stored; CACHE_TYPES);
      screen_head: evaluate() leaves the output head to sample(), which then computes only the
      rows its sampler can choose where it needs just the top k (greedy, top-k): the same token,
      fewer bytes read (spec/reference-engine.md, "Screening the output head").

    decode(tokens, all_logits=False) -> np.ndarray   float32 logits: (n_vocab,) of the last token,
        or (len(tokens), n_vocab) with all_logits. The (n_vocab,) array is a read-only view of the
        context's buffer, overwritten by the next decode: copy it to keep it.
    evaluate(tokens)   the same without returning logits: with screen_head the head waits for
        sample() (or for `logits`, which runs the full head).
    sample(params=None) -> int   the next token from the last logits (SamplingParams or any object
        with its attributes; None = greedy).
    n_past   tokens in the KV cache;  tokens   those tokens (a copy);  logits   last logits (view)
    reset()   forget everything;  truncate(n)   keep the first n cached tokens;  close().

    A decode that does not fit (n_past + len(tokens) > n_ctx) raises ContextOverflow and changes
    nothing; a token id outside the vocabulary raises InvalidRequest.
    """

    def __init__(
        self,
        model: Model,
        n_ctx: int = 2048,
        n_threads: int | None = None,
        n_threads_batch: int | None = None,
        n_batch: int = 2048,
        n_ubatch: int = 512,
        cache_type_k: str = "f32",
        cache_type_v: str = "f32",
        screen_head: bool = False,
    ) -> None:
        self._h: int | None = None
        n_threads = n_threads or os.cpu_count() or 1
        n_threads_batch = n_threads_batch or n_threads
        if n_ctx < 1 or n_batch < 1 or n_ubatch < 1 or n_threads < 1 or n_threads_batch < 1:
            raise InvalidRequest(
                f"context sizes must be positive (n_ctx={n_ctx}, n_batch={n_batch}, "
                f"n_ubatch={n_ubatch}, threads={n_threads}/{n_threads_batch})"
            )
        for option, value, limit, how in (
            ("ctx_size", n_ctx, MAX_CTX, "-c; 0 takes the model's training length"),
            ("threads", max(n_threads, n_threads_batch), MAX_THREADS, "-t"),
        ):
            if value > limit:  # the C core would refuse or clamp it; an int32 would truncate it
                raise UnsupportedOption(
                    f"engine 'reference' cannot honour {option}={value}: at most {limit}",
                    hint=f"use a smaller {option} ({how})",
                    options=[option],
                )
        for option, kind in (("cache_type_k", cache_type_k), ("cache_type_v", cache_type_v)):
            if kind not in CACHE_TYPES:
                raise UnsupportedOption(
                    f"engine 'reference' cannot honour {option}={kind}: its KV cache is f32 or f16",
                    hint=f"use {' or '.join(CACHE_TYPES)} (-ctk, -ctv)",
                    options=[option],
                )
        n_ubatch = min(n_ubatch, n_batch, n_ctx)
        self.model = model
        self.n_ctx, self.n_batch, self.n_ubatch = n_ctx, n_batch, n_ubatch
        self.n_threads, self.n_threads_batch = n_threads, n_threads_batch
        self.cache_type_k, self.cache_type_v = cache_type_k, cache_type_v
        self.n_vocab = model.n_vocab
        c = api()
        params = _ContextParams(
            n_ctx,
            n_batch,
            n_ubatch,
            n_threads,
            n_threads_batch,
            CACHE_TYPES[cache_type_k],
            CACHE_TYPES[cache_type_v],
        )
        h = c.se_context_new(model.handle, ctypes.byref(params))
        if not h and model.gpu_layers:
            raise EngineFailure(
                f"cannot create a context of {n_ctx} positions on the device: {backend_error()}",
                hint="use a smaller ctx_size (-c) or ubatch_size (-ub), or offload fewer layers (-ngl)",
            )
        if not h:
            raise EngineFailure(
                f"cannot create a context of {n_ctx} positions for {model.path} (out of memory?)",
                hint="use a smaller ctx_size",
            )
        self._h = h
        model._contexts.add(self)
        self.screen_head = screen_head
        c.se_context_set_lazy_head(h, int(screen_head))
        # Everything a hot call needs, bound once: functions, the handle, buffer addresses.
        self._decode_fn = c.se_decode
        # A quick sample (a top k of computed logits) keeps the GIL (api_holding_gil); one that
        # computes head rows (a pending head) or reads every logit lets other threads run meanwhile.
        self._sample_fn = c.se_sample
        self._sample_held_fn = api_holding_gil().se_sample
        self._pending_fn = api_holding_gil().se_context_head_pending
        self._n_past_fn = c.se_context_n_past
        self._head_fn = c.se_context_head
        self._tok = np.zeros(n_ctx, dtype=np.int32)
        self._tok_addr = self._tok.ctypes.data
        buf = (ctypes.c_float * self.n_vocab).from_address(c.se_context_logits(h))
        self._logits = np.ctypeslib.as_array(buf)
        self._logits_view = self._logits.view()
        self._logits_view.flags.writeable = False
        self._sp = _SamplingParams()
        self._sp_addr = ctypes.addressof(self._sp)
        self._sp_key: tuple[Any, ...] | None = None
        self._sp_quick = False
        self._banned = b""  # the banned tokens the C core holds (ban)

    # -- decoding ----------------------------------------------------------------------------

    def decode(self, tokens: Any, all_logits: bool = False) -> np.ndarray:
        """Evaluate tokens (a sequence of ints or an int32 array) after the cached ones."""
        out = self._decode(tokens, all_logits)
        if not all_logits:
            self._head_fn(self._h)
        return out

    def evaluate(self, tokens: Any) -> None:
        """decode() without the logits: with screen_head, the head waits for sample()."""
        self._decode(tokens, False)

    def _decode(self, tokens: Any, all_logits: bool) -> np.ndarray:
        h = self._h
        if not h:
            raise EngineFailure("the context is closed")
        n = len(tokens)
        if n == 0:
            raise InvalidRequest("decode needs at least one token")
        if n > self.n_ctx:
            raise ContextOverflow(
                f"{n} tokens do not fit a context of {self.n_ctx}",
                hint="use a larger ctx_size (-c)",
                n_ctx=self.n_ctx,
                n_tokens=n,
            )
        _store_tokens(self._tok[:n], tokens, self.n_vocab)
        if all_logits:
            out = np.empty((n, self.n_vocab), dtype=np.float32)
            rc = self._decode_fn(h, self._tok_addr, n, out.ctypes.data)
        else:
            out = self._logits_view
            rc = self._decode_fn(h, self._tok_addr, n, None)
        if rc != OK:
            self._raise(rc, n)
        return out

    def _raise(self, rc: int, n: int, tokens: Any = None) -> None:
        """The error of se_decode's code rc for n tokens (the ones in self._tok, or tokens)."""
        if rc == ERR_CONTEXT_OVERFLOW:
            n_past = self.n_past
            raise ContextOverflow(
                f"{n} more tokens do not fit the context: {n_past} cached + {n} > n_ctx {self.n_ctx}",
                hint="use a larger ctx_size (-c) or a shorter prompt",
                n_ctx=self.n_ctx,
                n_past=n_past,
                n_tokens=n,
            )
        if rc == ERR_BAD_TOKEN:
            bad = [
                int(t) for t in (self._tok[:n] if tokens is None else tokens) if not 0 <= t < self.n_vocab
            ][:5]
            raise InvalidRequest(f"token ids {bad} are outside the vocabulary [0, {self.n_vocab})")
        if rc == ERR_DEVICE:
            raise EngineFailure(f"the device failed: {backend_error()}", hint="try -ngl 0 (the CPU)")
        raise EngineFailure(f"the reference engine failed (code {rc})")

    # -- sampling ----------------------------------------------------------------------------

    def sample(self, params: Any = None) -> int:
        """The next token id from the last decode's logits: penalties, top-k, top-p, min-p,
        temperature, then a seeded draw (llama.cpp's order). params=None is greedy. The RNG is
        seeded from params.seed on the first sample after a reset or when the seed changes."""
        h = self._h
        if not h:
            raise EngineFailure("the context is closed")
        sp = self._sampling(_GREEDY if params is None else params)
        sample = self._sample_held_fn if self._sp_quick and not self._pending_fn(h) else self._sample_fn
        tok = sample(h, sp)
        if tok < 0:
            raise InvalidRequest("nothing to sample from: decode a prompt first")
        return tok

    def _sampling(self, params: Any) -> int:
        """The address of params as the C struct: one struct per context, its fields written only
        when they change (sample() is on the hot path)."""
        key = tuple(getattr(params, f) for f in _SAMPLING_FIELDS)
        if key != self._sp_key:
            for f, v in zip(_SAMPLING_FIELDS, key, strict=True):
                setattr(self._sp, f, v)
            self._sp_key = key
            # greedy, or a small top k: tens of microseconds on computed logits (Gemma-3's 262144
            # on the Xeon: 24 us greedy, 34 top-k 40; top-p over all of them, 3.2 ms)
            self._sp_quick = params.temp <= 0 or 0 < params.top_k <= QUICK_TOP_K
        return self._sp_addr

    def plan_sample(self, params: Any = None) -> None:
        """What the next sample() will need, for evaluate_batch and decode_batch: params, its
        sampling parameters (a screen_head context whose sampler a screen serves then has the
        screen's first stage done in the shared pass, its head left to sample()), or None: the
        logits will be read (the pass computes them). None at creation."""
        if not self._h:
            raise EngineFailure("the context is closed")
        api().se_context_plan_sample(self._h, None if params is None else self._sampling(params))

    def ban(self, ids: Any) -> None:
        """Tokens sample() must not pick from now on (None or empty: none); their logits count as
        -inf. Unlike a mask written into logits_buffer, it leaves the head screened."""
        if not self._h:
            raise EngineFailure("the context is closed")
        arr = np.zeros(0, np.int32) if ids is None else np.ascontiguousarray(ids, dtype=np.int32)
        key = arr.tobytes()
        if key == self._banned:
            return  # unchanged: nothing to tell the C core
        rc = api().se_context_set_banned(self._h, arr.ctypes.data, len(arr))
        if rc == ERR_BAD_TOKEN:
            raise InvalidRequest(f"banned token ids must be in [0, {self.n_vocab})")
        if rc != OK:
            raise EngineFailure(f"the reference engine failed (code {rc})")
        self._banned = key

    # -- state -------------------------------------------------------------------------------

    @property
    def n_past(self) -> int:
        """How many tokens are in the KV cache."""
        return int(self._n_past_fn(self._h)) if self._h else 0

    @property
    def tokens(self) -> list[int]:
        """The tokens in the KV cache, in order."""
        n = self.n_past
        if n == 0:
            return []
        p = api().se_context_tokens(self._h)
        return list((ctypes.c_int32 * n).from_address(p))

    @property
    def logits(self) -> np.ndarray:
        """The last decoded token's logits (read-only view, overwritten by the next decode)."""
        if self._h:
            self._head_fn(self._h)  # the full head, if it was left to the sampler
        return self._logits_view

    @property
    def logits_buffer(self) -> np.ndarray:
        """The same logits, writable: sample() reads this buffer, so a token mask written into it
        (stdengine.structured) applies to the next sample."""
        if self._h:
            self._head_fn(self._h)
        return self._logits

    @property
    def screen_stats(self) -> tuple[int, ...]:
        """(screened samples, rows they computed exactly, samples whose bounds were not numbers,
        rows their stage 2 narrowed, screened samples whose stage 1 a batched pass did, screened
        samples that took min-p's route, samples on that route that ran the full head after all)"""
        out = (ctypes.c_int64 * 7)()
        if self._h:
            api().se_context_screen_stats(self._h, out)
        return tuple(out)

    def reset(self) -> None:
        """Empties the KV cache (and re-arms the seed for the next sample)."""
        if self._h:
            api().se_context_reset(self._h)

    def truncate(self, n_past: int) -> None:
        """Keeps only the first n_past cached tokens (to reuse a common prefix)."""
        if not self._h or api().se_context_truncate(self._h, n_past) != OK:
            raise InvalidRequest(f"cannot truncate to {n_past}: the cache holds {self.n_past} tokens")

    def close(self) -> None:
        """Frees the KV cache, buffers and threads. Safe to call twice."""
        if self._h:
            api().se_context_free(self._h)
            self._h = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __enter__(self) -> Context:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _store_tokens(dst: np.ndarray, tokens: Any, n_vocab: int) -> None:
    """Copies token ids into an int32 buffer, refusing what would wrap silently (InvalidRequest)."""
    if (
        isinstance(tokens, np.ndarray)
        and tokens.dtype != np.int32
        and len(tokens)
        and (tokens.dtype.kind not in "iu" or tokens.min() < 0 or tokens.max() >= n_vocab)
    ):
        raise InvalidRequest(f"token ids must be integers in [0, {n_vocab})")  # no silent wrap
    try:
        dst[:] = tokens
    except (OverflowError, ValueError, TypeError) as e:
        raise InvalidRequest(f"tokens must be integer ids: {e}") from None


def decode_batch(contexts: Sequence[Context], token_lists: Sequence[Any]) -> list[np.ndarray]:
    """evaluate_batch, then each context's last-token logits (its read-only `logits` view); each
    is bit-identical to what contexts[i].decode(token_lists[i]) alone would give."""
    evaluate_batch(contexts, token_lists)
    return [ctx.logits for ctx in contexts]


def evaluate_batch(contexts: Sequence[Context], token_lists: Sequence[Any]) -> None:
    """Evaluates token_lists[i] after the cached tokens of contexts[i], for every i, in shared
    forward passes (se_decode_batch: the weights are read once per pass, contexts[0]'s thread pool
    and scratch do the work). The contexts must be distinct and of one Model. On an error (ContextOverflow naming the
    context that does not fit, InvalidRequest) no context has changed."""
    n_seq = len(contexts)
    if n_seq == 0 or n_seq != len(token_lists):
        raise InvalidRequest(
            f"decode_batch needs one token list per context ({n_seq} contexts, {len(token_lists)} lists)"
        )
    model = contexts[0].model
    for i, ctx in enumerate(contexts):
        if not ctx._h:
            raise EngineFailure(f"context {i} of the batch is closed")
        if ctx.model is not model:
            raise InvalidRequest(
                f"context {i} of the batch is on another model: a batch shares one model's weights"
            )
        if len(token_lists[i]) == 0:
            raise InvalidRequest(f"context {i} of the batch has no tokens: each needs at least one")
    if len({id(ctx) for ctx in contexts}) != n_seq:
        raise InvalidRequest("a context appears twice in the batch: its tokens must be one list")
    counts = np.array([len(t) for t in token_lists], dtype=np.int32)
    flat = np.empty(int(counts.sum()), dtype=np.int32)
    at = 0
    for toks, n in zip(token_lists, counts, strict=True):
        _store_tokens(flat[at : at + n], toks, model.n_vocab)
        at += n
    handles = (ctypes.c_void_p * n_seq)(*(ctx._h for ctx in contexts))
    rc = api().se_decode_batch(handles, n_seq, flat.ctypes.data, counts.ctypes.data)
    if rc != OK:
        at = 0
        for ctx, n in zip(contexts, counts, strict=True):  # the context the error is about
            toks, at = flat[at : at + n], at + n
            if (
                rc == ERR_CONTEXT_OVERFLOW
                and ctx.n_past + n > ctx.n_ctx
                or rc == ERR_BAD_TOKEN
                and (toks.min() < 0 or toks.max() >= ctx.n_vocab)
            ):
                ctx._raise(rc, int(n), toks)
        if rc == ERR_DEVICE:
            contexts[0]._raise(rc, 0)
        raise EngineFailure(f"the reference engine failed (code {rc})")


_GREEDY = SamplingParams(temp=0.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0, seed=0)
