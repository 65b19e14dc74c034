"""Batched decoding across contexts (se_decode_batch, core.decode_batch, ReferenceEngine's
_evaluate_batch): several contexts of one model go through shared forward passes, and every
context's logits are bit-identical to decoding that context alone (spec/reference-engine.md,
"Batched decoding"). The references are the same contexts decoded one by one with se_decode,
whose own determinism tests/test_determinism.py checks against every split; the errors are
checked on a tiny synthetic model.
"""

from __future__ import annotations

import ctypes
import io

import numpy as np
import pytest
from isa import using_isa
from stdengine.reference.core import ERR_INVALID, OK, Context, api, decode_batch, isa_name
from stdengine.reference.model import Model

from stdengine.errors import ContextOverflow, EngineFailure, InvalidRequest
from stdengine.events import Emitter
from stdengine.options import Options

ISAS = ["scalar", "avx2", "avx512", "amx"]


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def model(request, smollm2_path, gemma3_path):
    path = smollm2_path if request.param == "smollm2" else gemma3_path
    with Model.load(path) as m:
        yield m


def _tokens(n: int, seed: int, n_vocab: int = 30000) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(min(100, n_vocab // 2), n_vocab, n)]


def _same(got: np.ndarray, want: np.ndarray, what: str) -> None:
    assert np.array_equal(got, want), f"{what}: {int((got != want).sum())} logits differ"


class Pair:
    """The same context twice: one decoded alone (se_decode), one in batches."""

    def __init__(self, model: Model, n_ctx: int = 1024, **kw: int | str) -> None:
        self.solo = Context(model, n_ctx=n_ctx, n_threads=2, **kw)
        self.batched = Context(model, n_ctx=n_ctx, n_threads=2, **kw)

    def prefill(self, tokens: list[int]) -> None:
        self.solo.decode(tokens)
        self.batched.decode(tokens)

    def close(self) -> None:
        self.solo.close()
        self.batched.close()


def _step(pairs: list[Pair], token_lists: list[list[int]], what: str) -> list[np.ndarray]:
    """One decode_batch over the batched contexts against each solo decode; returns the logits."""
    got = [g.copy() for g in decode_batch([p.batched for p in pairs], token_lists)]
    want = [p.solo.decode(t).copy() for p, t in zip(pairs, token_lists, strict=True)]
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        _same(g, w, f"{what}, context {i}")
    for p in pairs:
        assert p.batched.n_past == p.solo.n_past and p.batched.tokens == p.solo.tokens
    return want


def _greedy(logits: list[np.ndarray]) -> list[list[int]]:
    return [[int(np.argmax(x))] for x in logits]


@pytest.mark.parametrize("cache", ["f32", "f16"])
@pytest.mark.parametrize("isa", ISAS)
def test_contexts_stepped_together_match_each_alone(model, isa, cache):
    """N contexts with different prompts (lengths 3 to 45) evaluated in one batch, then stepped
    together one token at a time; ctxs[0]'s ubatch of 16 splits the prompts over several passes
    and a context's prompt across two of them. Every logit equals its context's alone. Steps of
    2 to 15 rows take the small-batch matmuls (kernels.h), 12 in two passes (8 + 4). The f16 cache
    (its own attention kernels) with fewer contexts."""
    slow = isa == "scalar"  # the portable path: fewer contexts and steps
    kw = dict(cache_type_k=cache, cache_type_v=cache)
    with using_isa(isa):
        for n_seq in (2, 5) if slow or cache == "f16" else (2, 3, 5, 8, 12):
            pairs = [Pair(model, n_ubatch=16 if i == 0 else 512, **kw) for i in range(n_seq)]
            try:
                prompts = [_tokens(3 + (i * 7) % 43, seed=n_seq * 100 + i) for i in range(n_seq)]
                logits = _step(pairs, prompts, f"{isa} N={n_seq} prompts")
                for step in range(2 if slow else 5):
                    logits = _step(pairs, _greedy(logits), f"{isa} N={n_seq} step {step}")
            finally:
                for p in pairs:
                    p.close()


@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_packed_panels_made_at_the_first_batched_step(which, smollm2_path, gemma3_path):
    """A fresh model makes its packed panels (kernels.h) at its first batched step, on the paths
    that have them (AVX-512, AMX), as large as the Q4_0/Q4_1/Q8_0 weights they copy; its steps
    then read them, and every logit is still the context's alone. With them turned off the model
    makes none, with the same logits."""
    path = smollm2_path if which == "smollm2" else gemma3_path
    for on in (True, False):
        with Model.load(path) as m:
            m.set_batch_panels(on)
            assert m.panels_bytes == 0
            pairs = [Pair(m) for _ in range(3)]
            try:
                logits = _step(
                    pairs, [_tokens(3 + 5 * i, seed=90 + i) for i in range(3)], f"panels {on}, prompts"
                )
                for step in range(3):
                    logits = _step(pairs, _greedy(logits), f"panels {on}, step {step}")
            finally:
                for p in pairs:
                    p.close()
            # the matrices of those types (the tied head: the embedding's), rows rounded up to 16
            copied = [
                t for t in m.tensors.values() if t.type_name in ("q4_0", "q4_1", "q8_0") and len(t.shape) == 2
            ]
            if on and isa_name() in ("avx512", "amx"):
                low = sum(t.n_bytes for t in copied)
                assert low <= m.panels_bytes <= low + sum(16 * t.n_bytes // t.shape[1] + 64 for t in copied)
            else:
                assert m.panels_bytes == 0


def test_rows_taken_from_another_threads_share(model, skewed_shares):
    """Batched steps whose every matmul row a thread took from another's share (se_share_rows,
    forced by the test hook; a context decoded alone, one token at a time, keeps the static
    split): each context's logits are still those it has alone."""
    pairs = [Pair(model) for _ in range(5)]
    try:
        logits = _step(pairs, [_tokens(3 + 4 * i, seed=70 + i) for i in range(5)], "prompts, rows taken")
        for step in range(3):
            logits = _step(pairs, _greedy(logits), f"step {step}, rows taken")
        assert skewed_shares() > 0, "no thread took rows from another's share"
    finally:
        for p in pairs:
            p.close()


def test_a_prompt_chunk_among_single_tokens(model):
    """One context takes a prompt chunk while the others take one token each (the chunk first, in
    the middle, last; with the scratch context's ubatch smaller than the chunk), and contexts of
    different sizes share the passes."""
    pairs = [Pair(model, n_ctx=(256, 1024, 96, 512)[i % 4], n_ubatch=(512, 7)[i % 2]) for i in range(6)]
    try:
        for i, p in enumerate(pairs):
            p.prefill(_tokens(5 + 9 * i, seed=i))
        logits = [p.solo.logits.copy() for p in pairs]
        for chunk_at in (0, 3, 5):
            lists = _greedy(logits)
            lists[chunk_at] = _tokens(20 + chunk_at, seed=50 + chunk_at)
            logits = _step(pairs, lists, f"chunk in context {chunk_at}")
            logits = _step(pairs, _greedy(logits), f"after the chunk in context {chunk_at}")
    finally:
        for p in pairs:
            p.close()


def test_contexts_at_different_positions_across_the_window(model):
    """Contexts at n_past 0 (a first prompt), 9, 505 and 600: stepped together past position 512
    (Gemma-3-270M's sliding window, and the default ubatch) and a batch holding a chunk that
    crosses it."""
    pairs = [Pair(model) for _ in range(4)]
    try:
        for p, n in zip(pairs[1:], (9, 505, 600), strict=True):
            p.prefill(_tokens(n, seed=n))
        logits = _step(pairs, [_tokens(4, 7), [11], [12], [13]], "different positions")
        for step in range(8):  # context 2 goes from 506 to 514
            logits = _step(pairs, _greedy(logits), f"step {step}")
        lists = _greedy(logits)
        lists[1] = _tokens(510, seed=3)  # positions 18..527, across the window, in two passes
        _step(pairs, lists, "a chunk across the window")
    finally:
        for p in pairs:
            p.close()


def test_reference_engine_evaluate_batch(smollm2_path):
    """The adapter's hook: contexts from new_context() evaluated together keep their `tokens`
    and give the logits each would give alone; an error changes no context."""
    from stdengine.reference.adapter import ReferenceEngine

    options = Options(model=str(smollm2_path), ctx_size=128, threads=2)
    engine = ReferenceEngine.load(options, Emitter(log_format="json", stream=io.StringIO()))
    assert "batch_decode" in engine.capabilities
    contexts = [engine.new_context() for _ in range(3)]
    alone = [engine.new_context() for _ in range(3)]
    try:
        lists = [_tokens(4 + 5 * i, seed=i) for i in range(3)]
        engine._evaluate_batch(list(zip(contexts, lists, strict=True)))
        for c, a, toks in zip(contexts, alone, lists, strict=True):
            a._evaluate(toks)
            assert c.tokens == a.tokens == toks
            _same(c._last_logits(), a._last_logits(), "evaluate_batch")
        with pytest.raises(ContextOverflow):
            engine._evaluate_batch([(contexts[0], [5]), (contexts[1], [6] * 120)])
        assert [c.tokens for c in contexts] == lists
        assert [c.ctx.n_past for c in contexts] == [len(t) for t in lists]
    finally:
        for c in contexts + alone:
            c.close()
        engine.close()


# --- errors, on a tiny synthetic model --------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from gguf_factory import write_llama_gguf

    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    write_llama_gguf(path, weight_type="Q8_0", n_layer=2, n_embd=64, n_ff=128, n_head=4, n_head_kv=2)
    with Model.load(path) as m:
        yield m


def _state(contexts: list[Context]) -> list[tuple[int, list[int], bytes]]:
    return [(c.n_past, c.tokens, c.logits.tobytes()) for c in contexts]


def test_errors_evaluate_nothing(tiny):
    ctxs = [Context(tiny, n_ctx=n, n_threads=1) for n in (32, 16, 32)]
    try:
        for c, t in zip(ctxs, ([1, 2, 3], [4, 5], [6]), strict=True):
            c.decode(t)
        before = _state(ctxs)
        n_vocab = tiny.n_vocab
        with pytest.raises(ContextOverflow, match="2 cached"):  # context 1: 2 + 15 > 16
            decode_batch(ctxs, [[7], [8] * 15, [9]])
        with pytest.raises(InvalidRequest, match=f"outside the vocabulary.*{n_vocab}"):
            decode_batch(ctxs, [[7], [8], [9, n_vocab]])
        with pytest.raises(InvalidRequest, match="integer"):
            decode_batch(ctxs, [[7], [-(2**40)], [9]])
        with pytest.raises(InvalidRequest, match="twice"):
            decode_batch([ctxs[0], ctxs[1], ctxs[0]], [[7], [8], [9]])
        with pytest.raises(InvalidRequest, match="no tokens"):
            decode_batch(ctxs, [[7], [], [9]])
        with pytest.raises(InvalidRequest, match="one token list per context"):
            decode_batch([], [])
        with pytest.raises(InvalidRequest, match="one token list per context"):
            decode_batch(ctxs, [[7], [8]])
        assert _state(ctxs) == before
        # the C core's own checks, below the binding's: n_seq 0, a repeated context, a count < 1
        c_api, flat = api(), np.array([7, 8, 9], dtype=np.int32)
        for handles, counts in (
            ([ctxs[0]._h], []),
            ([ctxs[0]._h, ctxs[0]._h], [1, 2]),
            ([ctxs[0]._h, ctxs[1]._h], [3, 0]),
        ):
            arr = (ctypes.c_void_p * max(1, len(handles)))(*handles)
            cnt = np.array(counts or [1], dtype=np.int32)
            rc = c_api.se_decode_batch(arr, len(counts), flat.ctypes.data, cnt.ctypes.data)
            assert rc == ERR_INVALID, (handles, counts)
        assert _state(ctxs) == before
        # and a batch after the errors still matches each context alone
        solo = [Context(tiny, n_ctx=c.n_ctx, n_threads=1) for c in ctxs]
        for s, c in zip(solo, ctxs, strict=True):
            s.decode(c.tokens)
        got = [g.copy() for g in decode_batch(ctxs, [[7], [8, 9], [10]])]
        for g, s, t in zip(got, solo, ([7], [8, 9], [10]), strict=True):
            _same(g, s.decode(t), "after the errors")
            s.close()
    finally:
        for c in ctxs:
            c.close()


def test_tiny_model_mixed_batches(tiny):
    """Chunks and single tokens mixed, passes of 5 rows (ctxs[0]'s ubatch) that split chunks, on the
    synthetic model (quick enough for the sanitizer build, .ci/sanitize)."""
    pairs = [Pair(tiny, n_ctx=64, n_ubatch=5 if i == 0 else 64) for i in range(4)]
    try:
        shapes = ([3, 1, 1, 1], [1, 1, 1, 1], [1, 7, 1, 2], [1, 1, 1, 9], [4, 4, 4, 4], [1, 1, 1, 1])
        for k, shape in enumerate(shapes):
            lists = [_tokens(n, 10 * k + i, tiny.n_vocab) for i, n in enumerate(shape)]
            _step(pairs, lists, f"shape {shape}")
    finally:
        for p in pairs:
            p.close()


def test_contexts_of_two_models_are_refused(tiny):
    with Model.load(tiny.path) as other:
        a, b = Context(tiny, n_ctx=16, n_threads=1), Context(other, n_ctx=16, n_threads=1)
        try:
            with pytest.raises(InvalidRequest, match="another model"):
                decode_batch([a, b], [[1], [2]])
            arr = (ctypes.c_void_p * 2)(a._h, b._h)
            flat, cnt = np.array([1, 2], dtype=np.int32), np.array([1, 1], dtype=np.int32)
            assert api().se_decode_batch(arr, 2, flat.ctypes.data, cnt.ctypes.data) == ERR_INVALID
            assert a.n_past == b.n_past == 0
            b.close()
            with pytest.raises(EngineFailure, match="closed"):
                decode_batch([a, b], [[1], [2]])
            assert decode_batch([a], [[1]])[0].shape == (tiny.n_vocab,)
            assert api().se_decode_batch(None, 0, None, None) == ERR_INVALID != OK
        finally:
            a.close()
            b.close()
