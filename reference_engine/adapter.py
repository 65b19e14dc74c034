"""The `reference` engine: stdengine's built-in GGUF engine behind the adapter interface.

The Python side keeps to the edges (tokenizer, chat template, stop strings); each decode and each
sampled token is one call into the C core (core.py), which owns the forward pass, the KV cache,
the thread pool and sampling.
"""

from __future__ import annotations

import math
from collections.abc import Generator, Sequence
from typing import TYPE_CHECKING, Any

from stdengine import __version__
from stdengine.adapter import EngineInfo, SamplingParams, check_engine_args, check_token_ids, now_ms
from stdengine.errors import InvalidRequest
from stdengine.generation import choose_chat_template, template_level
from stdengine.local_engine import LocalEngine

if TYPE_CHECKING:
    import numpy as np

    from stdengine.events import Emitter
    from stdengine.options import Options
    from stdengine.structured import Vocabulary


class ReferenceEngine(LocalEngine):
    name = "reference"
    description = (
        "built-in GGUF engine: C quantized kernels, thread pool, batched prompts (CPU); layers offloaded "
        "to an OpenCL device with -ngl"
    )
    capabilities = frozenset(
        {
            "stream",
            "logits",
            "tokenize",
            "chat_template",
            "seed",
            "batch",
            "logprobs",
            "structured",
            "batch_decode",
        }
    )
    option_map = {
        "model": "GGUF file, memory-mapped, weights used in place",
        "ctx_size": "KV cache length (0 = the model's context_length)",
        "threads": "thread-pool size for single-token decodes",
        "threads_batch": "thread-pool size for prompt batches",
        "batch_size": "most tokens per decode call",
        "ubatch_size": "most tokens per forward pass",
        "seed": "seed of the C sampler's RNG",
        "temp": "C sampler",
        "top_k": "C sampler",
        "top_p": "C sampler",
        "min_p": "C sampler",
        "repeat_penalty": "C sampler",
        "repeat_last_n": "C sampler",
        "presence_penalty": "C sampler",
        "frequency_penalty": "C sampler",
        "n_predict": "generation limit",
        "stop": "core stop matcher",
        "n_gpu_layers": "layers run on an OpenCL device (-1 or more than the model has: all, and the "
        "output head); refused when no device exists",
        "device": "the OpenCL device (index or name substring; `infer engines` lists them)",
    }
    engine_args = {
        "screen_head": "on (default) or off: greedy and top-k sampling compute only the output head's "
        "rows that can be chosen (the same tokens; spec/reference-engine.md)",
        "batch_panels": "on (default) or off: batched decoding (infer serve -np 2 or more) reads a packed "
        "copy of the Q4_0, Q4_1 and Q8_0 weights, made at its first step and as large as they are, "
        "faster on AVX-512 (the same results; spec/reference-engine.md)",
    }
    accepted_values = {
        "mmap": (True,),
        "mlock": (False,),
        "flash_attn": (False,),
        "cache_type_k": ("f32", "f16"),
        "cache_type_v": ("f32", "f16"),
    }

    @classmethod
    def version(cls) -> str:
        return __version__

    @classmethod
    def build_info(cls) -> str:
        """The kernels' SIMD path chosen for this CPU (INFER_REF_ISA may force a lower one)."""
        from stdengine.reference.core import isa_name

        return f"isa={isa_name()}"

    @classmethod
    def devices(cls) -> list[str]:
        """The devices -ngl can offload to (OpenCL's), one line each; none without a runtime."""
        from stdengine.reference.core import devices

        return [str(d) for d in devices()]

    def __init__(self, model: Any, tokenizer: Any, ctx: Any, options: Options, events: Emitter) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.ctx = ctx
        self.options = options
        self.events = events
        self.tokens: list[int] = []  # what the KV cache holds, to reuse a common prefix
        self.bos_id, self.eos_id, self.add_bos = tokenizer.bos_id, tokenizer.eos_id, tokenizer.add_bos
        self.n_vocab = int(model.n_vocab)
        self.template, self.template_source = choose_chat_template(options.chat_template, model.metadata)
        self.n_params = sum(math.prod(t.shape) for t in model.tensors.values())
        # An instance has the GPU capability when its layers went to a device at load. Listing the
        # devices here would start the OpenCL runtime (PoCL: ~60 MiB and its start-up) in every CPU run.
        if options.n_gpu_layers != 0:
            self.capabilities = self.capabilities | {"gpu"}  # type: ignore[misc]

    @classmethod
    def load(cls, options: Options, events: Emitter) -> ReferenceEngine:
        from stdengine.reference.core import Context, check_isa_env, choose_device, isa_name
        from stdengine.reference.model import Model
        from stdengine.reference.tokenizer import Tokenizer, scan_for_tokenizer

        assert options.model is not None
        args = check_engine_args(cls, options)
        screen_head, batch_panels = on_off_setting(args, "screen_head"), on_off_setting(args, "batch_panels")
        check_isa_env()
        t0 = now_ms()
        header = scan_for_tokenizer(options.model)  # the file is read once, for model and tokenizer
        model = Model.load(options.model, header)
        model.set_batch_panels(batch_panels)
        if options.n_gpu_layers != 0:
            try:
                model.offload(choose_device(options.device), options.n_gpu_layers)
            except BaseException:
                model.close()
                raise
        tokenizer = Tokenizer.from_header(header)
        threads, threads_batch = cls.thread_counts(options)
        n_ctx = options.ctx_size or model.n_ctx_train
        ctx = Context(
            model,
            n_ctx=n_ctx,
            n_threads=threads,
            n_threads_batch=threads_batch,
            n_batch=options.batch_size,
            n_ubatch=options.ubatch_size,
            cache_type_k=options.cache_type_k,
            cache_type_v=options.cache_type_v,
            screen_head=screen_head,
        )
        engine = cls(model, tokenizer, ctx, options, events)
        events.emit(
            "model.loaded",
            template_level(engine.template_source),
            path=options.model,
            architecture=model.arch,
            n_params=engine.n_params,
            n_ctx=n_ctx,
            threads=threads,
            isa=isa_name(),
            chat_template=engine.template_source,
            tied_output=model.tied_output,
            device=str(model.device) if model.device else None,
            n_gpu_layers=model.gpu_layers + model.gpu_head,
            load_ms=round(now_ms() - t0, 1),
        )
        return engine

    # --- adapter surface -----------------------------------------------------------------
    def info(self) -> EngineInfo:
        from stdengine.reference.core import BACKEND_NAMES

        dev = self.model.device
        return EngineInfo(
            name=self.name,
            version=__version__,
            build=self.build_info(),
            backend=BACKEND_NAMES.get(dev.backend, dev.backend) if dev else "CPU",
            gpu_info=dev.name if dev else "",
            model={
                "path": self.options.model,
                "architecture": self.model.arch,
                "n_params": self.n_params,
                "n_vocab": self.tokenizer.n_vocab,
            },
        )

    def n_ctx(self) -> int:
        return int(self.ctx.n_ctx)

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special=add_special, parse_special=parse_special))

    def detokenize(self, tokens: Sequence[int]) -> str:
        return str(self.tokenizer.decode(check_token_ids(tokens, self.n_vocab)))

    def decode(self, tokens: Sequence[int], all_logits: bool = False) -> np.ndarray:
        self.check_fits(len(self.tokens) + len(tokens))
        out = self.ctx.decode(list(tokens), all_logits=all_logits)
        self.tokens.extend(tokens)
        # the last-token logits are a view of the context's buffer, which the next decode
        # overwrites; the caller gets its own array (n_vocab floats: a cheap copy)
        return out if all_logits else out.copy()

    def reset(self) -> None:
        self.ctx.reset()
        self.tokens = []

    def new_context(self) -> ReferenceEngine:
        """Another context (KV cache, thread pool, sampler) on the same mapped weights."""
        from stdengine.reference.core import Context

        c = self.ctx
        ctx = Context(
            self.model,
            n_ctx=c.n_ctx,
            n_threads=c.n_threads,
            n_threads_batch=c.n_threads_batch,
            n_batch=c.n_batch,
            n_ubatch=c.n_ubatch,
            cache_type_k=c.cache_type_k,
            cache_type_v=c.cache_type_v,
            screen_head=c.screen_head,
        )
        return ReferenceEngine(self.model, self.tokenizer, ctx, self.options, self.events)

    def close(self) -> None:
        self.ctx.close()

    # --- LocalEngine hooks ---------------------------------------------------------------
    def token_text(self, token: int) -> str:
        return str(self.tokenizer.tokens[token])

    def token_bytes(self, token: int) -> bytes:
        return bytes(self.tokenizer.token_to_piece(token, special=True))

    def _last_logits(self) -> np.ndarray:
        return self.ctx.logits.copy()

    def _logits_buffer(self) -> np.ndarray:
        return self.ctx.logits_buffer

    def _forbid(self, ids: np.ndarray | None) -> None:
        self.ctx.ban(ids)  # the C sampler skips them: the head can stay screened

    def _plan_sample(self, s: SamplingParams | None) -> None:
        self.ctx.plan_sample(s)  # a batched step then screens this context's head (if on and few)

    def _vocabulary(self) -> Vocabulary:
        from stdengine.reference.tokenizer import ATTR_CONTROL

        from stdengine.structured import Vocabulary

        tk = self.tokenizer
        return Vocabulary(
            pieces=[bytes(tk.token_to_piece(i, special=True)) for i in range(self.n_vocab)],
            special=[i for i in range(self.n_vocab) if tk.attrs[i] & ATTR_CONTROL],
            eog=sorted(tk.eog_ids),
            encode=lambda b: tk.encode(
                b.decode("utf-8", errors="replace"), add_special=False, parse_special=False
            ),
        )

    def _vocab_owner(self) -> object:
        return self.tokenizer  # shared by new_context()'s contexts

    def _keep_prefix(self, n: int) -> int:
        self.ctx.truncate(n)  # also re-arms the seed: a seeded request replays
        self.tokens = self.tokens[:n]
        return n

    def _evaluate(self, tokens: list[int]) -> None:
        self.ctx.evaluate(tokens)  # the head waits for the sampler (or for _logits_buffer)
        self.tokens.extend(tokens)

    def _evaluate_batch(self, items: list[tuple[LocalEngine, list[int]]]) -> None:
        """Each (context, tokens) item's _evaluate, in shared forward passes (core.decode_batch:
        the weights read once per pass; every context's logits as if it were evaluated alone).
        The contexts are this engine's new_context() family (one model). On an error nothing is
        evaluated and no context's tokens change."""
        from stdengine.reference.core import evaluate_batch

        if not items:
            return
        engines: list[ReferenceEngine] = []
        for e, _ in items:
            if not isinstance(e, ReferenceEngine):
                raise InvalidRequest(f"a {self.name} batch cannot evaluate a context of engine {e.name!r}")
            engines.append(e)
        evaluate_batch([e.ctx for e in engines], [toks for _, toks in items])
        for e, toks in items:
            e.tokens.extend(toks)

    def _sample_tokens(self, s: SamplingParams) -> Generator[int, None, None]:
        while True:
            yield self.ctx.sample(s)

    def _is_eog(self, token: int) -> bool:
        return token in self.tokenizer.eog_ids

    def _text_stream(self) -> Any:
        from stdengine.reference.tokenizer import StreamDecoder

        return StreamDecoder(self.tokenizer)


def on_off_setting(args: dict[str, str], name: str) -> bool:
    """-E name=on|off (default on)"""
    value = args.get(name, "on")
    if value not in ("on", "off"):
        from stdengine.errors import UsageError

        raise UsageError(f"-E {name} takes on or off, not {value!r}", hint=f"-E {name}=off")
    return value == "on"
