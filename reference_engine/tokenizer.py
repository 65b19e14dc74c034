"""Tokenizers built from a GGUF file's vocabulary, with token ids identical to llama.cpp's.

Two vocabulary kinds, chosen by `tokenizer.ggml.model`:

- ``gpt2``: byte-level BPE. The text is cut into pieces by the regexes of the pre-tokenizer named in
  `tokenizer.ggml.pre` (llama.cpp's LLAMA_VOCAB_PRE_TYPE_* table: each regex splits the pieces left by
  the previous one, and text between matches stays a piece of its own); each piece's UTF-8 bytes are
  mapped to GPT-2's printable byte alphabet and merged by rank (lowest rank first, leftmost on ties).
- ``llama``: SentencePiece-style (Gemma). Spaces become U+2581, a space is prefixed after the start and
  after every special token when `add_space_prefix` is set, then adjacent symbols are merged while
  some merged string is a token, highest score first (leftmost on ties); a symbol that is no token is
  written as its bytes, `<0xXX>`.

Both first cut special tokens out of the text the way llama.cpp does: control, user-defined and
unknown tokens, longest first, each one splitting every remaining stretch of text at its
occurrences (with ``parse_special=False`` only user-defined tokens are cut out).

Every table is built once at load (dicts and lists, no per-token objects); encoding caches BPE pieces.

Streaming: the engine turns each generated token into bytes with ``token_to_piece`` and must only emit
complete UTF-8 text; :class:`StreamDecoder` does that (it holds back an incomplete sequence).
"""

from __future__ import annotations

import codecs
import heapq
from collections.abc import Iterable
from dataclasses import dataclass
from os import PathLike
from typing import Any

import regex

from stdengine import gguf_file
from stdengine.errors import BadModelFile, UnsupportedArchitecture
from stdengine.gguf_file import GGUFHeader

# ---------------------------------------------------------------------------------------------------
# token attributes (llama.cpp's llama_token_attr bits) and GGUF token types

ATTR_UNDEFINED = 0
ATTR_UNKNOWN = 1 << 0
ATTR_UNUSED = 1 << 1
ATTR_NORMAL = 1 << 2
ATTR_CONTROL = 1 << 3
ATTR_USER_DEFINED = 1 << 4
ATTR_BYTE = 1 << 5

# tokenizer.ggml.token_type values: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte
_TYPE_TO_ATTR = {
    1: ATTR_NORMAL,
    2: ATTR_UNKNOWN,
    3: ATTR_CONTROL,
    4: ATTR_USER_DEFINED,
    5: ATTR_UNUSED,
    6: ATTR_BYTE,
}

# tokens cut out of the text before tokenizing (llama.cpp's cache_special_tokens)
_SPECIAL_ATTRS = ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN

# texts llama.cpp treats as end of turn / end of generation whatever their declared type
_EOT_TEXTS = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
)
_EOG_TEXTS = _EOT_TEXTS + ("<|eom_id|>", "<|return|>", "<|call|>", "</s>")
# fill-in-the-middle pad / repository / file separator tokens also end generation in llama.cpp
_FIM_TEXTS = {
    "fim_pad_token_id": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep_token_id": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep_token_id": ("<|file_sep|>",),
}

_SPACE = "\u2581"  # SentencePiece's visible space, "▁"

# ---------------------------------------------------------------------------------------------------
# GPT-2's byte alphabet: printable bytes stand for themselves, the others are moved to U+0100.. in order


def _byte_alphabet() -> list[str]:
    kept = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = [""] * 256
    moved = 0
    for b in range(256):
        if b in kept:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + moved)
            moved += 1
    return table


_BYTE_TO_CHAR = _byte_alphabet()
_CHAR_TO_BYTE = {c: b for b, c in enumerate(_BYTE_TO_CHAR)}
# str.translate table from latin-1 text (one char per byte) to the byte alphabet
_LATIN1_TO_ALPHABET = {b: c for b, c in enumerate(_BYTE_TO_CHAR)}

# ---------------------------------------------------------------------------------------------------
# pre-tokenizers: llama.cpp's regexes per `tokenizer.ggml.pre`

