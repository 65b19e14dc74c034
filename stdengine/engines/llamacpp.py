"""The `llamacpp` engine: llama.cpp in-process, through llama-cpp-python's low-level API.

We drive llama.cpp's C API (llama_decode, llama_tokenize, the llama_sampler chain) rather than
llama_cpp.Llama, so that decode() can ask for the logits of exactly the tokens it needs, the KV
cache holds exactly what self.tokens says, and sampling is llama.cpp's own sampler chain in
llama.cpp's order. Chat templates are rendered by the core (render_chat_template) from the GGUF's
`tokenizer.chat_template`, and stop strings by the core's StopMatcher, so both behave exactly as
in every other engine.
"""

from __future__ import annotations

import ctypes
import importlib
from collections import deque
from collections.abc import Generator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from stdengine.adapter import EngineInfo, SamplingParams, check_engine_args, check_token_ids, now_ms
from stdengine.errors import BadModelFile, EngineFailure, InvalidRequest, UnsupportedOption
from stdengine.generation import Utf8Stream, choose_chat_template, template_level
from stdengine.gguf_file import ggml_type
from stdengine.local_engine import LocalEngine

if TYPE_CHECKING:
    from stdengine.events import Emitter
    from stdengine.options import Options
    from stdengine.structured import Vocabulary

INSTALL_HINT = "pip install 'stdengine[llamacpp]'"

LLAMA_TOKEN_NULL = -1
LOAD_MODE_NONE, LOAD_MODE_MMAP, LOAD_MODE_MLOCK, LOAD_MODE_MMAP_MLOCK = 0, 1, 2, 3
# Limits checked before llama.cpp is called, which does not refuse larger values. Threads:
# GGML_MAX_N_THREADS, 512 in the ggml.h that llama-cpp-python installs (include/ggml.h), sizes
# ggml's threadpool; more threads crash (SIGSEGV) or hang it. Tokens: n_ctx, n_batch and n_ubatch
# are uint32 fields that wrap silently (and llama.cpp rounds n_ctx up to a multiple of 256, which
# wraps again), while positions and batch lengths are int32 (llama.h: llama_pos, n_tokens).
MAX_THREADS, MAX_TOKENS = 512, 2**31 - 1


def _lib() -> Any:
    """llama_cpp, imported on first use (typed Any: its ctypes signatures are not worth mypy's time)."""
    return importlib.import_module("llama_cpp")


# llama.cpp logs through one process-wide callback. We keep its recent lines to explain a failed
# load, and print them only when asked (-v); the ctypes callback object must stay referenced.
_log_tail: deque[str] = deque(maxlen=40)
_log_echo = False
_log_callback: Any = None


def _install_log_callback(verbose: bool) -> None:
    global _log_echo, _log_callback
    _log_echo = verbose
    if _log_callback is not None:
        return
    lib = _lib()

    def on_log(level: int, text: bytes, user_data: Any) -> None:
        line = text.decode("utf-8", errors="replace")
        _log_tail.append(line)
        if _log_echo:
            import sys

            sys.stderr.write(line)

    _log_callback = lib.llama_log_callback(on_log)
    lib.llama_log_set(_log_callback, ctypes.c_void_p(0))


# The CPU features that decide whether a llama.cpp build runs on an x86 machine, in the order
# shown. llama.cpp's system info lists only the features a build has ("AVX512 = 1 | ..."); one it
# lacks is shown here as 0. A native build (pip's default) on an Intel Xeon with AMX has
# AMX_INT8=1; made with GCC 12 it dies with SIGILL in ggml's AMX matmul (the compiler drops the
# tile shapes: bench/amx_tilecfg.c), and it runs only where AMX exists; a build with AVX_VNNI=1
# cannot run on AMD Zen 4. README, "The llama.cpp extra on x86", says how to build either.
BUILD_FEATURES = ("AVX2", "AVX512", "AVX512_VNNI", "AVX_VNNI", "AMX_INT8")


