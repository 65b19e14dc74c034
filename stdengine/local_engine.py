"""The base of engines that tokenize, decode and sample in this process (reference, llamacpp).

The generation loop, stop strings, chat templates, the context check and prompt-prefix reuse are
written here once, so every such engine behaves the same; an engine supplies the hooks at the
bottom (how to evaluate tokens, sample one, and turn tokens into text).
"""

from __future__ import annotations

import weakref
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from stdengine.adapter import (
    DoneEvent,
    Engine,
    FinishReason,
    GenerateRequest,
    GenerationEvent,
    PromptLogprobs,
    SamplingParams,
    Timings,
    TokenEvent,
    Usage,
    check_logprobs,
    check_token_ids,
    log_softmax,
    now_ms,
    score_by_decode,
    token_logprob,
    top_logprobs,
)
from stdengine.errors import ContextOverflow, InvalidRequest
from stdengine.generation import StopMatcher, render_chat_template, request_tokens, validate_sampling

if TYPE_CHECKING:
    from stdengine.events import Emitter
    from stdengine.options import Options
    from stdengine.structured import Matcher, Vocabulary


# The end-of-generation ids of each model (see LocalEngine._eog_ids), for as long as it is loaded.
_EOG_IDS: weakref.WeakKeyDictionary[object, np.ndarray] = weakref.WeakKeyDictionary()


@dataclass
class Evaluate:
    """What LocalEngine.generation() yields when it needs tokens evaluated: whoever drives it
    evaluates them in its context (alone with _evaluate, or in one _evaluate_batch with other
    contexts' tokens) before resuming it, or throws the evaluation's error into it."""

    tokens: list[int]


GenerationStep = GenerationEvent | Evaluate


class TextStream(Protocol):
    def push(self, token: int) -> str: ...  # the complete UTF-8 text this token adds
    def flush(self) -> str: ...