# llama.cpp's \s is Unicode White_Space (its own table, not Python's str.isspace: no \x1c-\x1f)
_WS = r"\t\n\x0b\x0c\r\x20\x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"

# llama.cpp runs the GPT-2 regex with a hand-written matcher that also ends in "|\s+"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class PreTokenizer:
    """One `tokenizer.ggml.pre` kind: regexes applied in turn, and the flags llama.cpp sets with it."""

    regexes: tuple[str, ...]
    ignore_merges: bool = False  # a piece that is a whole token is that token, without merging
    add_bos: bool = False  # default when the file has no tokenizer.ggml.add_bos_token


_P_DEFAULT = PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"))
_P_GPT2 = PreTokenizer((_GPT2,))
_P_SMOLLM = PreTokenizer((r"\p{N}", _GPT2))  # digits one by one, then GPT-2
_P_LLAMA3 = PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True)
_P_LLAMA3_REGEX_ONLY = PreTokenizer((_LLAMA3,))  # dbrx, smaug: llama3's regex without its flags
_P_QWEN2 = PreTokenizer((_QWEN2,))

PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "default": _P_DEFAULT,
    "gpt-2": _P_GPT2,
    "phi-2": _P_GPT2,
    "mpt": _P_GPT2,
    "olmo": _P_GPT2,
    "jina-es": _P_GPT2,
    "jina-de": _P_GPT2,
    "gigachat": _P_GPT2,
    "jina-v2-es": _P_GPT2,
    "jina-v2-de": _P_GPT2,
    "smollm": _P_SMOLLM,
    "starcoder": _P_SMOLLM,
    "refact": _P_SMOLLM,
    "command-r": _P_SMOLLM,
    "codeshell": _P_SMOLLM,
    "exaone": _P_SMOLLM,
    "minerva-7b": _P_SMOLLM,
    "llama-bpe": _P_LLAMA3,
    "llama3": _P_LLAMA3,
    "llama-v3": _P_LLAMA3,
    "falcon3": _P_LLAMA3,
    "pixtral": _P_LLAMA3,
    "dbrx": _P_LLAMA3_REGEX_ONLY,
    "smaug-bpe": _P_LLAMA3_REGEX_ONLY,
    "qwen2": _P_QWEN2,
    "deepseek-r1-qwen": _P_QWEN2,
    "stablelm2": _P_QWEN2,
    "megrez": _P_QWEN2,
}


def _explicit_whitespace(pattern: str) -> str:
    r"""Rewrite \s and \S as llama.cpp's whitespace set (inside [...] too)."""
    out: list[str] = []
    in_class = False
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern):
            e = pattern[i + 1]
            if e == "s":
                out.append(_WS if in_class else f"[{_WS}]")
            elif e == "S":
                if in_class:
                    raise ValueError(r"\S inside a character class is not supported")
                out.append(f"[^{_WS}]")
            else:
                out.append(pattern[i : i + 2])
            i += 2
            continue
        if c == "[" and not in_class:
            in_class = True
        elif c == "]" and in_class:
            in_class = False
        out.append(c)
        i += 1
    return "".join(out)


_compiled: dict[str, Any] = {}


def _compile(pattern: str) -> Any:
    if pattern not in _compiled:
        _compiled[pattern] = regex.compile(_explicit_whitespace(pattern))
    return _compiled[pattern]


def pre_split(text: str, regexes: Iterable[str]) -> list[str]:
    """Cut text as llama.cpp's unicode_regex_split does: each regex splits every piece left by the
    previous one into its matches and the stretches between them (kept as pieces too)."""
    pieces = [text] if text else []
    for pattern in regexes:
        rx = _compile(pattern)
        out: list[str] = []
        for piece in pieces:
            pos = 0
            for m in rx.finditer(piece):
                a, b = m.span()
                if a > pos:
                    out.append(piece[pos:a])
                if b > a:
                    out.append(piece[a:b])
                pos = b
            if pos < len(piece):
                out.append(piece[pos:])
        pieces = out
    return pieces


_LONE_SURROGATE = regex.compile(r"[\ud800-\udfff]")

