"""The reference engine's gemma3 architecture against llama.cpp (llama-cpp-python).

Expected values come from llama.cpp only:
- a tiny gemma3 GGUF (tests/test_conformance.py writes it: 5 local layers with a sliding window of
  4 and 1 global one) where the window and both RoPE bases matter after a few tokens;
- Gemma-3-270M Q4_K_M (Q5_0, Q8_0, Q4_K and Q6_K weights, a 262144-token tied Q8_0 head): the
  next-token distributions over a 640-token text (longer than the 512-token window, so the local
  layers do slide), for several batch layouts and thread counts; greedy continuations; token ids
  and end-of-generation tokens.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from isa import using_isa
from oracle import greedy_partings, llamacpp_greedy
from stdengine.conformance.metrics import log_softmax
from stdengine.reference.core import Context
from stdengine.reference.model import Model
from stdengine.reference.tokenizer import Tokenizer

from stdengine.errors import BadModelFile, UnsupportedArchitecture

llama_cpp = pytest.importorskip("llama_cpp")

DATA = Path(__file__).parent / "data"
N_TEXT = 640  # tokens of gemma3_text.txt that are scored; > 512, the model's sliding window
N_GREEDY = 32
NEAR_TIE = 0.5


def agreement(ref: np.ndarray, got: np.ndarray) -> tuple[float, float, int]:
    """(mean KL(llama.cpp || ours), top-1 agreement on the positions where llama.cpp's top-1
    probability beats its second by >= 0.1, positions) in chunks: 262144-wide rows are big.
    Both engines are about 0.005 (mean KL) from the exact float64 forward pass on this text, so
    a closer top two can flip either way: on the AMD EPYC without AVX-512, at position 590 the
    exact pass's margin was 0.025, llama.cpp's 0.055, and ours chose the other token; at 595
    llama.cpp chose against the exact pass and ours."""
    kls, hits = [], []
    for i in range(0, len(ref), 64):
        lp, lq = log_softmax(ref[i : i + 64]), log_softmax(got[i : i + 64])
        p = np.exp(lp)
        kls.append((p * (lp - lq)).sum(-1))
        top2 = np.sort(p, -1)[:, -2:]
        confident = top2[:, 1] - top2[:, 0] >= 0.1
        hits.append((ref[i : i + 64].argmax(-1) == got[i : i + 64].argmax(-1))[confident])
    return float(np.concatenate(kls).mean()), float(np.concatenate(hits).mean()), len(ref)


# ---------------------------------------------------------------------------------------------
# A tiny gemma3 model (window 4): exact enough to compare at every position
# ---------------------------------------------------------------------------------------------

TINY_TOKENS = [2, 10, 20, 30, 40, 50, 11, 21, 31, 41, 51, 12, 22, 32, 42, 52, 13, 23]


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory):
    from test_conformance import _write_tiny_gemma3

    path = tmp_path_factory.mktemp("gemma3") / "tiny-gemma3.gguf"
    _write_tiny_gemma3(path)
    return path


def _tiny_logits(path: Path, n_threads: int, n_ubatch: int) -> np.ndarray:
    model = Model.load(path)
    try:
        ctx = Context(model, n_ctx=64, n_threads=n_threads, n_ubatch=n_ubatch)
        got = ctx.decode(TINY_TOKENS, all_logits=True).astype(np.float64)
        ctx.close()
        return got
    finally:
        model.close()


def _kl(ref: np.ndarray, got: np.ndarray) -> np.ndarray:
    lp, lq = log_softmax(ref), log_softmax(got)
    return (np.exp(lp) * (lp - lq)).sum(-1)


def test_tiny_gemma3_matches_llamacpp(tiny_gemma3, tmp_path):
    """Every position, one batch and ubatches of 3 and 1 (the random model's distributions are
    nearly flat, so KL is the measure, not top-1)."""
    llm = llama_cpp.Llama(str(tiny_gemma3), n_ctx=64, logits_all=True, n_threads=1, verbose=False)
    llm.eval(TINY_TOKENS)
    ref = np.array(llm.scores[: len(TINY_TOKENS)], dtype=np.float64)
    del llm
    with Model.load(tiny_gemma3) as model:
        assert model.layers == [(1e4, 4)] * 5 + [(1e6, 0)]
    for n_threads, n_ubatch in [(1, 64), (2, 3), (2, 1)]:
        kl = _kl(ref, _tiny_logits(tiny_gemma3, n_threads, n_ubatch))
        assert kl.max() < 1e-3, (n_threads, n_ubatch, kl)
    # the window does matter here: widened past the text, positions beyond it are far off
    src = tiny_gemma3.read_bytes()
    key = b"gemma3.attention.sliding_window"
    at = src.index(key) + len(key) + 4  # then the value type (u32), then the value
    assert int.from_bytes(src[at : at + 4], "little") == 4
    wide = tmp_path / "wide.gguf"
    wide.write_bytes(src[:at] + (64).to_bytes(4, "little") + src[at + 4 :])
    kl_wide = _kl(ref, _tiny_logits(wide, 1, 64))
    assert kl_wide[:4].max() < 1e-3 and kl_wide[5:].min() > 10 * kl.max()


def test_tiny_gemma3_loading_errors(tiny_gemma3, tmp_path):
    """Every gemma3 tensor is checked, and an error names the tensor (or the architecture)."""
    src = tiny_gemma3.read_bytes()
    # a tensor the forward pass does not know (and so one it needs is missing)
    renamed = tmp_path / "renamed.gguf"
    renamed.write_bytes(src.replace(b"blk.3.post_ffw_norm.weight", b"blk.3.post_ffw_xxxx.weight", 1))
    with pytest.raises(UnsupportedArchitecture, match="blk.3.post_ffw_xxxx.weight"):
        Model.load(renamed)
    # a q norm of the wrong length: tensor info is name, n_dims (u32), dims (u64 each), ...
    name = b"blk.0.attn_q_norm.weight"
    at = src.index(name) + len(name)
    assert (
        int.from_bytes(src[at : at + 4], "little") == 1
        and int.from_bytes(src[at + 4 : at + 12], "little") == 32
    )
    wrong = tmp_path / "wrong.gguf"
    wrong.write_bytes(src[: at + 4] + (16).to_bytes(8, "little") + src[at + 12 :])
    with pytest.raises(BadModelFile, match=r"blk.0.attn_q_norm.weight.*shape \[16\], expected \[32\]"):
        Model.load(wrong)
    # an unknown architecture names itself and the supported ones
    arch = tmp_path / "arch.gguf"
    arch.write_bytes(src.replace(b"gemma3", b"gemmaX"))
    with pytest.raises(UnsupportedArchitecture, match=r"'gemmaX'.*llama, gemma3"):
        Model.load(arch)


# ---------------------------------------------------------------------------------------------
# Gemma-3-270M against llama.cpp
# ---------------------------------------------------------------------------------------------


def _turn(question: str) -> str:
    return f"<start_of_turn>user\n{question}<end_of_turn>\n<start_of_turn>model\n"


# Greedy continuations can only be compared where the choice is clear: at a near-tie any change
# of rounding (llama.cpp's f16 KV cache or flash attention against its own defaults moves this
# model's next-token distribution by a mean KL of ~0.007) picks another token. These five are, of
# 16 candidate prompts, the ones whose greedy path in llama.cpp keeps the largest margin between
# its top-1 and top-2 logits at every step (minimum margins 2.7, 1.5, 1.3, 0.23, 0.22): chosen by
# llama.cpp's margins alone, not by whether we match. (This is the base model: its "chat" answers
# echo the question, in llama.cpp as here.) Where we part from llama.cpp, its margin must be
# below NEAR_TIE: over the 667 positions of forward_text.txt (the SmolLM2 test's text) the top-1/top-2
# margin of llama.cpp's logits and of ours differ by 0.10 (median), 0.26 (90th percentile),
# 0.42-0.48 (99th) and 0.78 at most, as one batch and in ubatches of 7 alike.
PROMPTS = [
    "1, 2, 3, 4, 5,",
    "The alphabet: A, B, C, D,",
    _turn("Say hello."),
    _turn("Write the numbers from 1 to 10."),
    "One, two, three, four,",
]


@pytest.fixture(scope="module")
def ref(gemma3_path):
    """llama.cpp's tokens and logits of every position of the text, and greedy continuations."""
    if not Path(gemma3_path).exists():
        pytest.skip(f"{gemma3_path} not found")
    text = (DATA / "gemma3_text.txt").read_text()
    llm = llama_cpp.Llama(
        str(gemma3_path), n_ctx=N_TEXT, n_batch=N_TEXT, logits_all=True, n_threads=2, verbose=False
    )
    tokens = llm.tokenize(text.encode(), add_bos=True, special=True)[:N_TEXT]
    assert len(tokens) == N_TEXT
    llm.eval(tokens)
    logits = np.array(llm.scores[:N_TEXT], dtype=np.float32)
    vocab = llm._model.vocab
    eog = {i for i in range(llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, i)}
    greedy = llamacpp_greedy(llm, PROMPTS, N_GREEDY)
    del llm
    return {"text": text, "tokens": tokens, "logits": logits, "greedy": greedy, "eog": eog}


