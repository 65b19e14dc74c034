"""The reference tokenizer against llama.cpp, the oracle: every expected id comes from llama.cpp
(llama-cpp-python loading the same file with vocab_only=True), never from the code under test.

Real models: SmolLM2 (byte-level BPE, pre-tokenizer "smollm") and Gemma 3 (SentencePiece-style, 262k
tokens), on the corpus in tests/data/tokenizer_corpus.json, line by line and as one text. Synthetic
GGUF files written here cover the other pre-tokenizers (llama-bpe, qwen2, gpt-2, default) and an SPM
vocabulary with a space prefix, which Gemma 3 does not use.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from stdengine.reference.tokenizer import (
    _BYTE_TO_CHAR,
    PRE_TOKENIZERS,
    StreamDecoder,
    Tokenizer,
    pre_split,
    read_gguf_metadata,
)

from stdengine.errors import UnsupportedArchitecture

CORPUS: list[dict[str, str]] = json.loads(
    (Path(__file__).parent / "data" / "tokenizer_corpus.json").read_text(encoding="utf-8")
)
LINE_IDS = [c["name"] for c in CORPUS]
SPECIAL_MARKERS = (
    "<|im_",
    "<start_of_turn>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<bos>",
    "<eos>",
    "<pad>",
    "<unk>",
    "</s>",
    "<s>",
)
FLAGS = [(True, True), (False, True), (True, False), (False, False)]  # (add_special, parse_special)

# ------------------------------------------------------------------------------------------------
# the oracle


class Oracle:
    """llama.cpp's vocabulary for one GGUF file, through llama-cpp-python."""

    def __init__(self, path: Path) -> None:
        import llama_cpp

        self.lib = llama_cpp
        self.llama = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
        self.vocab = self.llama._model.vocab
        self._buf = ctypes.create_string_buffer(1024)

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        return self.llama.tokenize(text.encode("utf-8"), add_bos=add_special, special=parse_special)

    def piece(self, token: int, special: bool) -> bytes:
        # llama_token_to_piece directly: llama-cpp-python's detokenize uses a 32-byte buffer
        n = self.lib.llama_token_to_piece(self.vocab, token, self._buf, len(self._buf), 0, special)
        assert n >= 0, f"token {token} longer than the buffer"
        return self._buf.raw[:n]

    def detokenize(self, ids: list[int], special: bool = False) -> bytes:
        return self.llama.detokenize(ids, special=special)


_loaded: dict[str, tuple[Tokenizer, Oracle]] = {}
_synthetic_oracles: list[Oracle] = []


@pytest.fixture(scope="module", autouse=True)
def _close_oracles() -> Any:
    yield
    # free llama.cpp's models before interpreter shutdown (their __del__ fails after it)
    for oracle in [o for _, o in _loaded.values()] + _synthetic_oracles:
        oracle.llama.close()
    _loaded.clear()
    _synthetic_oracles.clear()


def _load(path: Path) -> tuple[Tokenizer, Oracle]:
    pytest.importorskip("llama_cpp", reason="llama-cpp-python (the oracle) is not installed")
    key = str(path)
    if key not in _loaded:
        _loaded[key] = (Tokenizer.from_gguf(path), Oracle(path))
    return _loaded[key]


def _oracle(path: Path) -> Oracle:
    """An oracle for a file written by a test, closed with the module's."""
    oracle = Oracle(path)
    _synthetic_oracles.append(oracle)
    return oracle


def _model_path(request: pytest.FixtureRequest, fixture: str, env: str, default: str) -> Path:
    """The catalogue model from conftest's fixture; the env variable or /tmp/models when it cannot."""
    try:
        path = Path(request.getfixturevalue(fixture))
    except pytest.FixtureLookupError:
        path = Path(os.environ.get(env, default))
    except Exception as e:  # the catalogue could not be resolved here (offline, not pulled)
        path = Path(os.environ.get(env, default))
        if not path.exists():
            pytest.skip(f"{fixture}: {e}")
    if not path.exists():
        pytest.skip(f"model not found: {path} (set {env})")
    return path