# ---------------------------------------------------------------------------------------------------
# reading the GGUF metadata


def scan_for_tokenizer(path: str | PathLike[str]) -> GGUFHeader:
    """A GGUF file's scan with what a tokenizer needs: every array loaded (`gguf.GGUFReader` makes
    one numpy view per array element, seconds for a 262k-token vocabulary; the scan takes ~0.2 s),
    token texts keeping invalid UTF-8 bytes (surrogateescape), as token_to_piece must give them
    back. The model loader can use the same scan (the engine reads a file once per load)."""
    return gguf_file.scan_gguf(path, load_arrays=True, errors="surrogateescape")


def header_metadata(
    header: GGUFHeader, prefixes: tuple[str, ...] = ("tokenizer.", "general.")
) -> dict[str, Any]:
    """The metadata keys of a scan that start with one of prefixes, as plain Python values."""
    import numpy as np

    return {
        key: value.tolist() if isinstance(value, np.ndarray) else value
        for key, value in header.metadata.items()
        if key.startswith(prefixes)
    }


def read_gguf_metadata(
    path: str | PathLike[str], prefixes: tuple[str, ...] = ("tokenizer.", "general.")
) -> dict[str, Any]:
    """The metadata keys of a GGUF file that start with one of prefixes, as plain Python values."""
    return header_metadata(scan_for_tokenizer(path), prefixes)


def _typed(meta: dict[str, Any], key: str, want: str, default: Any = None) -> Any:
    """meta[key] if it has the GGUF type a tokenizer needs (want: "str", "int", "bool", "strings",
    "ints", "numbers"), default when absent; else BadModelFile naming the key. A fuzzed or
    hand-made file may put any type under any key, and the code below trusts these types."""
    value = meta.get(key)
    if value is None:
        return default
    scalar = {"str": (str,), "int": (int,), "bool": (bool, int)}
    item = {"strings": (str,), "ints": (int,), "numbers": (int, float)}
    if want in scalar:
        ok = isinstance(value, scalar[want]) and (want == "bool" or not isinstance(value, bool))
    else:
        ok = isinstance(value, list) and all(isinstance(v, item[want]) for v in value)
    if not ok:
        shown = f"an array of {len(value)}" if isinstance(value, list) else repr(value)[:40]
        expected = {"str": "a string", "int": "an integer", "bool": "a boolean"}.get(
            want, f"an array of {want}"
        )
        raise BadModelFile(f"metadata key {key!r} is {shown}, expected {expected}")
    return value


_BYTE_TOKEN = regex.compile(r"<0x[0-9A-Fa-f]{2}>")


# ---------------------------------------------------------------------------------------------------
# the tokenizer


