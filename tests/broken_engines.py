"""Deliberately broken engines: the reference engine plus one realistic bug each.

The conformance suite must fail every one of them with a check that names the fault
(tests/test_conformance_faults.py). Each class says which check IDs (globs) must fail. Black boxes
declare neither `logits` nor `tokenize`, as an HTTP server cannot, so that only the generation
checks can see them.
"""

from __future__ import annotations

import dataclasses
import shutil
import unicodedata
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from stdengine.conformance.sensitivity import kv_window, noisy_logits
from stdengine.reference.adapter import ReferenceEngine

from stdengine.adapter import DoneEvent, GenerateRequest, GenerationEvent, SamplingParams, TokenEvent
from stdengine.gguf_file import scan_gguf

BLACK_BOX = frozenset({"stream", "chat_template", "seed"})


class Faulty(ReferenceEngine):
    """A broken engine: `fails` are the check-ID globs the suite must fail in process, `fails_served`
    those it must fail over HTTP when the engine is served by `infer serve` (empty: not tried)."""

    fails: ClassVar[tuple[str, ...]] = ()
    fails_served: ClassVar[tuple[str, ...]] = ()


# --- black boxes: wrong output, nothing to inspect but the text ---------------------------------
class RunnerUpEvery5th(Faulty):
    """Greedy decoding that takes the second most likely token at every 5th step."""

    capabilities = BLACK_BOX
    fails = ("generation.golden:*", "generation.exact:*")
    fails_served = ("http.generation.golden:*",)

    def _sample_tokens(self, s: SamplingParams) -> Generator[int, None, None]:
        for n, tok in enumerate(super()._sample_tokens(s), start=1):
            yield int(np.argsort(self._last_logits())[-2]) if n % 5 == 0 else tok


class SkipsLayer(Faulty):
    """A forward pass that leaves out one whole layer (loaded from a copy of the model whose layer
    has zero output projections: its attention and FFN add nothing to the residual stream)."""

    capabilities = BLACK_BOX
    fails = ("generation.golden:*",)
    fails_served = ("http.generation.golden:*",)


def without_layer(model: Path, layer: int, out: Path) -> Path:
    """A copy of the GGUF model in which layer `layer` adds nothing: its attention output and FFN
    down projections are zero (zero bytes are zero weights in every ggml block type)."""
    shutil.copyfile(model, out)
    header = scan_gguf(out)
    with open(out, "r+b") as f:
        for t in header.tensors:
            if t.name in (f"blk.{layer}.attn_output.weight", f"blk.{layer}.ffn_down.weight"):
                f.seek(t.offset)
                f.write(bytes(t.n_bytes))
    return out


class ForgetsOldTokens(Faulty, kv_window(600)):  # type: ignore[misc]
    """A context that keeps only the last 600 prompt tokens (a silent truncation or a KV window)."""

    capabilities = BLACK_BOX
    fails = ("generation.golden:case=raw:induction",)
    fails_served = ("http.generation.golden:case=raw:induction",)


# --- generation details -------------------------------------------------------------------------
def _with_done(events: Iterator[GenerationEvent], change: Any) -> Iterator[GenerationEvent]:
    for ev in events:
        yield change(ev) if isinstance(ev, DoneEvent) else ev


class CountsEogToken(Faulty):
    """usage.completion_tokens counts the end-of-generation token."""

    fails = ("generation.eog",)
    fails_served = ("http.eog",)

    def generate(self, request: GenerateRequest) -> Iterator[GenerationEvent]:
        def change(done: DoneEvent) -> DoneEvent:
            if done.finish_reason == "stop" and done.stop is None:
                done.usage.completion_tokens += 1
            return done

        return _with_done(super().generate(request), change)


class PromptTokensOffByOne(Faulty):
    """usage.prompt_tokens one more than the prompt has (BOS counted twice)."""

    capabilities = BLACK_BOX
    fails = ("generation.golden:*",)
    fails_served = ("http.generation.golden:*",)

    def generate(self, request: GenerateRequest) -> Iterator[GenerationEvent]:
        def change(done: DoneEvent) -> DoneEvent:
            done.usage.prompt_tokens += 1
            return done

        return _with_done(super().generate(request), change)


class LeaksEogText(Faulty):
    """The end-of-generation token's text is left at the end of the answer."""

    fails = ("generation.eog",)
    fails_served = ("http.eog",)

    def generate(self, request: GenerateRequest) -> Iterator[GenerationEvent]:
        for ev in super().generate(request):
            if isinstance(ev, DoneEvent) and ev.finish_reason == "stop" and ev.stop is None:
                eog = next(iter(sorted(self.tokenizer.eog_ids)))
                yield TokenEvent(-1, self.token_text(eog))
            yield ev


class DecodesTokensApart(Faulty):
    """Each token's bytes decoded on their own: a character split across tokens becomes U+FFFD."""

    capabilities = BLACK_BOX
    fails = ("generation.golden:case=raw:cjk",)
    fails_served = ("http.generation.golden:case=raw:cjk",)

    def _text_stream(self) -> Any:
        engine = self

        class Apart:
            def push(self, token: int) -> str:
                return engine.token_bytes(token).decode("utf-8", errors="replace")

            def flush(self) -> str:
                return ""

        return Apart()


