"""The engine checks: tokenizer, logits, batch, generation, chat and errors.

`plan(ctx)` lists every check with its ID; the golden data decides the parameters (one
tokenizer check per corpus case, one logits check per text). spec/conformance.md describes each
check, its level and its bound; keep the two in step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
from stdengine.conformance import corpus, metrics
from stdengine.conformance.cases import (
    FFFD,
    GREEDY_SEEDS,
    GREEDY_TEMP,
    all_cases,
    eog_answer_tokens,
    eog_texts,
    find_case,
    first_difference,
    least_greedy_raw_case,
)
from stdengine.conformance.suite import Check, Context, Level, NotSupported, Outcome, Skip

from stdengine.adapter import DoneEvent, GenerateRequest, SamplingParams, TokenEvent
from stdengine.errors import ContextOverflow, InvalidRequest, UsageError

# Batch invariance: the logits of a token may differ between ways of batching only by float
# rounding (different kernels for different batch shapes). The mean KL between the one-batch
# distribution and the other may be at most the KL bound of the logits checks for the same text
# (a batching mode may move the distribution no further than an engine may be from the exact
# math), and the top token must agree at every position where the one-batch distribution is
# confident (top-1 ahead of top-2 by CONFIDENT_MARGIN nats). A position bug at a chunk boundary
# (a wrong RoPE position, a lost KV entry) gives KLs of 0.1 and more, far above the bound.
BATCH_TIE_MARGIN = 0.1  # generation.greedy.logits: a near tie between the top two logits
ODD_CHUNKS = (7, 1, 13, 5, 11, 3)  # cycled: odd sizes that straddle every ubatch boundary
TOKEN_BY_TOKEN_N = 40  # tokens evaluated one at a time (slow engines: keep small)

GEN_N = 32  # tokens of the greedy continuation the generation checks build on (without golden data)
# generation.exact: a generated token may be this far (nats) below the exact top-1 log-probability;
# float noise and activation quantization move a correct engine's log-probabilities by about 0.1
EXACT_TIE_MARGIN = 0.3


# --- helpers ------------------------------------------------------------------------------------
def run_generate(engine: Any, request: GenerateRequest) -> tuple[list[int], str, DoneEvent]:
    """Drain generate(): the token ids, the text, the DoneEvent. Enforces the event protocol."""
    ids: list[int] = []
    parts: list[str] = []
    done: DoneEvent | None = None
    for ev in engine.generate(request):
        if done is not None:
            raise AssertionError("generate() yielded an event after its DoneEvent")
        if isinstance(ev, TokenEvent):
            if ev.id >= 0:
                ids.append(ev.id)
            parts.append(ev.text)
        elif isinstance(ev, DoneEvent):
            done = ev
        else:
            raise AssertionError(f"generate() yielded {type(ev).__name__}, not TokenEvent/DoneEvent")
    if done is None:
        raise AssertionError("generate() ended without a DoneEvent")
    return ids, "".join(parts), done


def greedy(n: int = GEN_N, **kw: Any) -> SamplingParams:
    return SamplingParams(temp=0.0, n_predict=n, seed=1, **kw)


def first_raw_case(ctx: Context) -> dict[str, Any] | None:
    return next((c for c in all_cases(ctx) if c["kind"] == "raw"), None)


def completion_prompt(ctx: Context) -> str:
    """The prompt the generation checks share. With golden data it is the first raw golden case,
    whose exact greedy continuation has a margin of 1 nat or more at every step: so comparing two
    requests token by token is fair to an engine whose paths (prompt cache or not) differ by float
    noise. Without golden data, the corpus prompt."""
    case = first_raw_case(ctx)
    return str(case["prompt"]) if case else corpus.COMPLETION_PROMPT


def gen_n(ctx: Context) -> int:
    case = first_raw_case(ctx)
    return len(case["ids"]) if case else GEN_N


def greedy_reference(ctx: Context) -> tuple[list[int], str, DoneEvent]:
    """The engine's own greedy continuation of the completion prompt (shared by several checks)."""
    return ctx.memo(
        "greedy",
        lambda: run_generate(
            ctx.engine, GenerateRequest(prompt=completion_prompt(ctx), sampling=greedy(gen_n(ctx)))
        ),
    )


def engine_logits(ctx: Context, ids: list[int], chunks: tuple[int, ...] | None = None) -> np.ndarray:
    """All-token logits of ids from a fresh context: one decode call, or calls of the given sizes
    (cycled), as float64 (T, n_vocab)."""
    engine = ctx.engine
    engine.reset()
    if chunks is None:
        out = np.asarray(engine.decode(ids, all_logits=True), dtype=np.float64)
    else:
        rows, i, k = [], 0, 0
        while i < len(ids):
            n = chunks[k % len(chunks)]
            chunk = ids[i : i + n]
            rows.append(
                np.asarray(engine.decode(chunk, all_logits=True), dtype=np.float64).reshape(len(chunk), -1)
            )
            i += n
            k += 1
        out = np.concatenate(rows, axis=0)
    engine.reset()
    if out.shape[0] != len(ids):
        raise AssertionError(f"decode(all_logits=True) returned {out.shape[0]} rows for {len(ids)} tokens")
    return out