class SpecialSplitter:
    """Cuts special tokens out of text with llama.cpp's result: tokens in priority order (longest
    first), each one splitting, at its leftmost non-overlapping occurrences, every stretch of text
    that no earlier token has taken.

    Done token by token over the text, that is (special tokens present) x (stretches of text): a
    text dense in distinct special tokens (Gemma has 6,414) took seconds per 100 KB. Here one
    regex pass finds, at every position, the longest special token starting there; the candidates
    are then taken in priority order (ties: leftmost first), each one kept when its span is still
    free. A candidate whose span overlaps a taken one gives way to the next shorter special token
    at the same position (the only others that can start there); one whose first character is
    taken is dropped. The work is linear in the text (times the longest special token at most).
    """

    def __init__(self, tokens: list[tuple[str, int]]) -> None:
        self.tokens = [t for t, _ in tokens]  # by priority; texts are distinct (duplicates are refused)
        self.ids = [i for _, i in tokens]
        self.priority = {t: k for k, t in enumerate(self.tokens)}
        self._shorter: dict[int, int | None] = {}
        self.pattern: regex.Pattern[str] | None = None
        if self.tokens:
            try:
                self.pattern = regex.compile(_trie_pattern(self.tokens))
            except RecursionError:  # a hostile vocabulary's deep chain of prefixes: the flat form
                self.pattern = regex.compile("|".join(map(regex.escape, self.tokens)))

    def shorter(self, k: int) -> int | None:
        """The priority of the longest special token that is a proper prefix of token k."""
        if k not in self._shorter:
            tok = self.tokens[k]
            self._shorter[k] = next(
                (self.priority[tok[:n]] for n in range(len(tok) - 1, 0, -1) if tok[:n] in self.priority), None
            )
        return self._shorter[k]

    def split(self, text: str) -> list[str | int]:
        """Text -> its stretches of text and the ids of the special tokens cut out, in order."""
        if not text:
            return []
        if self.pattern is None:
            return [text]
        # priority -> start positions, each position the longest match there (regex tries longest first)
        found: dict[int, list[int]] = {}
        for m in self.pattern.finditer(text, overlapped=True):
            found.setdefault(self.priority[m.group()], []).append(m.start())
        taken = bytearray(len(text))
        cuts: list[tuple[int, int]] = []  # (start, priority)
        for k in range(len(self.tokens)):  # priorities may be added (shorter tokens) on the way
            starts = found.pop(k, None)
            if starts is None:
                continue
            size = len(self.tokens[k])
            for p in sorted(starts):
                if taken[p]:
                    continue  # so is every candidate starting here
                if taken.find(1, p, p + size) == -1:
                    taken[p : p + size] = b"\x01" * size
                    cuts.append((p, k))
                elif (s := self.shorter(k)) is not None:
                    found.setdefault(s, []).append(p)
        out: list[str | int] = []
        pos = 0
        for p, k in sorted(cuts):
            if p > pos:
                out.append(text[pos:p])
            out.append(self.ids[k])
            pos = p + len(self.tokens[k])
        if pos < len(text):
            out.append(text[pos:])
        return out


def _trie_pattern(tokens: list[str]) -> str:
    """A regex matching the longest of `tokens` at a position: the tokens as a trie of groups
    (children before the end of a shorter token, so the longest wins), each run of single
    children one literal."""
    end = ""  # a trie key no character can be
    trie: dict[str, Any] = {}
    for tok in tokens:
        node = trie
        for ch in tok:
            node = node.setdefault(ch, {})
        node[end] = True

    def pattern(node: dict[str, Any]) -> str:
        alts = []
        for ch, child in node.items():
            if ch == end:
                continue
            literal = ch
            while len(child) == 1 and end not in child:  # a chain: one literal
                ((ch2, child),) = child.items()
                literal += ch2
            alts.append(regex.escape(literal) + pattern(child))
        if not alts:
            return ""
        body = "(?:" + "|".join(alts) + ")"
        return body + "?" if end in node else body

    return pattern(trie)


