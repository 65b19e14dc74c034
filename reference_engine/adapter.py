"""The `reference` engine: stdengine's built-in GGUF engine behind the adapter interface.

The Python side keeps to the edges (tokenizer, chat template, stop strings); each decode and each
sampled token is one call into the C core (core.py), which owns the forward pass, the KV cache,
the thread pool and sampling.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from stdengine import __version__
from stdengine.adapter import (
    DoneEvent,
    Engine,
    EngineInfo,
    FinishReason,
    GenerateRequest,
    GenerationEvent,
    Timings,
    TokenEvent,
    Usage,
    now_ms,
)
from stdengine.errors import ContextOverflow, InvalidRequest
from stdengine.generation import StopMatcher, choose_chat_template, render_chat_template, request_tokens

if TYPE_CHECKING:
    import numpy as np

    from stdengine.events import Emitter
    from stdengine.options import Options


class ReferenceEngine(Engine):
    name = "reference"
    description = "built-in GGUF engine: C quantized kernels, thread pool, batched prompts (CPU)"
    capabilities = frozenset({"stream", "logits", "tokenize", "chat_template", "seed", "batch"})
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
    }
    accepted_values = {
        "n_gpu_layers": (0,),
        "mmap": (True,),
        "mlock": (False,),
        "flash_attn": (False,),
    }

    @classmethod
    def version(cls) -> str:
        return __version__

    def __init__(self, model: Any, tokenizer: Any, ctx: Any, options: Options, events: Emitter) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.ctx = ctx
        self.options = options
        self.events = events
        self.tokens: list[int] = []  # what the KV cache holds, to reuse a common prefix
        self.template, self.template_source = choose_chat_template(options.chat_template, model.metadata)
        self.n_params = sum(math.prod(t.shape) for t in model.tensors.values())

    @classmethod
    def load(cls, options: Options, events: Emitter) -> ReferenceEngine:
        from stdengine.reference.core import Context
        from stdengine.reference.model import Model
        from stdengine.reference.tokenizer import Tokenizer

        from stdengine.engines import physical_cores

        assert options.model is not None
        t0 = now_ms()
        model = Model.load(options.model)
        tokenizer = Tokenizer.from_gguf(options.model)
        threads = options.threads or physical_cores()
        n_ctx = options.ctx_size or model.n_ctx_train
        ctx = Context(
            model,
            n_ctx=n_ctx,
            n_threads=threads,
            n_threads_batch=options.threads_batch or threads,
            n_batch=options.batch_size,
            n_ubatch=options.ubatch_size,
        )
        engine = cls(model, tokenizer, ctx, options, events)
        events.info(
            "model.loaded",
            path=options.model,
            architecture=model.arch,
            n_params=engine.n_params,
            n_ctx=n_ctx,
            threads=threads,
            load_ms=round(now_ms() - t0, 1),
        )
        return engine

    # --- adapter surface -----------------------------------------------------------------
    def info(self) -> EngineInfo:
        from stdengine.reference.core import isa_name

        return EngineInfo(
            name=self.name,
            version=__version__,
            build=f"isa={isa_name()}",
            backend="CPU",
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
        return str(self.tokenizer.decode(list(tokens)))

    def decode(self, tokens: Sequence[int], all_logits: bool = False) -> np.ndarray:
        self._check_fits(len(self.tokens) + len(tokens))
        out = self.ctx.decode(list(tokens), all_logits=all_logits)
        self.tokens.extend(tokens)
        return out

    def reset(self) -> None:
        self.ctx.reset()
        self.tokens = []

    def has_chat_template(self) -> bool:
        return bool(self.template)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if not self.template:
            raise InvalidRequest("this model has no chat template", hint="pass one with --chat-template")
        return render_chat_template(
            self.template,
            messages,
            bos_token=self._token_text(self.tokenizer.bos_id),
            eos_token=self._token_text(self.tokenizer.eos_id),
            add_generation_prompt=add_generation_prompt,
        )

    def generate(self, request: GenerateRequest) -> Iterator[GenerationEvent]:
        from stdengine.reference.tokenizer import StreamDecoder

        s = request.sampling
        prompt = request_tokens(self, request, self.tokenizer.bos_id, self.tokenizer.add_bos)
        self._check_fits(len(prompt) + 1)

        t0 = now_ms()
        logits_ready = self._prefill(prompt)
        t1 = now_ms()
        stops = StopMatcher(s.stop)
        utf8 = StreamDecoder(self.tokenizer)
        eog = self.tokenizer.eog_ids
        n_gen = 0
        finish: FinishReason = "length"
        matched: str | None = None
        assert logits_ready
        while s.n_predict < 0 or n_gen < s.n_predict:
            tok = self.ctx.sample(s)
            if tok in eog:
                finish = "stop"
                break
            n_gen += 1
            text, matched = stops.feed(utf8.push(tok))
            yield TokenEvent(tok, text)
            if matched is not None:
                finish = "stop"
                break
            if len(self.tokens) >= self.n_ctx():
                break  # the context is full: finish with "length"
            if s.n_predict >= 0 and n_gen >= s.n_predict:
                break
            self.ctx.decode([tok])
            self.tokens.append(tok)
        if matched is None:
            tail = stops.feed(utf8.flush())[0] + stops.flush()
            if tail:
                yield TokenEvent(-1, tail)
        t2 = now_ms()
        yield DoneEvent(
            finish_reason=finish,
            stop=matched,
            usage=Usage(prompt_tokens=len(prompt), completion_tokens=n_gen),
            timings=Timings(
                prompt_n=self._last_prompt_n, prompt_ms=t1 - t0, predicted_n=n_gen, predicted_ms=t2 - t1
            ),
        )

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
        )
        return ReferenceEngine(self.model, self.tokenizer, ctx, self.options, self.events)

    def close(self) -> None:
        self.ctx.close()

    # --- internals -----------------------------------------------------------------------
    def _token_text(self, token_id: int | None) -> str:
        return self.tokenizer.tokens[token_id] if token_id is not None else ""

    def _check_fits(self, n: int) -> None:
        if n > self.n_ctx():
            raise ContextOverflow(
                f"the prompt needs {n} tokens but the context holds {self.n_ctx()}",
                hint="shorten the prompt or raise --ctx-size",
                n_prompt_tokens=n,
                n_ctx=self.n_ctx(),
            )

    def _prefill(self, prompt: list[int]) -> bool:
        """Evaluate the prompt, reusing the longest prefix the KV cache already holds."""
        common = 0
        for a, b in zip(self.tokens, prompt, strict=False):
            if a != b:
                break
            common += 1
        common = min(common, len(prompt) - 1)  # always evaluate at least the last token for its logits
        self.ctx.truncate(common)
        self.tokens = self.tokens[:common]
        todo = prompt[common:]
        self._last_prompt_n = len(todo)
        self.ctx.decode(todo)
        self.tokens.extend(todo)
        return True