# --- tokenizer ----------------------------------------------------------------------------------
def tokenizer_ids(name: str) -> Callable[[Context, Outcome], None]:
    def check(ctx: Context, out: Outcome) -> None:
        cases = [c for c in ctx.need_golden("tokenizer")["cases"] if c["name"] == name]
        for c in cases:
            got = ctx.engine.tokenize(
                c["text"], add_special=c["add_special"], parse_special=c["parse_special"]
            )
            got = [int(i) for i in got]
            flags = f"add_special={int(c['add_special'])},parse_special={int(c['parse_special'])}"
            if got == c["ids"]:
                out.add("pass", f"{len(got)} ids match ({flags})")
            else:
                at = next(
                    (i for i, (a, b) in enumerate(zip(got, c["ids"], strict=False)) if a != b),
                    min(len(got), len(c["ids"])),
                )
                out.add(
                    "fail",
                    f"ids differ from llama.cpp's at index {at} ({flags}): "
                    f"got {got[max(0, at - 2) : at + 3]}, want {c['ids'][max(0, at - 2) : at + 3]}",
                )
                out.details.setdefault("mismatches", []).append(
                    {"flags": flags, "got": got, "want": c["ids"]}
                )

    return check


def tokenizer_roundtrip(name: str) -> Callable[[Context, Outcome], None]:
    def check(ctx: Context, out: Outcome) -> None:
        text = next(c["text"] for c in ctx.need_golden("tokenizer")["cases"] if c["name"] == name)
        ids = ctx.engine.tokenize(text, add_special=False, parse_special=False)
        back = ctx.engine.detokenize(ids)
        out.expect(
            back == text,
            f"detokenize(tokenize(x)) == x for {len(ids)} tokens"
            if back == text
            else f"detokenize(tokenize(x)) gave {back!r}, want {text!r}",
        )

    return check


# --- logits -------------------------------------------------------------------------------------
def _golden_text(ctx: Context, name: str) -> dict[str, Any]:
    texts = ctx.need_golden("logits")["texts"]
    return next(t for t in texts if t["name"] == name)


def _text_logits(ctx: Context, name: str) -> np.ndarray:
    t = _golden_text(ctx, name)
    return ctx.memo(f"logits:{name}", lambda: engine_logits(ctx, t["ids"]))


def logits_kl(name: str) -> Callable[[Context, Outcome], None]:
    def check(ctx: Context, out: Outcome) -> None:
        lg = ctx.need_golden("logits")
        texts = lg["texts"] if name == "all" else [_golden_text(ctx, name)]
        d = metrics.distance(texts, [_text_logits(ctx, t["name"]) for t in texts])
        ref = lg["llama_cpp"]["all"] if name == "all" else lg["llama_cpp"]["by_text"][name]
        bound = metrics.kl_bound(ref["kl_mean"])
        out.details.update(engine=d.to_dict(), llama_cpp=ref, bound=round(bound, 6))
        out.expect(
            d.kl_mean <= bound,
            f"mean KL {d.kl_mean:.5f} over {d.n_positions} positions "
            f"(bound {bound:.5f}; llama.cpp {ref['kl_mean']:.5f})",
        )
        if not np.isfinite(d.kl_mean):
            out.add("fail", "logits are not finite")

    return check


def logprobs_kl(ctx: Context, out: Outcome) -> None:
    """For an engine that serves log-probabilities but no logits (the `openai` engine): the
    restricted KL of its top-20 lists (engine.score) over every golden text, by token text as a
    server serves them (metrics.restricted_kl_by_text), within the logits.kl bound."""
    lg = ctx.need_golden("logits")
    pieces = (ctx.golden or {}).get("pieces") or {}
    kls = []
    for t in lg["texts"]:
        rows = ctx.engine.score(t["ids"], 20)
        for ids, lps, tail, top in zip(t["top_ids"], t["top_logprobs"], t["tail_logprob"], rows, strict=True):
            served = {e.token: e.logprob for e in top}
            kls.append(metrics.restricted_kl_by_text(ids, lps, tail, pieces, served, 20))
    ref = lg["llama_cpp"]["all"]
    bound = metrics.kl_bound(ref["kl_mean"])
    mean = float(np.mean(kls))
    out.details.update(kl_mean=mean, n_positions=len(kls), llama_cpp=ref, bound=bound)
    out.expect(
        mean <= bound,
        f"mean KL of the served top-20 {mean:.5f} over {len(kls)} positions (bound {bound:.5f}; "
        f"llama.cpp {ref['kl_mean']:.5f})",
    )


def logits_top1(ctx: Context, out: Outcome) -> None:
    lg = ctx.need_golden("logits")
    texts = lg["texts"]
    d = metrics.distance(texts, [_text_logits(ctx, t["name"]) for t in texts])
    ref = lg["llama_cpp"]["all"]
    ref_miss = 1.0 - ref["top1_agreement"]
    bound = metrics.top1_miss_bound(ref_miss)
    miss = 1.0 - d.top1_agreement
    out.details.update(engine=d.to_dict(), llama_cpp=ref, miss_bound=round(bound, 6))
    out.expect(
        miss <= bound,
        f"top-1 agrees on {d.n_confident - d.top1_misses}/{d.n_confident} confident "
        f"positions (miss rate {miss:.4f}, bound {bound:.4f}; llama.cpp {ref_miss:.4f})",
    )