def build_summary(system_info: str) -> str:
    """A short line from llama_print_system_info(): the backends, and the x86 features above
    as 0/1, e.g. "CPU AVX2=1 AVX512=1 AVX512_VNNI=1 AVX_VNNI=0 AMX_INT8=0"."""
    backends: list[str] = []
    features: set[str] = set()
    for section in system_info.split("|"):
        if ":" in section:  # "CPU : SSE3 = 1" opens the CPU backend's list
            backend, section = (part.strip() for part in section.split(":", 1))
            if backend and backend not in backends:
                backends.append(backend)
        name, sep, value = section.partition("=")
        if sep and value.strip() not in ("", "0"):
            features.add(name.strip())
    flags = " ".join(f"{f}={int(f in features)}" for f in BUILD_FEATURES)
    return " ".join([*backends, flags])


def _recent_errors() -> str:
    lines = [ln.strip() for ln in _log_tail if len(ln.strip()) > 1]  # not the progress dots
    return "; ".join(lines[-3:])


class LlamaCppEngine(LocalEngine):
    name = "llamacpp"
    description = "llama.cpp in-process through llama-cpp-python (GGUF; its CPU or GPU backends)"
    batch_invariant = False  # a row's logits depend on the batch's size (README, "Reproducible answers")
    capabilities = frozenset(
        {"stream", "logits", "tokenize", "chat_template", "seed", "batch", "logprobs", "structured"}
    )
    option_map = {
        "model": "llama_model_load_from_file(path)",
        "ctx_size": "n_ctx (0 = the model's n_ctx_train)",
        "threads": "n_threads (default: physical cores)",
        "threads_batch": "n_threads_batch (default: threads)",
        "batch_size": "n_batch",
        "ubatch_size": "n_ubatch (at most n_batch)",
        "n_gpu_layers": "n_gpu_layers (-1 = all); refused unless llama.cpp was built with a GPU backend",
        "cache_type_k": "type_k (ggml type id)",
        "cache_type_v": "type_v (ggml type id; quantized V needs flash_attn)",
        "flash_attn": "flash_attn_type (enabled/disabled)",
        "mmap": "load_mode MMAP (--no-mmap: read the file)",
        "mlock": "load_mode MLOCK",
        "seed": "llama_sampler_init_dist(seed) (-1 = LLAMA_DEFAULT_SEED, random)",
        "temp": "llama_sampler_init_temp (≤ 0: llama_sampler_init_greedy)",
        "top_k": "llama_sampler_init_top_k",
        "top_p": "llama_sampler_init_top_p",
        "min_p": "llama_sampler_init_min_p",
        "repeat_penalty": "llama_sampler_init_penalties penalty_repeat",
        "repeat_last_n": "llama_sampler_init_penalties penalty_last_n (-1 = n_ctx)",
        "presence_penalty": "llama_sampler_init_penalties penalty_present",
        "frequency_penalty": "llama_sampler_init_penalties penalty_freq",
        "n_predict": "generation limit",
        "stop": "core stop matcher",
    }

    @classmethod
    def version(cls) -> str:
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("llama_cpp_python")
        except PackageNotFoundError:
            return "not installed"

    @classmethod
    def availability(cls) -> tuple[bool, str | None]:
        try:
            _lib()
        except ImportError as e:
            return False, f"llama-cpp-python is not importable ({e}) ({INSTALL_HINT})"
        except Exception as e:  # a broken build, e.g. a missing shared library
            return False, f"llama-cpp-python failed to load: {type(e).__name__}: {e} ({INSTALL_HINT})"
        return True, None

    @classmethod
    def build_info(cls) -> str:
        return build_summary(_lib().llama_print_system_info().decode("utf-8", errors="replace"))

    def __init__(self, model: Any, ctx: Any, options: Options, events: Emitter) -> None:
        lib = _lib()
        self.lib = lib
        self.model = model
        self.ctx = ctx
        self.options = options
        self.events = events
        self.vocab = lib.llama_model_get_vocab(model)
        self.n_vocab = int(lib.llama_vocab_n_tokens(self.vocab))
        self.n_batch = int(lib.llama_n_batch(ctx))
        self.tokens: list[int] = []  # what the KV cache holds (sequence 0), to reuse a common prefix
        bos = int(lib.llama_vocab_bos(self.vocab))
        eos = int(lib.llama_vocab_eos(self.vocab))
        self.bos_id = None if bos == LLAMA_TOKEN_NULL else bos
        self.eos_id = None if eos == LLAMA_TOKEN_NULL else eos
        self.add_bos = bool(lib.llama_vocab_get_add_bos(self.vocab))
        self.template, self.template_source = choose_chat_template(
            options.chat_template,
            {
                "tokenizer.chat_template": self.meta("tokenizer.chat_template"),
                "general.architecture": self.meta("general.architecture"),
            },
        )
        if lib.llama_supports_gpu_offload():
            # the instance can offload; the class cannot know that without importing llama_cpp
            self.capabilities = self.capabilities | {"gpu"}  # type: ignore[misc]

    @classmethod
    def load(cls, options: Options, events: Emitter) -> LlamaCppEngine:
        check_engine_args(cls, options)
        threads, threads_batch = cls.thread_counts(options)
        for option, value, limit, how in (
            ("threads", threads, MAX_THREADS, "-t"),
            ("threads_batch", threads_batch, MAX_THREADS, "-tb"),
            ("ctx_size", options.ctx_size, MAX_TOKENS, "-c; 0 takes the model's training length"),
            ("batch_size", options.batch_size, MAX_TOKENS, "-b"),
            ("ubatch_size", options.ubatch_size, MAX_TOKENS, "-ub"),
        ):
            if value > limit:
                raise UnsupportedOption(
                    f"engine 'llamacpp' cannot honour {option}={value}: at most {limit}",
                    hint=f"use a smaller {option} ({how})",
                    options=[option],
                )
        lib = _lib()
        _install_log_callback(options.verbosity > 0)
        lib.llama_backend_init()
        if options.n_gpu_layers != 0 and not lib.llama_supports_gpu_offload():
            raise UnsupportedOption(
                f"engine 'llamacpp' cannot honour n_gpu_layers={options.n_gpu_layers}: this llama-cpp-python "
                "build has no GPU backend",
                hint="drop -ngl (or pass -ngl 0), or install a GPU build of llama-cpp-python",
                options=["n_gpu_layers"],
            )
        assert options.model is not None
        t0 = now_ms()
        mp = lib.llama_model_default_params()
        mp.n_gpu_layers = options.n_gpu_layers
        mp.load_mode = {
            (True, False): LOAD_MODE_MMAP,
            (True, True): LOAD_MODE_MMAP_MLOCK,
            (False, True): LOAD_MODE_MLOCK,
            (False, False): LOAD_MODE_NONE,
        }[(options.mmap, options.mlock)]
        _log_tail.clear()
        model = lib.llama_model_load_from_file(options.model.encode("utf-8"), mp)
        if not model:
            raise BadModelFile(
                f"llama.cpp could not load {options.model}: {_recent_errors() or 'no reason given'}",
                hint="check that the file is a complete GGUF of an architecture llama.cpp knows",
            )
        cp = lib.llama_context_default_params()
        cp.n_ctx = options.ctx_size
        cp.n_batch = options.batch_size
        cp.n_ubatch = min(options.ubatch_size, options.batch_size)
        cp.n_threads = threads
        cp.n_threads_batch = threads_batch
        # cache types are ggml type names (spec anchors §5.2): llama.cpp takes their ids
        cp.type_k = ggml_type(options.cache_type_k).id
        cp.type_v = ggml_type(options.cache_type_v).id
        cp.flash_attn_type = (
            lib.LLAMA_FLASH_ATTN_TYPE_ENABLED if options.flash_attn else lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
        )
        cp.no_perf = True
        ctx = lib.llama_init_from_model(model, cp)
        if not ctx:
            lib.llama_model_free(model)
            raise UnsupportedOption(
                f"llama.cpp could not create a context with these settings: {_recent_errors() or 'no reason given'}",
                hint="check -c, -b, -ub, -ctk/-ctv (a quantized V cache needs --flash-attn)",
                options=[
                    "ctx_size",
                    "batch_size",
                    "ubatch_size",
                    "cache_type_k",
                    "cache_type_v",
                    "flash_attn",
                ],
            )
        engine = cls(model, ctx, options, events)
        events.emit(
            "model.loaded",
            template_level(engine.template_source),
            path=options.model,
            architecture=engine.meta("general.architecture"),
            n_params=int(lib.llama_model_n_params(model)),
            n_ctx=engine.n_ctx(),
            threads=threads,
            load_ms=round(now_ms() - t0, 1),
            build=cls.build_info(),
            chat_template=engine.template_source,
        )
        return engine

    # --- adapter surface -----------------------------------------------------------------
    def info(self) -> EngineInfo:
        lib = self.lib
        desc = ctypes.create_string_buffer(256)
        lib.llama_model_desc(self.model, desc, len(desc))
        offloading = "gpu" in self.capabilities and self.options.n_gpu_layers != 0
        return EngineInfo(
            name=self.name,
            version=lib.__version__,
            build=f"llama-cpp-python {lib.__version__}; {self.build_info()}",
            backend="GPU" if offloading else "CPU",
            model={
                "path": self.options.model,
                "architecture": self.meta("general.architecture"),
                "description": desc.value.decode("utf-8", errors="replace"),
                "n_params": int(lib.llama_model_n_params(self.model)),
                "n_vocab": self.n_vocab,
                "n_ctx_train": int(lib.llama_model_n_ctx_train(self.model)),
            },
        )

    def n_ctx(self) -> int:
        return int(self.lib.llama_n_ctx(self.ctx))

    def meta(self, key: str) -> str | None:
        """A GGUF metadata value as llama.cpp read it (strings; None when absent)."""
        size = 4096
        while True:
            buf = ctypes.create_string_buffer(size)
            n = int(self.lib.llama_model_meta_val_str(self.model, key.encode("utf-8"), buf, size))
            if n < 0:
                return None
            if n < size:
                return buf.raw[:n].decode("utf-8", errors="replace")
            size = n + 1

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        data = text.encode("utf-8")
        cap = len(data) + 8
        while True:
            buf = (self.lib.llama_token * cap)()
            n = int(
                self.lib.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, parse_special)
            )
            if n >= 0:
                return list(buf[:n])
            cap = -n  # too small: llama.cpp says how many it needs

    def detokenize(self, tokens: Sequence[int]) -> str:
        tokens = check_token_ids(tokens, self.n_vocab)
        arr = (self.lib.llama_token * max(1, len(tokens)))(*tokens)
        cap = 8 * len(tokens) + 16
        while True:
            buf = ctypes.create_string_buffer(cap)
            # remove_special=False, unparse_special=True: every token's text, as llama-server's /detokenize
            n = int(self.lib.llama_detokenize(self.vocab, arr, len(tokens), buf, cap, False, True))
            if n >= 0:
                return buf.raw[:n].decode("utf-8", errors="replace")
            cap = -n

    def token_piece(self, token: int, special: bool = False) -> bytes:
        """The bytes a generated token adds to the text (control tokens add none unless special)."""
        buf = ctypes.create_string_buffer(64)
        n = int(self.lib.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special))
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = int(self.lib.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special))
        return buf.raw[:n]

    def token_bytes(self, token: int) -> bytes:
        return self.token_piece(token, special=True)

    def decode(self, tokens: Sequence[int], all_logits: bool = False) -> np.ndarray:
        if len(tokens) == 0:
            raise InvalidRequest("decode needs at least one token")
        self.check_fits(len(self.tokens) + len(tokens))
        return self._decode(check_token_ids(tokens, self.n_vocab), all_logits)

    def reset(self) -> None:
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)
        self.tokens = []

    def close(self) -> None:
        if self.ctx:
            self.lib.llama_free(self.ctx)
            self.ctx = None
        if self.model:
            self.lib.llama_model_free(self.model)
            self.model = None

    # --- internals -----------------------------------------------------------------------
    # --- LocalEngine hooks ---------------------------------------------------------------
    def token_text(self, token: int) -> str:
        return bytes(self.lib.llama_vocab_get_text(self.vocab, token)).decode("utf-8", errors="replace")

    def _keep_prefix(self, n: int) -> int:
        if n < len(self.tokens):
            mem = self.lib.llama_get_memory(self.ctx)
            # a sliding-window cache (gemma3) cannot always drop a partial sequence: start over
            if not self.lib.llama_memory_seq_rm(mem, 0, n, -1):
                self.lib.llama_memory_clear(mem, True)
                n = 0
            self.tokens = self.tokens[:n]
        return n

    def _evaluate(self, tokens: list[int]) -> None:
        self._decode(tokens, False)

    def _sample_tokens(self, s: SamplingParams) -> Generator[int, None, None]:
        sampler = self._sampler(s)
        try:
            while True:
                yield int(self.lib.llama_sampler_sample(sampler, self.ctx, -1))  # also accepts it
        finally:
            self.lib.llama_sampler_free(sampler)

    def _is_eog(self, token: int) -> bool:
        return bool(self.lib.llama_vocab_is_eog(self.vocab, token))

    def _last_logits(self) -> np.ndarray:
        return np.ctypeslib.as_array(
            self.lib.llama_get_logits_ith(self.ctx, -1), shape=(self.n_vocab,)
        ).copy()

    def _logits_buffer(self) -> np.ndarray:
        # llama_sampler_sample(..., -1) reads this same buffer
        return np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.ctx, -1), shape=(self.n_vocab,))

    def _vocabulary(self) -> Vocabulary:
        from stdengine.structured import Vocabulary

        lib, vocab, ids = self.lib, self.vocab, range(self.n_vocab)
        return Vocabulary(
            pieces=[self.token_piece(i, special=True) for i in ids],
            special=[i for i in ids if lib.llama_vocab_get_attr(vocab, i) & lib.LLAMA_TOKEN_ATTR_CONTROL],
            eog=[i for i in ids if lib.llama_vocab_is_eog(vocab, i)],
            encode=lambda b: self.tokenize(b.decode("utf-8", errors="replace"), False, False),
        )

    def _text_stream(self) -> _PieceStream:
        return _PieceStream(self)

    def _decode(self, tokens: list[int], all_logits: bool) -> np.ndarray:
        """llama_decode in chunks of n_batch after the cached tokens; the logits asked for."""
        lib = self.lib
        rows: list[np.ndarray] = []
        for start in range(0, len(tokens), self.n_batch):
            chunk = tokens[start : start + self.n_batch]
            last_chunk = start + len(chunk) == len(tokens)
            batch = lib.llama_batch_init(len(chunk), 0, 1)
            try:
                pos0 = len(self.tokens)
                for i, tok in enumerate(chunk):
                    batch.token[i] = tok
                    batch.pos[i] = pos0 + i
                    batch.n_seq_id[i] = 1
                    batch.seq_id[i][0] = 0
                    batch.logits[i] = all_logits or (last_chunk and i == len(chunk) - 1)
                batch.n_tokens = len(chunk)
                rc = int(lib.llama_decode(self.ctx, batch))
            finally:
                lib.llama_batch_free(batch)
            if rc != 0:
                # 1: no KV slot; <0: invalid batch or a fatal error. The cache may be partly
                # written, so forget it: the next request starts clean.
                self.reset()
                raise EngineFailure(
                    f"llama_decode failed with status {rc}: {_recent_errors() or 'no reason given'}"
                )
            self.tokens.extend(chunk)
            if all_logits:
                ptr = lib.llama_get_logits(self.ctx)
                rows.append(np.ctypeslib.as_array(ptr, shape=(len(chunk), self.n_vocab)).copy())
        if all_logits:
            return np.concatenate(rows, axis=0)
        return self._last_logits()

    def _sampler(self, s: SamplingParams) -> Any:
        """llama.cpp's sampler chain in its default order: penalties, top-k, top-p, min-p, temperature,
        draw (greedy when temp ≤ 0). The penalties see the context's last repeat_last_n tokens."""
        lib = self.lib
        chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
        last_n = self.n_ctx() if s.repeat_last_n < 0 else s.repeat_last_n
        lib.llama_sampler_chain_add(
            chain,
            lib.llama_sampler_init_penalties(
                self.n_vocab, last_n, s.repeat_penalty, s.frequency_penalty, s.presence_penalty
            ),
        )
        if s.temp <= 0:
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_greedy())
        else:
            if s.top_k > 0:
                lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_top_k(s.top_k))
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_top_p(s.top_p, 1))
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_min_p(s.min_p, 1))
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_temp(s.temp))
            seed = lib.LLAMA_DEFAULT_SEED if s.seed < 0 else s.seed & 0xFFFFFFFF
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_dist(seed))
        if last_n > 0:
            for tok in self.tokens[-last_n:]:
                lib.llama_sampler_accept(chain, tok)
        return chain


class _PieceStream:
    """llama.cpp's token pieces as complete UTF-8 text."""

    def __init__(self, engine: LlamaCppEngine) -> None:
        self.engine = engine
        self.utf8 = Utf8Stream()

    def push(self, token: int) -> str:
        return self.utf8.feed(self.engine.token_piece(token))

    def flush(self) -> str:
        return self.utf8.flush()