class LocalEngine(Engine):
    """Subclasses set, in __init__: template (str or None), events (the Emitter given to load),
    bos_id, eos_id, add_bos, n_vocab, and tokens = [] (what the KV cache holds, kept up to date by
    the hooks)."""

    takes_prompt_tokens = True
    eog_controls = True
    # False for an engine whose logits depend on how the positions were split into batches
    # (llama.cpp): a request whose answer must not change from one call to the next (greedy, or
    # a fixed seed) then evaluates its prompt from the start instead of reusing the cache's prefix.
    batch_invariant = True
    template: str | None
    events: Emitter
    bos_id: int | None
    eos_id: int | None
    add_bos: bool
    n_vocab: int
    tokens: list[int]

    @staticmethod
    def thread_counts(options: Options) -> tuple[int, int]:
        """(threads, threads_batch) a load uses: unset threads are the physical cores (llama.cpp's
        rule), unset threads_batch is threads."""
        from stdengine.engines import physical_cores

        threads = options.threads or physical_cores()
        return threads, options.threads_batch or threads

    @classmethod
    def decided_defaults(cls, options: Options) -> dict[str, Any]:
        out = super().decided_defaults(options)
        threads, threads_batch = cls.thread_counts(options)
        if options.threads is None:
            out["threads"] = threads
        if options.threads_batch is None:
            out["threads_batch"] = threads_batch
        return out

    # --- chat templates --------------------------------------------------------------------
    def has_chat_template(self) -> bool:
        return bool(self.template)

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True, **variables: Any
    ) -> str:
        if not self.template:
            raise InvalidRequest("this model has no chat template", hint="pass one with --chat-template")
        return render_chat_template(
            self.template,
            messages,
            bos_token=self.token_text(self.bos_id) if self.bos_id is not None else "",
            eos_token=self.token_text(self.eos_id) if self.eos_id is not None else "",
            add_generation_prompt=add_generation_prompt,
            **variables,
        )

    # --- generation ------------------------------------------------------------------------
    def generate(self, request: GenerateRequest) -> Iterator[GenerationEvent]:
        """generation(), its evaluations done here, one at a time."""
        steps = self.generation(request)
        try:
            error: BaseException | None = None
            while True:
                try:
                    item = next(steps) if error is None else steps.throw(error)
                except StopIteration:
                    return
                error = None
                if isinstance(item, Evaluate):
                    try:
                        self._evaluate(item.tokens)
                    except BaseException as e:  # raised where generation() asked for it
                        error = e
                else:
                    yield item
        finally:
            steps.close()

    def generation(self, request: GenerateRequest) -> Generator[GenerationStep, None, None]:
        """generate()'s events, with an Evaluate wherever tokens must be evaluated: the
        scheduler of `infer serve` (stdengine.batching) drives the generations of several
        contexts this way and evaluates their tokens together."""
        s = request.sampling
        want_logprobs = check_logprobs(request.logprobs)
        if request.prompt_tokens is not None:
            validate_sampling(s)
            prompt = check_token_ids(request.prompt_tokens, self.n_vocab)
            if not prompt:
                raise InvalidRequest("the prompt is empty", hint="give the model some tokens to complete")
        else:
            prompt = request_tokens(self, request, self.bos_id, self.add_bos)
        self.check_fits(len(prompt), generating=True)
        constraint = self._matcher(request)
        # a sampler that reads no logits itself (no log-probabilities, no constraint's mask)
        self._plan_sample(s if want_logprobs is None and constraint is None else None)
        self._progress: tuple[int, float, float, int] | None = None
        t0 = now_ms()
        reproducible = s.temp <= 0 or s.seed != -1
        try:
            prompt_n = yield from self._prefill(prompt, reuse=self.batch_invariant or not reproducible)
        except BaseException:
            self._plan_sample(None)  # no sample follows
            raise
        t1 = now_ms()
        self._progress = (prompt_n, t1 - t0, t1, 0)  # prompt_n, prompt_ms, start of generation, n_gen
        pt = Timings(prompt_n=prompt_n, prompt_ms=t1 - t0).to_dict()
        self.events.debug(
            "prompt.evaluated",
            prompt_n=prompt_n,
            prompt_ms=round(t1 - t0, 3),
            prompt_per_second=round(float(pt["prompt_per_second"]), 2),
            prompt_tokens=len(prompt),  # the prompt's length; prompt_n omits a reused prefix
        )
        stops = StopMatcher(s.stop)
        text = self._text_stream()
        n_gen = 0
        finish: FinishReason = "length"
        matched: str | None = None
        samples = self._sample_tokens(s)
        try:
            while s.n_predict < 0 or n_gen < s.n_predict:
                # the distribution the token is drawn from, taken before the sampler sees it
                logits = self._last_logits() if want_logprobs is not None else None
                if constraint is not None:
                    # an end-of-generation token stays allowed only where the output is complete
                    constraint.apply(self._logits_buffer())
                # ignore_eos, min_tokens: the answer cannot end here
                self._forbid(self._eog_ids() if request.ignore_eos or n_gen < request.min_tokens else None)
                tok = next(samples)
                if self._is_eog(tok):
                    finish = "stop"
                    break
                if constraint is not None:
                    constraint.consume(tok)
                n_gen += 1
                self._progress = (prompt_n, t1 - t0, t1, n_gen)
                piece = text.push(tok)
                # a stop string may end only after the first min_tokens tokens (it may begin in them)
                delta, matched = stops.feed(piece, may_stop=n_gen > request.min_tokens)
                event = TokenEvent(tok, delta)
                if logits is not None and want_logprobs is not None:
                    self._add_logprobs(event, logits, want_logprobs)
                yield event
                if matched is not None or (constraint is not None and constraint.done):
                    finish = "stop"
                    break
                if len(self.tokens) >= self.n_ctx():
                    break  # the context is full: finish with "length"
                if s.n_predict >= 0 and n_gen >= s.n_predict:
                    break
                yield Evaluate([tok])
        finally:
            samples.close()
            self._forbid(None)
            self._plan_sample(None)
        if matched is None:
            tail = stops.feed(text.flush())[0] + stops.flush()
            if tail:
                yield TokenEvent(-1, tail)
        t2 = now_ms()
        yield DoneEvent(
            finish_reason=finish,
            stop=matched,
            usage=Usage(prompt_tokens=len(prompt), completion_tokens=n_gen),
            timings=Timings(prompt_n=prompt_n, prompt_ms=t1 - t0, predicted_n=n_gen, predicted_ms=t2 - t1),
        )

    def _matcher(self, request: GenerateRequest) -> Matcher | None:
        """The request's constraint compiled against this model's vocabulary, or None."""
        if request.constraint is None:
            return None
        from stdengine.structured import Matcher, check_constraint, tokenizer_for

        check_constraint(self, request)
        return Matcher(tokenizer_for(self._vocab_owner(), self._vocabulary), request.constraint, self.n_vocab)

    def _eog_ids(self) -> np.ndarray:
        """The ids of the end-of-generation tokens, found once per model: the contexts of one
        loaded model share its _vocab_owner(), and the scan of the vocabulary with it."""
        owner = self._vocab_owner()
        ids = _EOG_IDS.get(owner)
        if ids is None:
            ids = _EOG_IDS[owner] = np.array(
                [t for t in range(self.n_vocab) if self._is_eog(t)], dtype=np.int64
            )
        return ids

    def _add_logprobs(self, event: TokenEvent, logits: np.ndarray, n: int) -> None:
        lp = log_softmax(logits)
        event.token = token_logprob(self, event.id, float(lp[event.id]))
        event.logprob = event.token.logprob
        event.top_logprobs = top_logprobs(self, lp, n)

    def score_prompt(self, tokens: Sequence[int], top_n: int) -> PromptLogprobs:
        """As the default, but the context keeps the scored tokens afterwards, so that generating
        after them (an echoed completion) reuses them instead of evaluating them again."""
        self.reset()
        try:
            return score_by_decode(self, tokens, top_n)
        except BaseException:
            self.reset()
            raise

    def partial_timings(self) -> Timings | None:
        progress = getattr(self, "_progress", None)
        if progress is None:
            return None  # no generation yet, or its prompt is still being evaluated
        prompt_n, prompt_ms, t1, n_gen = progress
        return Timings(prompt_n=prompt_n, prompt_ms=prompt_ms, predicted_n=n_gen, predicted_ms=now_ms() - t1)

    def check_fits(self, n: int, *, generating: bool = False) -> None:
        """ContextOverflow unless n tokens fit the context (one more when generating after them)."""
        if n + generating > self.n_ctx():
            need = " and at least one more to generate" if generating else ""
            raise ContextOverflow(
                f"the prompt has {n} tokens{need}, but the context holds {self.n_ctx()}",
                hint="shorten the prompt or raise --ctx-size",
                n_prompt_tokens=n,
                n_ctx=self.n_ctx(),
            )

    def _prefill(self, prompt: list[int], reuse: bool = True) -> Generator[Evaluate, None, int]:
        """Evaluate the prompt, reusing the longest prefix the KV cache already holds (none unless
        reuse); returns the number of tokens evaluated (llama.cpp's prompt_n)."""
        common = 0
        for a, b in zip(self.tokens if reuse else [], prompt, strict=False):
            if a != b:
                break
            common += 1
        common = min(common, len(prompt) - 1)  # always evaluate the last token, for its logits
        common = self._keep_prefix(common)
        todo = prompt[common:]
        yield Evaluate(todo)
        return len(todo)

    # --- hooks -----------------------------------------------------------------------------
    def token_text(self, token: int) -> str:
        """The text of a (special) token, for the template's bos_token / eos_token."""
        raise NotImplementedError

    def token_bytes(self, token: int) -> bytes:
        """The token's piece (special tokens rendered), for log-probabilities."""
        raise NotImplementedError

    def _last_logits(self) -> np.ndarray:
        """A copy of the last evaluated token's logits."""
        raise NotImplementedError

    def _logits_buffer(self) -> np.ndarray:
        """The last token's logits where the sampler reads them (a writable view, no copy): a
        constraint masks them in place before each sample."""
        raise NotImplementedError

    def _forbid(self, ids: np.ndarray | None) -> None:
        """The next sample must not pick these tokens (None: any may be picked). By default their
        logits are set to -inf in _logits_buffer(); an engine whose sampler takes a list of
        banned tokens may pass it instead (the reference engine: its screened head keeps working)."""
        if ids is not None:
            self._logits_buffer()[ids] = -np.inf

    def _plan_sample(self, s: SamplingParams | None) -> None:
        """The samples of the generation starting (None: it has ended, or it reads the logits):
        an engine whose shared steps can leave a sampler only what it needs may prepare for them.
        By default nothing."""

    def _vocabulary(self) -> Vocabulary:
        """The vocabulary as a constraint's mask needs it (built once per _vocab_owner())."""
        raise NotImplementedError

    def _vocab_owner(self) -> object:
        """The object whose lifetime the compiled vocabulary shares: contexts on one loaded model
        (new_context) share it."""
        return self

    def _keep_prefix(self, n: int) -> int:
        """Forget cached positions from n on (self.tokens too); return how many were kept."""
        raise NotImplementedError

    def _evaluate(self, tokens: list[int]) -> None:
        """Append tokens to the context (and to self.tokens); the last one's logits are kept."""
        raise NotImplementedError

    def _evaluate_batch(self, items: list[tuple[LocalEngine, list[int]]]) -> None:
        """Evaluate each (context, tokens) item as its context's _evaluate would; the contexts are
        this engine's new_context() family. The default is a loop of _evaluate calls; an engine
        with the `batch_decode` capability evaluates them in shared forward passes (the weights
        read once per pass), with every context's logits and cache bit-identical to evaluating it
        alone, and on an error evaluates nothing."""
        for ctx, tokens in items:
            ctx._evaluate(tokens)

    def _sample_tokens(self, s: SamplingParams) -> Generator[int, None, None]:
        """Sample from the last logits each time it is asked; closed when generation ends."""
        raise NotImplementedError

    def _is_eog(self, token: int) -> bool:
        raise NotImplementedError

    def _text_stream(self) -> TextStream:
        raise NotImplementedError