class DropsSystemMessage(Faulty):
    """generate(messages=...) leaves out the system message (apply_chat_template is right)."""

    capabilities = BLACK_BOX
    fails = ("generation.golden:case=chat:*",)
    fails_served = ("http.generation.golden:case=chat:system",)

    def generate(self, request: GenerateRequest) -> Iterator[GenerationEvent]:
        if request.messages:
            kept = [m for m in request.messages if m.get("role") != "system"]
            request = dataclasses.replace(request, messages=kept)
        return super().generate(request)


def _sampling_fault(**change: Any) -> Any:
    def generate(self: Faulty, request: GenerateRequest) -> Iterator[GenerationEvent]:
        s = dataclasses.replace(request.sampling, **change)
        return ReferenceEngine.generate(self, dataclasses.replace(request, sampling=s))

    return generate


class IgnoresTopP(Faulty):
    capabilities = BLACK_BOX
    fails = ("generation.sampler:top_p=0.01",)
    generate = _sampling_fault(top_p=1.0)


class IgnoresMinP(Faulty):
    capabilities = BLACK_BOX
    fails = ("generation.sampler:min_p=1",)
    generate = _sampling_fault(min_p=0.0)


class IgnoresRepeatPenalty(Faulty):
    capabilities = BLACK_BOX
    fails = ("generation.sampler:repeat_penalty=1.5",)
    generate = _sampling_fault(repeat_penalty=1.0)


class IgnoresSeed(Faulty):
    """Every request draws a fresh random seed."""

    fails = ("generation.seed",)
    generate = _sampling_fault(seed=-1)


class OneSeedForAll(Faulty):
    """Every request uses the same seed, whatever it asks for."""

    fails = ("generation.seed",)
    generate = _sampling_fault(seed=42)


# --- tokenizer, concurrency ---------------------------------------------------------------------
class NormalisesText(Faulty):
    """NFKC-normalises the text before tokenizing it."""

    fails = (
        "tokenizer.ids:case=fullwidth",
        "tokenizer.ids:case=ligatures",
        "tokenizer.roundtrip:case=fullwidth",
    )
    fails_served = ("http.tokenize:case=fullwidth",)

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        return super().tokenize(unicodedata.normalize("NFKC", text), add_special, parse_special)


class SharedKvCache(Faulty):
    """new_context() hands out the same context: concurrent requests overwrite each other's cache."""

    fails = ("generation.concurrent:*",)

    def new_context(self) -> Any:
        engine = self

        class Alias:
            def generate(self, request: GenerateRequest) -> Iterator[GenerationEvent]:
                return engine.generate(request)

            def close(self) -> None:
                pass

        return Alias()


# --- numbers ------------------------------------------------------------------------------------
class NoisyLogits(Faulty, noisy_logits(0.1)):  # type: ignore[misc]
    """Logits with independent Gaussian noise of 0.1 nats."""

    fails = ("logits.kl:text=all",)
    fails_served = ("http.logprobs.kl:text=all",)


# --- structured output (tests/test_conformance_structured.py) -----------------------------------
class IgnoresConstraint(Faulty):
    """Declares `structured` but generates as if the request had no constraint."""

    fails = (
        "structured.json_schema:*",
        "structured.json_object",
        "structured.regex:*",
        "structured.grammar:*",
    )
    fails_served = (
        "http.structured.json_schema:*",
        "http.structured.json_object",
        "http.structured.tool_call*",
    )

    def generate(self, request: GenerateRequest) -> Iterator[GenerationEvent]:
        return super().generate(dataclasses.replace(request, constraint=None))


class DropsLastConstrainedToken(Faulty):
    """Honours the constraint but loses the last token of a constrained answer (the closing brace
    or quote the constraint forced): the JSON it emits does not parse."""

    fails = (
        "structured.json_schema:*",
        "structured.json_object",
        "structured.regex:*",
        "structured.grammar:*",
    )

    def generate(self, request: GenerateRequest) -> Iterator[GenerationEvent]:
        if request.constraint is None:
            yield from super().generate(request)
            return
        held: TokenEvent | None = None
        for ev in super().generate(request):
            if isinstance(ev, TokenEvent):
                if held is not None:
                    yield held
                held = ev
            else:
                yield ev  # the DoneEvent: the held last token is never sent


class PenalisesRepeatsUnderConstraint(Faulty):
    """A constrained request gets a repeat penalty of 1.5 whatever it asked for (a constrained path
    with its own sampler defaults): valid output, but not the text the model would give."""

    fails = ("structured.unchanged:*",)

    def generate(self, request: GenerateRequest) -> Iterator[GenerationEvent]:
        if request.constraint is not None:
            s = dataclasses.replace(request.sampling, repeat_penalty=1.5, repeat_last_n=64)
            request = dataclasses.replace(request, sampling=s)
        return super().generate(request)


STRUCTURED_FAULTS: tuple[type[Faulty], ...] = (
    IgnoresConstraint,
    DropsLastConstrainedToken,
    PenalisesRepeatsUnderConstraint,
)

FAULTS: tuple[type[Faulty], ...] = (
    RunnerUpEvery5th,
    SkipsLayer,
    ForgetsOldTokens,
    CountsEogToken,
    PromptTokensOffByOne,
    LeaksEogText,
    DecodesTokensApart,
    DropsSystemMessage,
    IgnoresTopP,
    IgnoresMinP,
    IgnoresRepeatPenalty,
    IgnoresSeed,
    OneSeedForAll,
    NormalisesText,
    SharedKvCache,
    NoisyLogits,
)