def logits_stable(ctx: Context, out: Outcome) -> None:
    """decode()'s arrays belong to the caller: later calls (and reset()) leave them as they were."""
    engine = ctx.engine
    ids = engine.tokenize(completion_prompt(ctx), add_special=True, parse_special=True)[:16]
    if len(ids) < 2:
        raise Skip("the completion prompt is a single token")
    kept: list[tuple[str, np.ndarray, np.ndarray]] = []  # what, the array returned, a copy made at once
    shared: list[str] = []

    def call(what: str, tokens: list[int], all_logits: bool = False) -> None:
        got = np.asarray(engine.decode(tokens, all_logits=all_logits))
        shared.extend(f"{what} and {w}" for w, earlier, _ in kept if np.shares_memory(got, earlier))
        kept.append((what, got, got.copy()))

    engine.reset()
    call(f"decode({len(ids) - 1} tokens)", ids[:-1])
    call("decode(1 token, all_logits=True)", ids[-1:], all_logits=True)
    call("decode(1 more token)", ids[:1])
    engine.reset()
    call("decode(1 token) after reset()", ids[:1])
    engine.reset()
    changed = [
        f"{what} (by up to {np.nanmax(np.abs(got - copy)):.4g})"
        for what, got, copy in kept
        if not np.array_equal(got, copy, equal_nan=True)
    ]
    out.expect(
        not shared,
        "each decode() returns an array of its own"
        + (f"; sharing memory: {'; '.join(shared)}" if shared else ""),
    )
    out.expect(
        not changed,
        f"the logits of {len(kept)} decode() calls are unchanged by the later calls"
        + (f"; changed: {'; '.join(changed)}" if changed else ""),
    )
    if shared or changed:
        out.details["hint"] = "return a new array from each decode(), not the engine's logits buffer"


# --- batch invariance ---------------------------------------------------------------------------
def _compare_batches(ctx: Context, base: np.ndarray, other: np.ndarray, what: str, out: Outcome) -> None:
    lp, lq = metrics.log_softmax(base), metrics.log_softmax(other)
    kl = (np.exp(lp) * (lp - lq)).sum(axis=-1)
    srt = np.sort(lp, axis=-1)
    clear = (srt[:, -1] - srt[:, -2]) >= metrics.CONFIDENT_MARGIN
    flips = int(((base.argmax(-1) != other.argmax(-1)) & clear).sum())
    ref = ctx.need_golden("logits")["llama_cpp"]["by_text"]["prose"]["kl_mean"]
    bound = metrics.kl_bound(ref)
    out.details[what] = {
        "kl_max": float(kl.max()),
        "kl_mean": float(kl.mean()),
        "top1_flips": flips,
        "bound": bound,
    }
    out.expect(
        bool(kl.mean() <= bound),
        f"{what}: mean KL from one batch {kl.mean():.2e}, max {kl.max():.2e} (bound on the mean {bound:.2e})",
    )
    out.expect(flips == 0, f"{what}: top token changed at {flips} confident positions")


def batch_ubatch(ctx: Context, out: Outcome) -> None:
    ids = _golden_text(ctx, "prose")["ids"]
    base = _text_logits(ctx, "prose")
    _compare_batches(
        ctx, base, engine_logits(ctx, ids, ODD_CHUNKS), f"decode() calls of sizes {ODD_CHUNKS}", out
    )


def batch_token(ctx: Context, out: Outcome) -> None:
    ids = _golden_text(ctx, "prose")["ids"][:TOKEN_BY_TOKEN_N]
    base = _text_logits(ctx, "prose")[: len(ids)]
    _compare_batches(ctx, base, engine_logits(ctx, ids, (1,)), "token by token", out)


# --- generation ---------------------------------------------------------------------------------
def gen_determinism(ctx: Context, out: Outcome) -> None:
    ids1, text1, _ = greedy_reference(ctx)
    ids2, text2, _ = run_generate(
        ctx.engine, GenerateRequest(prompt=completion_prompt(ctx), sampling=greedy(gen_n(ctx)))
    )
    out.expect(
        ids1 == ids2 and text1 == text2,
        "two greedy runs give the same tokens"
        if ids1 == ids2
        else f"greedy runs differ: {text1!r} vs {text2!r}",
    )


def _same_as_greedy(label: str, sampling: SamplingParams) -> Callable[[Context, Outcome], None]:
    def check(ctx: Context, out: Outcome) -> None:
        ids1, text1, _ = greedy_reference(ctx)
        s = dataclasses.replace(sampling, n_predict=gen_n(ctx))
        ids2, text2, _ = run_generate(ctx.engine, GenerateRequest(prompt=completion_prompt(ctx), sampling=s))
        out.expect(
            ids1 == ids2,
            f"{label} gives the greedy tokens"
            if ids1 == ids2
            else f"{label} gave {text2!r}, greedy gave {text1!r}",
        )

    return check