MODELS = {
    "smollm2": ("smollm2_path", "INFER_TEST_SMOLLM2", "/tmp/models/SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma3": ("gemma3_path", "INFER_TEST_GEMMA3", "/tmp/models/gemma-3-270m-q4_k_m.gguf"),
}


@pytest.fixture(params=list(MODELS))
def model(request: pytest.FixtureRequest) -> tuple[str, Tokenizer, Oracle]:
    name = request.param
    tok, oracle = _load(_model_path(request, *MODELS[name]))
    return name, tok, oracle


@pytest.fixture
def smollm2(request: pytest.FixtureRequest) -> Path:
    return _model_path(request, *MODELS["smollm2"])


def _first_difference(tok: Tokenizer, mine: list[int], ref: list[int]) -> str:
    i = next((k for k, (a, b) in enumerate(zip(mine, ref, strict=False)) if a != b), min(len(mine), len(ref)))
    window = slice(max(0, i - 3), i + 4)
    return (
        f"first difference at {i}: mine {mine[window]} {[tok.tokens[t] for t in mine[window]]}, "
        f"llama.cpp {ref[window]} {[tok.tokens[t] for t in ref[window]]}"
    )


def _check_ids(tok: Tokenizer, oracle: Oracle, text: str) -> list[str]:
    problems = []
    for add_special, parse_special in FLAGS:
        mine = tok.encode(text, add_special=add_special, parse_special=parse_special)
        ref = oracle.tokenize(text, add_special, parse_special)
        if mine != ref:
            problems.append(
                f"add_special={add_special} parse_special={parse_special}: "
                + _first_difference(tok, mine, ref)
            )
    return problems


# ------------------------------------------------------------------------------------------------
# real models


@pytest.mark.models
@pytest.mark.llamacpp
@pytest.mark.parametrize("line", CORPUS, ids=LINE_IDS)
def test_ids_match_llamacpp_per_line(model: Any, line: dict[str, str]) -> None:
    _, tok, oracle = model
    assert _check_ids(tok, oracle, line["text"]) == []


@pytest.mark.models
@pytest.mark.llamacpp
@pytest.mark.parametrize("sep", ["\n", "", " ", "\n\n"], ids=["newline", "nothing", "space", "blank_line"])
def test_ids_match_llamacpp_whole_corpus(model: Any, sep: str) -> None:
    _, tok, oracle = model
    text = sep.join(c["text"] for c in CORPUS)
    assert _check_ids(tok, oracle, text) == []


@pytest.mark.models
@pytest.mark.llamacpp
@pytest.mark.parametrize(
    "text",
    [
        "",
        " ",
        "  ",
        "\n",
        "a",
        " a",
        "a ",
        "\t\n\r\n",
        "0",
        "<|im_end|>",
        "<end_of_turn>",
        "<bos>",
        "<|im_start|>user",
        "<start_of_turn>model\n",
    ],
)
def test_ids_match_llamacpp_short(model: Any, text: str) -> None:
    _, tok, oracle = model
    assert _check_ids(tok, oracle, text) == []


@pytest.mark.models
@pytest.mark.llamacpp
def test_vocabulary_facts_match_llamacpp(model: Any) -> None:
    _, tok, oracle = model
    lib, v = oracle.lib, oracle.vocab
    assert tok.n_vocab == lib.llama_vocab_n_tokens(v)
    assert tok.bos_id == lib.llama_vocab_bos(v)
    assert tok.eos_id == lib.llama_vocab_eos(v)
    assert tok.add_bos == lib.llama_vocab_get_add_bos(v)
    assert tok.add_eos == lib.llama_vocab_get_add_eos(v)
    eog = {i for i in range(tok.n_vocab) if lib.llama_vocab_is_eog(v, i)}
    assert tok.eog_ids == eog


@pytest.mark.models
@pytest.mark.llamacpp
def test_token_to_piece_matches_llamacpp_for_every_token(model: Any) -> None:
    _, tok, oracle = model
    bad = [
        (i, special)
        for i in range(tok.n_vocab)
        for special in (True, False)
        if tok.token_to_piece(i, special) != oracle.piece(i, special)
    ]
    assert (len(bad), bad[:10]) == (0, [])


def _plain(text: str) -> bool:
    return not any(m in text for m in SPECIAL_MARKERS)


@pytest.mark.models
@pytest.mark.llamacpp
@pytest.mark.parametrize("line", CORPUS, ids=LINE_IDS)
def test_decode_roundtrip(model: Any, line: dict[str, str]) -> None:
    _, tok, oracle = model
    text = line["text"]
    ids = tok.encode(text, add_special=False)
    # the text comes back, unless the vocabulary cannot hold it: then it comes back as llama.cpp's
    # does (SmolLM2 has no token for the byte 0x1D, which both drop)
    for special in (True, False) if _plain(text) else (True,):
        ref = oracle.detokenize(oracle.tokenize(text, False, True), special=special).decode(
            "utf-8", "replace"
        )
        assert tok.decode(ids, special=special) == (text if ref == text else ref)


@pytest.mark.models
@pytest.mark.llamacpp
def test_decode_roundtrip_with_special_tokens(model: Any) -> None:
    name, tok, _ = model
    text = (
        "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
        if name == "smollm2"
        else "<start_of_turn>user\nHi!<end_of_turn>\n<start_of_turn>model\n"
    )
    ids = tok.encode(text, add_special=False)
    assert len(ids) < len(tok.encode(text, add_special=False, parse_special=False))
    assert tok.decode(ids, special=True) == text
    assert tok.decode(ids) == re.sub(r"<[^>]*>", "", text)  # control tokens are not rendered


@pytest.mark.models
@pytest.mark.llamacpp
def test_stream_decoder_emits_only_complete_text(model: Any) -> None:
    _, tok, oracle = model
    text = "\n".join(c["text"] for c in CORPUS if _plain(c["text"]))
    ids = tok.encode(text, add_special=False)
    dec = StreamDecoder(tok)
    chunks = [dec.push(i) for i in ids]
    chunks.append(dec.flush())
    streamed = "".join(chunks)
    # the same text as the concatenated pieces (llama.cpp's), with no replacement character anywhere
    assert streamed == b"".join(oracle.piece(i, False) for i in ids).decode("utf-8", "replace")
    assert "\ufffd" not in streamed
    # some character spans several tokens (emoji, CJK as byte tokens), held back until complete
    partial = [i for i in ids if len(tok.token_to_piece(i)) and _incomplete(tok.token_to_piece(i))]
    assert partial, "the corpus should split some character across tokens"
    assert "" in chunks[:-1]


def _incomplete(piece: bytes) -> bool:
    try:
        piece.decode("utf-8")
        return False
    except UnicodeDecodeError:
        return True


def test_stream_decoder_holds_back_a_split_character() -> None:
    tok = Tokenizer.from_metadata(_bpe_meta("gpt-2"))
    ids = tok.encode("€")  # three byte tokens: E2 82 AC
    assert len(ids) == 3
    dec = StreamDecoder(tok)
    assert [dec.push(i) for i in ids] == ["", "", "€"]
    dec.push(ids[0])
    assert dec.flush() == "\ufffd"  # an incomplete tail at the end


def _gguf_reader_metadata(reader: Any) -> dict[str, Any]:
    """The tokenizer.* and general.* keys of an open `gguf.GGUFReader`, as plain Python values."""
    return {
        name: field.contents()
        for name, field in reader.fields.items()
        if name.startswith(("tokenizer.", "general.")) and field.types
    }


@pytest.mark.models
def test_header_reader_reads_what_gguf_reader_reads(smollm2: Path, tmp_path: Path) -> None:
    """read_gguf_metadata (gguf_file's scan, as from_gguf reads a file) against gguf.GGUFReader, on
    SmolLM2 and on synthetic files (Gemma's 262k vocabulary takes GGUFReader seconds, hence not Gemma)."""
    from gguf import GGUFReader

    for path in (
        smollm2,
        _write_gguf(tmp_path / "bpe.gguf", _bpe_meta("gpt-2")),
        _write_gguf(tmp_path / "spm.gguf", _spm_meta(True)),
    ):
        theirs = _gguf_reader_metadata(GGUFReader(path))
        assert read_gguf_metadata(path) == theirs
        text = "\n".join(c["text"] for c in CORPUS)
        assert Tokenizer.from_metadata(theirs).encode(text) == Tokenizer.from_gguf(path).encode(text)


# ------------------------------------------------------------------------------------------------
# synthetic vocabularies: the other pre-tokenizers, and SPM with a space prefix

SYNTH_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"]
SYNTH_USER = "<|user_defined|>"
# a whole-word token that no merge builds: llama-bpe (ignore_merges) uses it, the others cannot
UNMERGED_WORD = "ĠZyzzyva"
TRAIN_TEXT = "\n".join(c["text"] for c in CORPUS)


def _train_merges(words: Counter[str], n_merges: int) -> list[tuple[str, str]]:
    """A small byte-level BPE training (most frequent pair first) to make a realistic merge list."""
    seqs = {w: list(w) for w in words}
    merges: list[tuple[str, str]] = []
    for _ in range(n_merges):
        pairs: Counter[tuple[str, str]] = Counter()
        for w, s in seqs.items():
            for a, b in zip(s, s[1:], strict=False):
                pairs[a, b] += words[w]
        if not pairs:
            break
        best = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))[0]
        merges.append(best)
        for s in seqs.values():
            i = 0
            while i < len(s) - 1:
                if (s[i], s[i + 1]) == best:
                    s[i : i + 2] = [s[i] + s[i + 1]]
                i += 1
    return merges