@pytest.fixture(scope="module")
def gemma(gemma3_path):
    if not Path(gemma3_path).exists():
        pytest.skip(f"{gemma3_path} not found")
    m = Model.load(gemma3_path)
    yield m
    m.close()


def test_gemma3_hparams(gemma):
    hp = gemma.hparams
    assert gemma.arch == "gemma3"
    assert (hp.n_layer, hp.n_embd, hp.n_head, hp.n_head_kv, hp.head_dim, hp.n_ff, hp.n_vocab) == (
        18,
        640,
        4,
        1,
        256,
        2048,
        262144,
    )
    assert hp.attn_scale == pytest.approx(1 / 16) and hp.embd_scale == pytest.approx(640**0.5)
    # every 6th layer is global (full attention, base 1e6); the others slide over 512 at base 1e4
    assert gemma.layers == [(1e6, 0) if il % 6 == 5 else (1e4, 512) for il in range(18)]


def test_gemma3_full_text_matches_llamacpp(gemma, ref):
    """All 640 positions in ubatches of 512 (so the window also spans a ubatch boundary)."""
    ctx = Context(gemma, n_ctx=N_TEXT, n_threads=2, n_batch=N_TEXT, n_ubatch=512)
    got = ctx.decode(ref["tokens"], all_logits=True)
    ctx.close()
    kl, top1, n = agreement(ref["logits"], got)
    print(f"one batch, 2 threads: {n} positions, mean KL {kl:.5f}, confident top-1 {top1:.4f}")
    assert n >= 500 and kl <= 0.01 and top1 >= 0.99