def gen_greedy_logits(ctx: Context, out: Outcome) -> None:
    """Greedy generation follows the argmax of the engine's own decode() logits."""
    ids, text, _ = greedy_reference(ctx)
    engine = ctx.engine
    prompt = engine.tokenize(completion_prompt(ctx), add_special=True, parse_special=True)
    engine.reset()
    logits = np.asarray(engine.decode(prompt), dtype=np.float64).reshape(-1)
    for i, tok in enumerate(ids):
        top = np.argsort(logits)[-2:]
        want = int(top[-1])
        if tok != want:
            margin = float(logits[top[-1]] - logits[top[-2]])
            if int(top[-2]) == tok and margin < BATCH_TIE_MARGIN:
                out.add("warn", f"token {i}: generated the runner-up of a near tie (margin {margin:.3f})")
            else:
                out.add("fail", f"token {i}: generated {tok}, argmax of decode() logits is {want}")
            break
        logits = np.asarray(engine.decode([tok]), dtype=np.float64).reshape(-1)
    engine.reset()
    out.add("pass", f"{len(ids)} greedy tokens follow the argmax of decode()")


def gen_max_tokens(n: int) -> Callable[[Context, Outcome], None]:
    def check(ctx: Context, out: Outcome) -> None:
        full, full_text, full_done = greedy_reference(ctx)
        if full_done.usage.completion_tokens < n:
            raise Skip(
                f"the greedy continuation ends after {full_done.usage.completion_tokens} tokens, before {n}"
            )
        ids, text, done = run_generate(
            ctx.engine, GenerateRequest(prompt=completion_prompt(ctx), sampling=greedy(n))
        )
        out.expect(done.finish_reason == "length", f"finish_reason {done.finish_reason!r} (want 'length')")
        out.expect(
            done.usage.completion_tokens == n, f"usage.completion_tokens {done.usage.completion_tokens}"
        )
        if full:  # the engine reports token ids
            out.expect(len(ids) == n, f"{len(ids)} tokens generated for n_predict={n}")
            out.expect(ids == full[:n], "the tokens are the greedy continuation's first n")
        else:  # a black box: its text must begin the longer answer's
            out.expect(
                bool(text) and full_text.startswith(text),
                "the text begins the greedy continuation"
                + ("" if full_text.startswith(text) else f": {text!r}"),
            )

    return check


def _spanning_stop(ctx: Context) -> tuple[str, list[str], int, str, int]:
    """A stop string that spans a token boundary of a greedy text: the string, the text's token
    texts, the string's start, the prompt and the token count. The prompts tried are the raw golden
    cases, shortest first (no near ties), then the corpus prompt (no golden data)."""
    raw = sorted((c for c in all_cases(ctx) if c["kind"] == "raw"), key=lambda c: len(c["prompt_ids"]))
    prompts = [(c["prompt"], len(c["ids"])) for c in raw] or [(corpus.COMPLETION_PROMPT, GEN_N)]
    for prompt, n in prompts:
        pieces = ctx.memo(f"greedy_pieces:{prompt}", lambda p=prompt, k=n: _greedy_pieces(ctx, p, k))
        text = "".join(pieces)
        pos = 0
        for i, p in enumerate(pieces[:-1]):
            pos += len(p)
            if i < 3:
                continue
            left, right = pieces[i].rstrip(), pieces[i + 1]
            if len(left) >= 2 and len(right.strip()) >= 2 and left == pieces[i]:
                stop = left[-2:] + right[:2]
                start = pos - 2
                if text.find(stop) == start:
                    return stop, pieces, start, prompt, n
    raise Skip("no stop string spanning two tokens found in the greedy texts")


def _greedy_pieces(ctx: Context, prompt: str, n: int) -> list[str]:
    pieces = []
    for ev in ctx.engine.generate(GenerateRequest(prompt=prompt, sampling=greedy(n))):
        if isinstance(ev, TokenEvent):
            pieces.append(ev.text)
    return pieces


def gen_stop(n_strings: int) -> Callable[[Context, Outcome], None]:
    def check(ctx: Context, out: Outcome) -> None:
        stop, pieces, start, prompt, n = _spanning_stop(ctx)
        text = "".join(pieces)
        stops = [stop]
        if n_strings > 1:
            # one string that never occurs, and later words: the earliest occurrence must win
            # whatever the order of the list
            later = [
                w
                for w in text[start + len(stop) :].split()
                if len(w) >= 3 and w not in text[: start + len(stop)]
            ]
            stops = ["\u2603never-occurs\u2603", *later[: n_strings - 2], stop][:n_strings]
            while len(stops) < n_strings:
                stops.insert(0, f"\u2603absent{len(stops)}\u2603")
        ids, got, done = run_generate(
            ctx.engine, GenerateRequest(prompt=prompt, sampling=greedy(n, stop=stops))
        )
        want = text[:start]
        out.details.update(stops=stops, want=want, got=got)
        out.expect(
            got == want,
            "the text ends just before the stop string" if got == want else f"text {got!r}, want {want!r}",
        )
        out.expect(stop not in got, "the stop string is not in the text")
        out.expect(done.finish_reason == "stop", f"finish_reason {done.finish_reason!r} (want 'stop')")
        out.expect(done.stop == stop, f"DoneEvent.stop {done.stop!r} (want {stop!r})")

    return check