_bpe_cache: dict[str, Any] = {}


def _bpe_vocab() -> tuple[list[str], list[int], list[str]]:
    if not _bpe_cache:
        # training words: a plain split, independent of the pre-tokenizers under test
        words = Counter(
            "".join(_BYTE_TO_CHAR[b] for b in w.encode("utf-8"))
            for w in re.findall(r" ?\w+| ?[^\w\s]+|\s+", TRAIN_TEXT)
        )
        merges = _train_merges(words, 300)
        merges += [("Ġ", "Ġ"), ("ĠĠ", "ĠĠ"), ("Ċ", "Ċ"), ("ĉ", "ĉ"), ("č", "Ċ")]
        tokens = SYNTH_SPECIALS + [SYNTH_USER]
        # every byte but 0x1D: a byte without a token exercises llama.cpp's fallback (SmolLM2 lacks it too)
        tokens += [c for b, c in enumerate(_BYTE_TO_CHAR) if b != 0x1D]
        for a, b in merges:
            if a + b not in tokens:
                tokens.append(a + b)
        tokens.append(UNMERGED_WORD)
        types = [3] * len(SYNTH_SPECIALS) + [4] + [1] * (len(tokens) - len(SYNTH_SPECIALS) - 1)
        _bpe_cache["v"] = (tokens, types, [f"{a} {b}" for a, b in merges])
    return _bpe_cache["v"]