# Other layouts: the first PREFIX tokens fill the cache without logits (the output head over
# 262144 tokens is most of the cost), then the positions after it, which see a slid window
# through a cache written by the same layout, are compared with llama.cpp.
PREFIX = 560
LAYOUTS = {
    "ubatch7-2t": dict(n_threads=2, n_ubatch=7, tail=80),
    "batch-1t": dict(n_threads=1, n_ubatch=512, tail=40),
    "token-by-token-2t": dict(n_threads=2, n_ubatch=512, tail=40, one_by_one=True),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_gemma3_layouts_match_llamacpp(gemma, ref, layout):
    kw = dict(LAYOUTS[layout])
    one_by_one, tail = kw.pop("one_by_one", False), ref["tokens"][PREFIX : PREFIX + kw.pop("tail")]
    ctx = Context(gemma, n_ctx=N_TEXT, n_batch=N_TEXT, **kw)
    try:
        ctx.decode(ref["tokens"][:PREFIX])
        if one_by_one:
            got = np.stack([ctx.decode([t]).copy() for t in tail])
        else:
            got = ctx.decode(tail, all_logits=True)
    finally:
        ctx.close()
    kl, top1, n = agreement(ref["logits"][PREFIX : PREFIX + len(tail)], got)
    print(f"{layout}: {n} positions after {PREFIX}, mean KL {kl:.5f}, confident top-1 {top1:.4f}")
    assert kl <= 0.01 and top1 >= 0.99


def test_gemma3_greedy_matches_llamacpp(gemma, ref):
    ctx = Context(gemma, n_ctx=256, n_threads=2)
    same, bad = greedy_partings(ctx, ref["greedy"], NEAR_TIE)
    ctx.close()
    print(f"{same} of {len(PROMPTS)} greedy continuations are llama.cpp's")
    assert not bad, f"parted from llama.cpp where its choice was clear: {bad}"


def test_gemma3_tokens_and_eog_match_llamacpp(gemma3_path, ref):
    tok = Tokenizer.from_gguf(gemma3_path)
    assert tok.encode(ref["text"])[:N_TEXT] == ref["tokens"]
    for prompt, g in zip(PROMPTS, ref["greedy"], strict=True):
        assert tok.encode(prompt) == g.prompt
    assert set(tok.eog_ids) == ref["eog"]
    assert tok.encode("<end_of_turn>", add_special=False) == [106]
    assert 106 in tok.eog_ids


@pytest.mark.parametrize("isa", ["scalar", "avx2"])
def test_gemma3_portable_paths_match_llamacpp(gemma, ref, isa):
    """The portable scalar path and the AVX2 path run Gemma as accurately as the fast path
    (Q4_K, Q5_0, Q6_K and Q8_0 weights, sliding-window attention), on the text's first 128 tokens."""
    with using_isa(isa):
        tokens = ref["tokens"][:128]
        with Context(gemma, n_ctx=256, n_threads=2) as ctx:
            got = ctx.decode(tokens, all_logits=True)
    kl, top1, n = agreement(ref["logits"][: len(tokens)], got)
    assert n >= 40 and kl <= 0.01 and top1 >= 0.99, (isa, n, kl, top1)