def gen_eog(ctx: Context, out: Outcome) -> None:
    eog = ctx.need_golden("eog")
    case = eog.get("case")
    if not case:
        raise Skip("the golden data has no prompt that ends with an end-of-generation token")
    limit = 16
    ids, text, done = run_generate(ctx.engine, GenerateRequest(prompt=case["prompt"], sampling=greedy(limit)))
    out.details.update(ids=ids, text=text, llama_cpp=case["llama_cpp_greedy"])
    out.expect(
        done.finish_reason == "stop" and done.stop is None,
        f"finish_reason {done.finish_reason!r}, stop {done.stop!r} (want 'stop' from an end-of-generation token)",
    )
    eog_ids = set(eog["ids"])
    out.expect(not (set(ids) & eog_ids), "no end-of-generation token among the generated tokens")
    out.expect(len(ids) < limit, f"{len(ids)} tokens before the end of generation")
    leaked = [t for t in eog_texts(ctx) if t in text]
    out.expect(
        not leaked, "no end-of-generation text in the answer" + (f" (found {leaked})" if leaked else "")
    )
    n = eog_answer_tokens(case)
    out.expect(
        done.usage.completion_tokens == n,
        f"usage.completion_tokens {done.usage.completion_tokens} (want {n}: the end-of-generation token is not counted)",
    )


def gen_seed(ctx: Context, out: Outcome) -> None:
    """Sampling at temperature 1 over the whole vocabulary, from a prompt with near ties (the
    corpus prompt, not a golden case): different seeds must give different samples."""

    def sample(seed: int) -> str:
        s = SamplingParams(temp=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed, n_predict=16)
        return run_generate(ctx.engine, GenerateRequest(prompt=corpus.COMPLETION_PROMPT, sampling=s))[1]

    a, b = sample(1234), sample(1234)
    others = {sample(seed) for seed in (4321, 99, 7)}
    out.details.update(seed_1234=a, other_seeds=sorted(others))
    out.expect(
        a == b, "the same seed gives the same tokens" if a == b else f"seed 1234 gave {a!r}, then {b!r}"
    )
    out.expect(
        bool(others - {a}),
        "different seeds give different samples"
        if others - {a}
        else f"seeds 1234, 4321, 99 and 7 all gave the same sample {a!r}",
    )


# --- golden generation: every correct engine reproduces these exactly -----------------------------
def request_of(case: dict[str, Any], sampling: SamplingParams) -> GenerateRequest:
    if case["kind"] == "chat":
        return GenerateRequest(messages=case["messages"], sampling=sampling)
    return GenerateRequest(prompt=case["prompt"], sampling=sampling)


def expect_golden_text(ctx: Context, out: Outcome, case: dict[str, Any], text: str, what: str) -> None:
    want = case["text"]
    out.expect(
        text == want,
        f"{what}: the exact reference's {len(case['ids'])}-token greedy text"
        if text == want
        else f"{what}: {first_difference(text, want)}",
    )
    out.expect(FFFD not in text, f"{what}: no U+FFFD (bytes of a character decoded apart)")
    leaked = [t for t in eog_texts(ctx) if t in text]
    out.expect(not leaked, f"{what}: no end-of-generation text" + (f" (found {leaked})" if leaked else ""))


def _fits(ctx: Context, case: dict[str, Any]) -> None:
    try:
        n_ctx = int(ctx.engine.n_ctx())
    except NotImplementedError:
        return
    need = len(case["prompt_ids"]) + len(case["ids"])
    if n_ctx < need:
        raise Skip(f"the case needs {need} positions, the context holds {n_ctx}: load with -c {need}")


def gen_golden(name: str) -> Callable[[Context, Outcome], None]:
    def check(ctx: Context, out: Outcome) -> None:
        case = find_case(ctx, name)
        _fits(ctx, case)
        n = len(case["ids"])
        ids, text, done = run_generate(ctx.engine, request_of(case, greedy(n)))
        out.details.update(want=case["text"], got=text)
        expect_golden_text(ctx, out, case, text, "the text")
        if ids:
            out.expect(ids == case["ids"], "the token ids are the golden ids")
        u = done.usage
        out.expect(
            u.prompt_tokens == len(case["prompt_ids"]),
            f"usage.prompt_tokens {u.prompt_tokens} (the prompt has {len(case['prompt_ids'])} tokens)",
        )
        out.expect(u.completion_tokens == n, f"usage.completion_tokens {u.completion_tokens} (want {n})")
        out.expect(done.finish_reason == "length", f"finish_reason {done.finish_reason!r} (want 'length')")
        if "tokenize" in ctx.capabilities and ids:
            back = ctx.engine.detokenize(ids)
            out.expect(back == text, "the text is detokenize(ids)" + ("" if back == text else f": {back!r}"))
        if case["kind"] == "chat" and case.get("system_changes_answer"):
            out.add("pass", "the system message is part of the prompt (without it the answer differs)")

    return check