def _bpe_meta(pre: str, **extra: Any) -> dict[str, Any]:
    tokens, types, merges = _bpe_vocab()
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 1,
    }
    meta.update(extra)
    return meta


def _spm_vocab() -> tuple[list[str], list[int], list[float]]:
    """Pieces of the corpus' words with frequency scores, 256 byte tokens, and special tokens."""
    if "spm" not in _bpe_cache:
        words = Counter("▁" + w for w in re.findall(r"\w+|[^\w\s]", TRAIN_TEXT))
        pieces: Counter[str] = Counter()
        for w, n in words.items():
            for i in range(len(w)):
                for j in range(i + 1, min(len(w), i + 6) + 1):
                    pieces[w[i:j]] += n
        common = [p for p, _ in pieces.most_common(1500)]
        tokens = ["<unk>", "<s>", "</s>", "<ctrl>", SYNTH_USER, "\n\n", "▁▁"]
        types = [2, 3, 3, 3, 4, 4, 1]
        scores = [0.0] * (len(tokens) - 1) + [-5.0]
        tokens += [f"<0x{b:02X}>" for b in range(256)]
        types += [6] * 256
        scores += [0.0] * 256
        for rank, p in enumerate(common):
            if p not in tokens:
                tokens.append(p)
                types.append(1)
                scores.append(-float(rank))
        _bpe_cache["spm"] = (tokens, types, scores)
    return _bpe_cache["spm"]