class Tokenizer:
    """A GGUF vocabulary's tokenizer: ``encode`` text to ids and ``decode`` ids back, as llama.cpp does.

    Attributes: ``kind`` ("bpe" or "spm"), ``pre`` (the pre-tokenizer name), ``n_vocab``, ``bos_id``,
    ``eos_id`` (None when absent), ``eog_ids`` (ids that end generation), ``add_bos``, ``add_eos``,
    ``add_space_prefix``, ``tokens`` (the vocabulary's strings), ``attrs`` (ATTR_* bits per token).
    """

    def __init__(self, meta: dict[str, Any]) -> None:
        model = _typed(meta, "tokenizer.ggml.model", "str")
        if model is None:
            raise BadModelFile(
                "the GGUF file has no tokenizer (tokenizer.ggml.model is missing)",
                hint="convert the model again with llama.cpp's convert_hf_to_gguf.py",
            )
        tokens = _typed(meta, "tokenizer.ggml.tokens", "strings")
        if not tokens:
            raise BadModelFile(
                "the GGUF file has no vocabulary (tokenizer.ggml.tokens is missing)",
                hint="convert the model again with llama.cpp's convert_hf_to_gguf.py",
            )
        self.n_vocab = n = len(tokens)
        # llama.cpp renames empty tokens so that every text is distinct
        self.tokens: list[str] = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        self._token_to_id: dict[str, int] = {t: i for i, t in enumerate(self.tokens)}
        if len(self._token_to_id) != n:
            seen: dict[str, int] = {}
            for i, t in enumerate(self.tokens):
                if t in seen:
                    raise BadModelFile(f"duplicate token in vocabulary: {t!r} has ids {seen[t]} and {i}")
                seen[t] = i

        types = _typed(meta, "tokenizer.ggml.token_type", "ints")
        if types is None:
            self.attrs = [ATTR_NORMAL] * n
        else:
            if len(types) < n:
                raise BadModelFile(f"tokenizer.ggml.token_type has {len(types)} entries for {n} tokens")
            self.attrs = [_TYPE_TO_ATTR.get(t, ATTR_UNDEFINED) for t in types[:n]]
        for i, a in enumerate(self.attrs):
            if a & ATTR_BYTE and not _BYTE_TOKEN.fullmatch(self.tokens[i]):
                raise BadModelFile(f"token {i} is of type BYTE but its text {self.tokens[i]!r} is not <0xXX>")
        if not any(a & (ATTR_NORMAL | ATTR_BYTE | ATTR_USER_DEFINED) for a in self.attrs):
            # no token could stand for text: every prompt would encode to nothing
            raise BadModelFile(
                "no token of the vocabulary is NORMAL, BYTE or USER_DEFINED (tokenizer.ggml.token_type): "
                "text cannot be tokenized"
            )
        scores = _typed(meta, "tokenizer.ggml.scores", "numbers")
        self._scores: list[float] = list(scores[:n]) if scores is not None else [0.0] * n

        # vocabulary kind and llama.cpp's defaults for it
        self.pre = _typed(meta, "tokenizer.ggml.pre", "str") or "default"
        if model == "gpt2":
            self.kind = "bpe"
            pre = PRE_TOKENIZERS.get(self.pre)
            if pre is None:
                raise UnsupportedArchitecture(
                    f"unsupported BPE pre-tokenizer {self.pre!r} (tokenizer.ggml.pre)",
                    hint="supported: " + ", ".join(sorted(PRE_TOKENIZERS)),
                )
            self._pre = pre
            merges = _typed(meta, "tokenizer.ggml.merges", "strings")
            if merges is None:
                raise BadModelFile("a BPE vocabulary without tokenizer.ggml.merges")
            # "left right" -> rank; the first occurrence of a pair wins, as in llama.cpp
            self._ranks: dict[str, int] = {}
            for i, m in enumerate(merges):
                self._ranks.setdefault(m, i)
            bos, eos, unk = 11, 11, None  # llama.cpp's defaults (overridden by the file's ids)
            add_bos, add_eos, add_space_prefix = pre.add_bos, False, False
        elif model == "llama":
            self.kind = "spm"
            self._pre = _P_DEFAULT  # unused: SPM has no pre-tokenizer
            self._ranks = {}
            bos, eos, unk = 1, 2, 0
            add_bos, add_eos, add_space_prefix = True, False, True
        else:
            raise UnsupportedArchitecture(
                f"unsupported tokenizer model {model!r} (tokenizer.ggml.model)",
                hint="supported: gpt2 (byte-level BPE), llama (SentencePiece-style)",
            )

        def special_id(key: str, default: int | None) -> int | None:
            if default is not None and default >= n:
                default = None
            value = _typed(meta, f"tokenizer.ggml.{key}", "int")
            if value is None or not 0 <= value < n:
                return default
            return int(value)

        self.bos_id = special_id("bos_token_id", bos)
        self.eos_id = special_id("eos_token_id", eos)
        self.unk_id = special_id("unknown_token_id", unk)
        self.eot_id = special_id("eot_token_id", None)
        self.eom_id = special_id("eom_token_id", None)
        self.add_bos = bool(_typed(meta, "tokenizer.ggml.add_bos_token", "bool", add_bos))
        self.add_eos = bool(_typed(meta, "tokenizer.ggml.add_eos_token", "bool", add_eos))
        self.add_space_prefix = bool(
            _typed(meta, "tokenizer.ggml.add_space_prefix", "bool", add_space_prefix)
        )
        if self.add_bos and self.bos_id is None:
            raise BadModelFile("tokenizer.ggml.add_bos_token is true, but there is no bos_token_id")
        if self.add_eos and self.eos_id is None:
            raise BadModelFile("tokenizer.ggml.add_eos_token is true, but there is no eos_token_id")

        # end of turn / generation: llama.cpp recognises these by text and makes them control tokens
        if self.eot_id is None:
            self.eot_id = next((self._token_to_id[t] for t in _EOT_TEXTS if t in self._token_to_id), None)
        eog = {self._token_to_id[t] for t in _EOG_TEXTS if t in self._token_to_id}
        for key, texts in _FIM_TEXTS.items():
            found = special_id(key, None)
            if found is None:
                found = next((self._token_to_id[t] for t in texts if t in self._token_to_id), None)
            if found is not None:
                eog.add(found)
        for i in eog | {x for x in (self.eot_id, self.eom_id) if x is not None}:
            self.attrs[i] |= ATTR_CONTROL
        eog |= {x for x in (self.eos_id, self.eot_id, self.eom_id) if x is not None}
        self.eog_ids: frozenset[int] = frozenset(eog)

        # special tokens cut out of text before tokenizing, longest first
        special = [i for i, a in enumerate(self.attrs) if a & _SPECIAL_ATTRS]
        special.sort(key=lambda i: -len(self.tokens[i]))
        self._special_all = [(self.tokens[i], i) for i in special]
        # without parse_special, control and unknown tokens stay text (even when also user-defined)
        self._special_user = [
            (t, i) for t, i in self._special_all if not self.attrs[i] & (ATTR_CONTROL | ATTR_UNKNOWN)
        ]
        self._splitters: dict[bool, SpecialSplitter] = {}  # by parse_special, made on first use
        # tokens after which SPM encoding adds a space prefix (see decode)
        self._fragment_breaks = frozenset(
            i
            for i in special
            if self.attrs[i] & (ATTR_CONTROL | ATTR_UNKNOWN) or _SPACE not in self.tokens[i]
        )

        self._byte_ids: list[int | None] = [self._find_byte_token(b) for b in range(256)]
        self._pieces: list[bytes | None] = [None] * n
        self._bpe_cache: dict[str, tuple[int, ...]] = {}

    # -- construction ---------------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, path: str | PathLike[str]) -> Tokenizer:
        """Build from a path to a .gguf file (only its metadata header is read)."""
        return cls.from_header(scan_for_tokenizer(path))

    @classmethod
    def from_header(cls, header: GGUFHeader) -> Tokenizer:
        """Build from a file's scan made by scan_for_tokenizer (BadModelFile names the file)."""
        try:
            return cls(header_metadata(header))
        except BadModelFile as e:
            if e.details.get("path"):
                raise
            path = str(header.path)
            raise type(e)(f"{path}: {e.message}", hint=e.hint, path=path) from None

    @classmethod
    def from_metadata(cls, meta: dict[str, Any]) -> Tokenizer:
        """Build from GGUF metadata already read as plain values ({"tokenizer.ggml.tokens": [...], ...})."""
        return cls(meta)

    def _find_byte_token(self, b: int) -> int | None:
        if self.kind == "spm":
            # "<0xXX>", else the byte itself as a one-character token (llama.cpp's byte_to_token)
            i = self._token_to_id.get(f"<0x{b:02X}>")
            if i is None and b < 0x80:
                i = self._token_to_id.get(chr(b))
            return i
        return self._token_to_id.get(chr(b)) if b < 0x80 else None

    # -- encoding -------------------------------------------------------------------------------------

    def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of text. add_special: add BOS/EOS as the model asks (add_bos_token, add_eos_token);
        parse_special: special tokens written in the text (``<|im_start|>``) become their ids."""
        if _LONE_SURROGATE.search(text):
            text = _LONE_SURROGATE.sub("\ufffd", text)  # llama.cpp reads invalid UTF-8 as U+FFFD
        out: list[int] = []
        if add_special and self.add_bos:
            out.append(self.bos_id)  # type: ignore[arg-type]
        fragments = self._split_special(text, parse_special)
        if self.kind == "spm":
            prev_special = True  # the space prefix goes at the start and after each special token
            for frag in fragments:
                if isinstance(frag, int):
                    out.append(frag)
                    prev_special = True
                    continue
                if self.add_space_prefix and prev_special:
                    frag = " " + frag
                self._encode_spm(frag.replace(" ", _SPACE), out)
                prev_special = False
        else:
            for frag in fragments:
                if isinstance(frag, int):
                    out.append(frag)
                else:
                    self._encode_bpe(frag, out)
        if add_special and self.add_eos:
            out.append(self.eos_id)  # type: ignore[arg-type]
        return out

    def _split_special(self, text: str, parse_special: bool) -> list[str | int]:
        splitter = self._splitters.get(parse_special)
        if splitter is None:
            tokens = self._special_all if parse_special else self._special_user
            splitter = self._splitters[parse_special] = SpecialSplitter(tokens)
        return splitter.split(text)

    def _encode_bpe(self, text: str, out: list[int]) -> None:
        cache = self._bpe_cache
        for word in pre_split(text, self._pre.regexes):
            word = word.encode("utf-8").decode("latin-1").translate(_LATIN1_TO_ALPHABET)
            ids = cache.get(word)
            if ids is None:
                ids = self._bpe_word(word)
                if len(cache) > 200_000:
                    cache.clear()
                cache[word] = ids
            out.extend(ids)

    def _bpe_word(self, word: str) -> tuple[int, ...]:
        vocab = self._token_to_id
        if self._pre.ignore_merges and word in vocab:
            return (vocab[word],)
        ranks = self._ranks
        syms = list(word)  # one symbol per character of the byte alphabet; "" once merged away
        n = len(syms)
        prev = list(range(-1, n - 1))
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        heap: list[tuple[int, int, int, str]] = []
        for i in range(n - 1):
            r = ranks.get(syms[i] + " " + syms[i + 1])
            if r is not None:
                heap.append((r, i, i + 1, syms[i] + syms[i + 1]))
        heapq.heapify(heap)
        # lowest rank first, leftmost on ties; a pair whose symbols changed since it was queued is stale
        while heap:
            _, left, right, merged = heapq.heappop(heap)
            if not syms[left] or not syms[right] or syms[left] + syms[right] != merged:
                continue
            syms[left] = merged
            syms[right] = ""
            nxt[left] = after = nxt[right]
            if after >= 0:
                prev[after] = left
            for a, b in ((prev[left], left), (left, after)):
                if a >= 0 and b >= 0:
                    r = ranks.get(syms[a] + " " + syms[b])
                    if r is not None:
                        heapq.heappush(heap, (r, a, b, syms[a] + syms[b]))
        ids: list[int] = []
        for s in syms:
            if not s:
                continue
            tid = vocab.get(s)
            if tid is not None:
                ids.append(tid)
            else:
                # not a token: llama.cpp looks each byte up as a one-byte token and drops the misses
                for b in s.encode("utf-8"):
                    t = self._byte_ids[b] if b < 0x80 else None
                    if t is not None:
                        ids.append(t)
        return tuple(ids)

    def _encode_spm(self, text: str, out: list[int]) -> None:
        n = len(text)
        if n == 0:
            return
        vocab = self._token_to_id
        scores = self._scores
        size = [1] * n  # symbol i covers text[i:i+size[i]]; 0 once merged into its left neighbour
        prev = list(range(-1, n - 1))
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        heap: list[tuple[float, int, int, int]] = []

        def bigram(left: int, right: int) -> None:
            piece = text[left : right + size[right]]
            tid = vocab.get(piece)
            if tid is not None:
                # highest score first, leftmost on ties
                heapq.heappush(heap, (-scores[tid], left, right, len(piece)))

        for i in range(n - 1):
            bigram(i, i + 1)
        while heap:
            _, left, right, length = heapq.heappop(heap)
            if size[left] == 0 or size[right] == 0 or size[left] + size[right] != length:
                continue  # stale: one side was merged since
            size[left] = length
            size[right] = 0
            nxt[left] = after = nxt[right]
            if after >= 0:
                prev[after] = left
            if prev[left] >= 0:
                bigram(prev[left], left)
            if after >= 0:
                bigram(left, after)
        i = 0
        while i >= 0:
            piece = text[i : i + size[i]]
            tid = vocab.get(piece)
            if tid is not None:
                out.append(tid)
            else:
                for b in piece.encode("utf-8"):
                    t = self._byte_ids[b]
                    if t is None:
                        raise BadModelFile(f"the vocabulary has no byte token <0x{b:02X}>")
                    out.append(t)
            i = nxt[i]

    # -- decoding -------------------------------------------------------------------------------------

    def token_to_piece(self, token_id: int, special: bool = True) -> bytes:
        """The bytes one token stands for (may be part of a UTF-8 sequence), as llama_token_to_piece:
        control and unknown tokens give their text only when special is true."""
        attr = self.attrs[token_id]
        if attr & (ATTR_CONTROL | ATTR_UNKNOWN) and not special:
            return b""
        piece = self._pieces[token_id]
        if piece is None:
            piece = self._pieces[token_id] = self._make_piece(token_id, attr)
        return piece

    def _make_piece(self, token_id: int, attr: int) -> bytes:
        text = self.tokens[token_id]
        if attr & (ATTR_CONTROL | ATTR_UNKNOWN | ATTR_USER_DEFINED):
            return text.encode("utf-8", "surrogateescape")
        if attr & ATTR_NORMAL:
            if self.kind == "spm":
                return text.replace(_SPACE, " ").encode("utf-8", "surrogateescape")
            out = bytearray()
            for c in text:
                b = _CHAR_TO_BYTE.get(c)
                if b is not None:
                    out.append(b)
                else:  # what llama.cpp writes for a character outside the byte alphabet
                    raw = c.encode("utf-8", "surrogateescape")
                    out += (
                        b"[UNK_BYTE_0x" + raw.hex().encode() + text.encode("utf-8", "surrogateescape") + b"]"
                    )
            return bytes(out)
        if attr & ATTR_BYTE:
            return bytes([int(text[3:5], 16)])
        return b""  # unused and undefined tokens have no text

    def decode(self, ids: Iterable[int], special: bool = False) -> str:
        """Text of ids: the inverse of encode, so decode(encode(x, add_special=False)) == x.

        The pieces are concatenated (special: render control tokens such as ``<|im_end|>``); for an SPM
        vocabulary with add_space_prefix, the one space that encode put at the start and after each
        special token is taken off again. Invalid UTF-8 becomes U+FFFD. For generated text streamed
        token by token, use :class:`StreamDecoder` (it does not remove spaces)."""
        buf = bytearray()
        strip = self.kind == "spm" and self.add_space_prefix
        after_break = True
        for i in ids:
            piece = self.token_to_piece(i, special)
            if i in self._fragment_breaks:
                after_break = True
            elif after_break:
                after_break = False
                if strip and piece.startswith(b" "):
                    piece = piece[1:]
            buf += piece
        return buf.decode("utf-8", "replace")

    def is_eog(self, token_id: int) -> bool:
        return token_id in self.eog_ids

    def token_id(self, text: str) -> int | None:
        """The id of the token whose text is exactly text, or None."""
        return self._token_to_id.get(text)

    def __len__(self) -> int:
        return self.n_vocab

    def __repr__(self) -> str:
        return f"Tokenizer(kind={self.kind!r}, pre={self.pre!r}, n_vocab={self.n_vocab})"


class StreamDecoder:
    """Text of generated tokens as they come, never splitting a UTF-8 sequence.

    >>> dec = StreamDecoder(tok)
    >>> for t in generated: print(dec.push(t), end="")
    >>> print(dec.flush())

    Each push returns the text completed by that token ("" while a character is still partial);
    flush returns what is left (an incomplete tail as U+FFFD). Pieces are taken as they are, like
    llama.cpp's streaming output (no space is removed)."""

    def __init__(self, tokenizer: Tokenizer, special: bool = False) -> None:
        self.tokenizer = tokenizer
        self.special = special
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def push(self, token_id: int) -> str:
        return self._utf8.decode(self.tokenizer.token_to_piece(token_id, self.special))

    def flush(self) -> str:
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text