def gen_exact(ctx: Context, out: Outcome) -> None:
    """Tie-aware: the engine's own greedy continuation of a prompt with near ties, judged step by
    step by the exact reference (teacher forcing): each token must be within EXACT_TIE_MARGIN of
    the exact top-1. An engine may take either side of a near tie, never a clearly worse token."""
    if ctx.model_path is None or not ctx.model_path.is_file():
        raise Skip("the model file is not at hand (the exact reference needs it)")
    prompt = corpus.COMPLETION_PROMPT
    ids, text, _ = run_generate(ctx.engine, GenerateRequest(prompt=prompt, sampling=greedy(GEN_N)))
    if "tokenize" in ctx.capabilities:
        prompt_ids = ctx.engine.tokenize(prompt, add_special=True, parse_special=True)
    else:
        prompt_ids = (ctx.golden or {}).get("completion", {}).get("prompt_ids")
    if not ids and text:  # a black box: its text, tokenized by the model file's own tokenizer
        ids = _retokenized(ctx.model_path, prompt, text)
    if not ids or prompt_ids is None:
        raise Skip("the engine reports no token ids, and its text does not tokenize apart from the prompt")
    exact = exact_model(ctx)
    lp = metrics.log_softmax(exact.logits(list(prompt_ids) + ids, last=len(ids) + 1))[:-1]
    gaps = [float(row.max() - row[t]) for row, t in zip(lp, ids, strict=True)]
    out.details.update(gaps=[round(g, 3) for g in gaps], text=text)
    bad = [(i, g) for i, g in enumerate(gaps) if g > EXACT_TIE_MARGIN]
    out.expect(
        not bad,
        f"{len(ids)} greedy tokens are each within {EXACT_TIE_MARGIN} nats of the exact top-1 "
        f"(largest gap {max(gaps):.3f})"
        if not bad
        else f"token {bad[0][0]} is {bad[0][1]:.2f} nats below the exact top-1 "
        f"({len(bad)} tokens beyond {EXACT_TIE_MARGIN}): not a greedy continuation",
    )


def _retokenized(path: Any, prompt: str, text: str) -> list[int]:
    """The ids of text after prompt, as the model file's tokenizer (checked against llama.cpp by the
    tokenizer checks) cuts prompt + text; [] when that does not keep the prompt's own ids."""
    from stdengine.reference.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(str(path))
    head = list(tok.encode(prompt, add_special=True, parse_special=True))
    both = list(tok.encode(prompt + text, add_special=True, parse_special=True))
    return both[len(head) :] if both[: len(head)] == head else []


_EXACT: dict[str, Any] = {}  # the exact reference of a file, kept for the process (several runs)


def exact_model(ctx: Context) -> Any:
    from stdengine.conformance.exact import ExactModel

    assert ctx.model_path is not None
    key = str(ctx.model_path.resolve())
    if key not in _EXACT:
        _EXACT.clear()  # one model at a time: Gemma's weights take 2 GB in float64
        _EXACT[key] = ExactModel(ctx.model_path)
    return _EXACT[key]


def _sampler_is_greedy(label: str, **kw: Any) -> Callable[[Context, Outcome], None]:
    """A sampler setting that leaves only the top token (top_p 0.01, min_p 1) makes sampling at a
    high temperature greedy: the golden case's tokens, whatever the seed. The case and the seeds
    leave an engine that ignores the setting a small chance of passing (in the details)."""

    def check(ctx: Context, out: Outcome) -> None:
        case, chance = least_greedy_raw_case(ctx)
        out.details.update(case=case["name"], chance_if_ignored=f"{chance:.1e}")
        for seed in GREEDY_SEEDS:
            # only the sampler under test is set: an engine may refuse options it cannot honour
            s = dataclasses.replace(
                SamplingParams(temp=GREEDY_TEMP, seed=seed, n_predict=len(case["ids"])), **kw
            )
            _, text, _ = run_generate(ctx.engine, request_of(case, s))
            expect_golden_text(ctx, out, case, text, f"{label} at temp {GREEDY_TEMP}, seed {seed}")

    return check


def repetitive_case(ctx: Context) -> dict[str, Any]:
    """The raw golden case whose continuation repeats the most tokens of its prompt's last 64."""
    raw = [c for c in all_cases(ctx) if c["kind"] == "raw"]
    if not raw:
        raise Skip("the golden data has no raw generation case")
    return max(raw, key=lambda c: len(set(c["ids"]) & set(c["prompt_ids"][-64:])))


def gen_repeat_penalty(ctx: Context, out: Outcome) -> None:
    case = repetitive_case(ctx)
    s = greedy(len(case["ids"]))
    s.repeat_penalty, s.repeat_last_n = 1.5, 64
    _, text, _ = run_generate(ctx.engine, request_of(case, s))
    out.details.update(case=case["name"], greedy=case["text"], penalised=text)
    out.expect(
        text != case["text"],
        "repeat_penalty 1.5 changes a repetitive greedy answer"
        if text != case["text"]
        else f"repeat_penalty 1.5 left the repetitive greedy answer of {case['name']} unchanged",
    )


def gen_concurrent(ctx: Context, out: Outcome) -> None:
    """Contexts from new_context() are independent: generations interleaved token by token, each
    in its own context, give each golden answer, as the same request alone does."""
    cases = [c for c in all_cases(ctx) if len(c["prompt_ids"]) + len(c["ids"]) <= 512][:3]
    if len(cases) < 2:
        raise Skip("the golden data has fewer than two short generation cases")
    contexts = [ctx.engine.new_context() for _ in cases]
    if any(c is None for c in contexts):
        for c in contexts:
            if c is not None:
                c.close()
        raise NotSupported("new_context() returns None: the engine has one context")
    try:
        streams = [
            c.generate(request_of(case, greedy(len(case["ids"]))))
            for c, case in zip(contexts, cases, strict=True)
        ]
        texts = ["" for _ in cases]
        live = set(range(len(cases)))
        while live:
            for i in sorted(live):
                ev = next(streams[i], None)
                if ev is None:
                    live.discard(i)
                elif isinstance(ev, TokenEvent):
                    texts[i] += ev.text
        for case, text in zip(cases, texts, strict=True):
            expect_golden_text(
                ctx, out, case, text, f"{case['name']} interleaved with {len(cases) - 1} others"
            )
    finally:
        for c in contexts:
            if c is not None:
                c.close()