def _spm_meta(space_prefix: bool) -> dict[str, Any]:
    tokens, types, scores = _spm_vocab()
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_space_prefix": space_prefix,
    }


def _write_gguf(path: Path, meta: dict[str, Any]) -> Path:
    """A vocabulary-only llama model: llama.cpp reads the hyperparameters, so give it some."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(128)
    w.add_embedding_length(16)
    w.add_block_count(1)
    w.add_feed_forward_length(32)
    w.add_head_count(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model(meta["tokenizer.ggml.model"])
    if "tokenizer.ggml.pre" in meta:
        w.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    w.add_token_list(meta["tokenizer.ggml.tokens"])
    w.add_token_types(meta["tokenizer.ggml.token_type"])
    if "tokenizer.ggml.merges" in meta:
        w.add_token_merges(meta["tokenizer.ggml.merges"])
    if "tokenizer.ggml.scores" in meta:
        w.add_token_scores(meta["tokenizer.ggml.scores"])
    for key in ("bos_token_id", "eos_token_id", "unknown_token_id"):
        if f"tokenizer.ggml.{key}" in meta:
            w.add_uint32(f"tokenizer.ggml.{key}", meta[f"tokenizer.ggml.{key}"])
    for key in ("add_bos_token", "add_eos_token", "add_space_prefix"):
        if f"tokenizer.ggml.{key}" in meta:
            w.add_bool(f"tokenizer.ggml.{key}", meta[f"tokenizer.ggml.{key}"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


SYNTH_TEXTS = [c["text"] for c in CORPUS] + [
    "hello Zyzzyva world Zyzzyva",
    f"{SYNTH_USER} text {SYNTH_USER}<|im_start|>x<|im_end|>",
    "a\x1db",  # a byte with no token
    "\n".join(c["text"] for c in CORPUS),
]


@pytest.mark.llamacpp
@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "gpt-2", "default", "smollm"])
def test_synthetic_bpe_matches_llamacpp(tmp_path: Path, pre: str) -> None:
    pytest.importorskip("llama_cpp", reason="llama-cpp-python (the oracle) is not installed")
    path = _write_gguf(tmp_path / f"bpe-{pre}.gguf", _bpe_meta(pre))
    tok, oracle = Tokenizer.from_gguf(path), _oracle(path)
    problems = [f"{t[:40]!r}: {p}" for t in SYNTH_TEXTS for p in _check_ids(tok, oracle, t)]
    assert problems == []
    # the synthetic vocabulary does make the merges matter
    assert len(tok.encode("hello world")) < len("hello world")
    assert tok.eog_ids == {i for i in range(tok.n_vocab) if oracle.lib.llama_vocab_is_eog(oracle.vocab, i)}
    assert [tok.token_to_piece(i, s) for i in range(tok.n_vocab) for s in (True, False)] == [
        oracle.piece(i, s) for i in range(tok.n_vocab) for s in (True, False)
    ]


@pytest.mark.llamacpp
@pytest.mark.parametrize("add_bos", [True, False])
def test_synthetic_bpe_add_bos_token_is_honoured(tmp_path: Path, add_bos: bool) -> None:
    pytest.importorskip("llama_cpp", reason="llama-cpp-python (the oracle) is not installed")
    path = _write_gguf(
        tmp_path / "bpe.gguf",
        _bpe_meta("qwen2", **{"tokenizer.ggml.add_bos_token": add_bos, "tokenizer.ggml.add_eos_token": True}),
    )
    tok, oracle = Tokenizer.from_gguf(path), _oracle(path)
    assert tok.add_bos is add_bos and tok.add_eos
    for text in ("hello", ""):
        assert tok.encode(text) == oracle.tokenize(text)
    assert (tok.encode("hello")[0] == tok.bos_id) is add_bos
    assert tok.encode("hello")[-1] == tok.eos_id


def test_llama_bpe_ignores_merges_for_whole_word_tokens() -> None:
    ids = Tokenizer.from_metadata(_bpe_meta("llama-bpe")).encode(" Zyzzyva", add_special=False)
    assert ids == [_bpe_vocab()[0].index(UNMERGED_WORD)]
    assert len(Tokenizer.from_metadata(_bpe_meta("gpt-2")).encode(" Zyzzyva")) > 1


@pytest.mark.llamacpp
@pytest.mark.parametrize("space_prefix", [True, False])
def test_synthetic_spm_matches_llamacpp(tmp_path: Path, space_prefix: bool) -> None:
    pytest.importorskip("llama_cpp", reason="llama-cpp-python (the oracle) is not installed")
    path = _write_gguf(tmp_path / "spm.gguf", _spm_meta(space_prefix))
    tok, oracle = Tokenizer.from_gguf(path), _oracle(path)
    texts = SYNTH_TEXTS + ["<ctrl>after control", "x<ctrl> y<ctrl>", "a  b\n\nc", "▁literal▁", " lead"]
    problems = [f"{t[:40]!r}: {p}" for t in texts for p in _check_ids(tok, oracle, t)]
    assert problems == []
    assert [tok.token_to_piece(i, s) for i in range(tok.n_vocab) for s in (True, False)] == [
        oracle.piece(i, s) for i in range(tok.n_vocab) for s in (True, False)
    ]
    # decode takes off exactly the spaces the prefix rule added
    for text in texts:
        if "<" not in text and "▁" not in text:
            assert tok.decode(tok.encode(text, add_special=False)) == text
    assert (
        tok.decode(tok.encode("<ctrl>after  x<ctrl> y", add_special=True), special=True)
        == "<s><ctrl>after  x<ctrl> y"
    )


# ------------------------------------------------------------------------------------------------
# pre-tokenizer regexes, checked by hand, and errors


@pytest.mark.parametrize(
    "pre, text, pieces",
    [
        (
            "gpt-2",
            "Hello  world\n\nI'm 12345!!",
            ["Hello", " ", " world", "\n", "\n", "I", "'m", " 12345", "!!"],
        ),
        ("gpt-2", "a   ", ["a", "   "]),
        ("smollm", "x 2024 y", ["x", " ", "2", "0", "2", "4", " y"]),
        (
            "llama-bpe",
            "Hello  world\n\nI'M 12345!!",
            ["Hello", " ", " world", "\n\n", "I", "'M", " ", "123", "45", "!!"],
        ),
        ("llama-bpe", "x\t\n  y", ["x", "\t\n", " ", " y"]),
        ("qwen2", "abc 123", ["abc", " ", "1", "2", "3"]),
        ("default", "a+b=c 1234", ["a", "+", "b", "=", "c", " ", "123", "4"]),
    ],
)
def test_pre_tokenizer_splits(pre: str, text: str, pieces: list[str]) -> None:
    assert pre_split(text, PRE_TOKENIZERS[pre].regexes) == pieces


def test_unknown_pre_tokenizer_is_named_with_the_supported_ones() -> None:
    with pytest.raises(UnsupportedArchitecture) as e:
        Tokenizer.from_metadata(_bpe_meta("no-such-pre"))
    assert "no-such-pre" in e.value.message
    assert "smollm" in (e.value.hint or "") and "llama-bpe" in (e.value.hint or "")


def test_unknown_tokenizer_model_is_unsupported() -> None:
    with pytest.raises(UnsupportedArchitecture, match="rwkv"):
        Tokenizer.from_metadata({"tokenizer.ggml.model": "rwkv", "tokenizer.ggml.tokens": ["a"]})


def test_not_a_gguf_file_is_a_bad_model_file(tmp_path: Path) -> None:
    from stdengine.errors import BadModelFile

    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(BadModelFile):
        Tokenizer.from_gguf(bad)
    truncated = tmp_path / "t.gguf"
    full = _write_gguf(tmp_path / "full.gguf", _bpe_meta("gpt-2"))
    truncated.write_bytes(full.read_bytes()[:2000])
    with pytest.raises(BadModelFile):
        Tokenizer.from_gguf(truncated)