# --- chat ---------------------------------------------------------------------------------------
def chat_template(name: str, agp: bool) -> Callable[[Context, Outcome], None]:
    def check(ctx: Context, out: Outcome) -> None:
        chat = ctx.need_golden("chat")
        case = next(
            (c for c in chat["cases"] if c["name"] == name and c["add_generation_prompt"] == agp), None
        )
        if case is None:
            raise Skip("the model has no chat template")
        if not ctx.engine.has_chat_template():
            out.add("fail", "the model has a chat template but the engine says it has none")
            return
        got = ctx.engine.apply_chat_template(case["messages"], add_generation_prompt=agp)
        out.expect(
            got == case["text"],
            "the rendering matches" if got == case["text"] else f"rendered {got!r}, want {case['text']!r}",
        )

    return check


# --- errors -------------------------------------------------------------------------------------
def _expect_error(
    out: Outcome, what: str, kinds: tuple[type[BaseException], ...], fn: Callable[[], Any]
) -> None:
    names = "/".join(k.__name__ for k in kinds)
    try:
        fn()
    except kinds as e:
        out.add("pass", f"{what}: {type(e).__name__} ({getattr(e, 'code', '')})")
        return
    except Exception as e:
        out.add("fail", f"{what}: raised {type(e).__name__}: {e} (want {names})")
        return
    out.add("fail", f"{what}: no error (want {names})")


def _overflow_prompt(ctx: Context) -> str:
    try:
        n_ctx = int(ctx.engine.n_ctx())
    except NotImplementedError as e:
        raise Skip("the engine does not report n_ctx()") from e
    # about one token per word in every vocabulary; checked below when the engine can tokenize
    words = ["apple", "river", "stone", "cloud", "green"]
    text = " ".join(words[i % 5] for i in range(n_ctx + 64))
    if "tokenize" in ctx.capabilities and len(ctx.engine.tokenize(text)) <= n_ctx:
        raise Skip("could not build a prompt longer than the context")
    return text


def err_overflow_generate(ctx: Context, out: Outcome) -> None:
    text = _overflow_prompt(ctx)
    _expect_error(
        out,
        "generate() with a prompt longer than the context",
        (ContextOverflow,),
        lambda: run_generate(ctx.engine, GenerateRequest(prompt=text, sampling=greedy(4))),
    )
    _still_serves(ctx, out)


def err_overflow_decode(ctx: Context, out: Outcome) -> None:
    text = _overflow_prompt(ctx)
    ids = ctx.engine.tokenize(text)
    ctx.engine.reset()
    _expect_error(
        out,
        "decode() of more tokens than the context holds",
        (ContextOverflow,),
        lambda: ctx.engine.decode(ids),
    )
    ctx.engine.reset()
    _still_serves(ctx, out)


def err_empty(ctx: Context, out: Outcome) -> None:
    _expect_error(
        out,
        "an empty prompt",
        (InvalidRequest,),
        lambda: run_generate(ctx.engine, GenerateRequest(prompt="", sampling=greedy(4))),
    )
    _still_serves(ctx, out)


def err_option(name: str, value: Any) -> Callable[[Context, Outcome], None]:
    def check(ctx: Context, out: Outcome) -> None:
        # the stop string ends at once an engine that accepts the value (n_predict=-2 would
        # otherwise run to a full context)
        first = greedy_reference(ctx)[1][:4]
        s = greedy(4, stop=[first] if first.strip() else [])
        setattr(s, name, value)
        _expect_error(
            out,
            f"{name}={value!r}",
            (UsageError,),
            lambda: run_generate(ctx.engine, GenerateRequest(prompt=completion_prompt(ctx), sampling=s)),
        )
        _still_serves(ctx, out)

    return check


def _still_serves(ctx: Context, out: Outcome) -> None:
    """After an error the engine serves the next request as before."""
    ids, _, _ = greedy_reference(ctx)
    again, _, _ = run_generate(
        ctx.engine, GenerateRequest(prompt=completion_prompt(ctx), sampling=greedy(gen_n(ctx)))
    )
    out.expect(
        again == ids,
        "the next request is served normally"
        if again == ids
        else "the next request gave different tokens than before the error",
    )


# --- the plan -----------------------------------------------------------------------------------
def plan(ctx: Context) -> list[Check]:
    checks: list[Check] = []

    def add(
        id: str,
        level: Level,
        fn: Callable[[Context, Outcome], None],
        needs: tuple[str, ...] = (),
        description: str = "",
    ) -> None:
        checks.append(Check(id, level, fn, frozenset(needs), True, description))

    g = ctx.golden or {}
    names = sorted({c["name"] for c in g.get("tokenizer", {}).get("cases", [])}, key=_case_order(g))
    if not names:
        names = ["(golden)"]
    for name in names:
        add(
            f"tokenizer.ids:case={name}",
            "core",
            tokenizer_ids(name),
            ("tokenize",),
            "token ids equal llama.cpp's for the corpus case",
        )
    for name in names:
        add(
            f"tokenizer.roundtrip:case={name}",
            "core",
            tokenizer_roundtrip(name),
            ("tokenize",),
            "detokenize(tokenize(x)) == x",
        )

    texts = [t["name"] for t in g.get("logits", {}).get("texts", [])] or ["all"]
    for name in texts:
        add(
            f"logits.kl:text={name}",
            "core",
            logits_kl(name),
            ("logits",),
            "mean restricted KL from the exact reference within the bound",
        )
    if "all" not in texts:
        add("logits.kl:text=all", "core", logits_kl("all"), ("logits",), "the same over every text")
    add(
        "logits.top1:text=all",
        "core",
        logits_top1,
        ("logits",),
        "top-1 agreement with the exact reference on confident positions",
    )
    if "logits" not in ctx.capabilities:  # with logits, logits.kl judges the whole distribution
        add(
            "logprobs.kl:text=all",
            "core",
            logprobs_kl,
            ("logprobs",),
            "served top-20 log-probabilities (score) within the logits.kl bound",
        )
    add(
        "logits.stable",
        "core",
        logits_stable,
        ("logits", "tokenize"),
        "logits returned by decode() are not changed by later decode() calls",
    )
    add(
        "batch.invariance:mode=odd_chunks",
        "core",
        batch_ubatch,
        ("logits",),
        "decode() calls of odd sizes give the one-batch logits",
    )
    add(
        "batch.invariance:mode=token_by_token",
        "core",
        batch_token,
        ("logits",),
        "token-by-token decode() gives the one-batch logits",
    )

    add("generation.greedy.determinism", "core", gen_determinism, (), "two greedy runs agree")
    add(
        "generation.greedy.top_k1",
        "core",
        _same_as_greedy("top_k=1 at temp 0.8", SamplingParams(temp=0.8, top_k=1, n_predict=GEN_N, seed=7)),
        (),
        "top_k=1 equals greedy",
    )
    add(
        "generation.greedy.temp0",
        "core",
        _same_as_greedy(
            "temp=0 with top_k=40, top_p=0.5",
            SamplingParams(temp=0.0, top_k=40, top_p=0.5, n_predict=GEN_N, seed=7),
        ),
        (),
        "temperature 0 is greedy whatever the other samplers",
    )
    add(
        "generation.greedy.logits",
        "core",
        gen_greedy_logits,
        ("logits",),
        "greedy tokens are the argmax of decode() logits",
    )
    for n in (1, 7):
        add(f"generation.max_tokens:n={n}", "core", gen_max_tokens(n), (), "n_predict honoured exactly")
    for k in (1, 3):
        add(f"generation.stop:strings={k}", "core", gen_stop(k), (), "stop strings end generation")
    add("generation.eog", "core", gen_eog, (), "an end-of-generation token ends with 'stop'")
    add("generation.seed", "core", gen_seed, ("seed",), "a seed reproduces sampling; other seeds differ")
    for case in g.get("generation", {}).get("cases", []):
        add(
            f"generation.golden:case={case['name']}",
            "core",
            gen_golden(case["name"]),
            (),
            "greedy text, ids and usage equal the exact reference's (margins of 1 nat or more)",
        )
    add(
        "generation.exact:prompt=near_ties",
        "core",
        gen_exact,
        (),
        "each greedy token is within a small margin of the exact top-1 (teacher forcing)",
    )
    add(
        "generation.sampler:top_p=0.01",
        "core",
        _sampler_is_greedy("top_p=0.01", top_p=0.01),
        (),
        "top_p 0.01 at temperature 1.5 is greedy",
    )
    add(
        "generation.sampler:min_p=1",
        "core",
        _sampler_is_greedy("min_p=1", min_p=1.0),
        (),
        "min_p 1 at temperature 1.5 is greedy",
    )
    add(
        "generation.sampler:repeat_penalty=1.5",
        "core",
        gen_repeat_penalty,
        (),
        "repeat_penalty changes a repetitive greedy answer",
    )
    add(
        "generation.concurrent:contexts=3",
        "core",
        gen_concurrent,
        (),
        "interleaved new_context() generations each give the answer given alone",
    )

    for case in g.get("chat", {}).get("cases", []) or [{"name": "single", "add_generation_prompt": True}]:
        agp = bool(case["add_generation_prompt"])
        add(
            f"chat.template:conv={case['name']},gen={int(agp)}",
            "core",
            chat_template(case["name"], agp),
            ("chat_template",),
            "the engine renders the model's template as the golden data",
        )

    add("errors.context_overflow:api=generate", "core", err_overflow_generate, (), "over-long prompt")
    add("errors.context_overflow:api=decode", "core", err_overflow_decode, ("logits", "tokenize"))
    add("errors.empty_prompt", "core", err_empty, (), "empty prompt")
    add("errors.invalid_option:option=top_p", "core", err_option("top_p", 1.5), ())
    add("errors.invalid_option:option=top_k", "core", err_option("top_k", -1), ())
    add("errors.invalid_option:option=n_predict", "core", err_option("n_predict", -2), ())
    return checks


def _case_order(g: dict[str, Any]) -> Callable[[str], int]:
    order = {c["name"]: i for i, c in enumerate(g.get("tokenizer", {}).get("cases", []))}
    return lambda name: order.get(name, 0)
