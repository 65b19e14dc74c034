"""Hostile model files (issue 18): a mutation corpus, generated here from a valid tiny model.

Every mutant (truncations at many offsets, bit flips at seeded positions, huge counts and
lengths, overflowing dimensions, bad offsets and alignments, unknown types, metadata of the
wrong type, vocabulary and merges faults, hostile chat templates) is loaded with the reference
engine through the Python API and used (tokenize, detokenize, the chat template, two generated
tokens). What must hold: no crash and no hang (a per-case alarm), and the outcome is success
or an InferError with a documented exit status (spec/errors.md) — never "internal error" (1).
A handful go through `infer run` as a subprocess too.

The corpus is not stored: it is made from tests/gguf_factory.py's writer on every run. Field
positions come from gguf.GGUFReader (the gguf package's reader, not the code under test).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType
from gguf_factory import write_llama_gguf

from stdengine.adapter import GenerateRequest, SamplingParams
from stdengine.errors import InferError
from stdengine.events import null_emitter
from stdengine.options import Options

# what a hostile model file may end in: success, or a documented status (spec/errors.md):
# 2 (a request the template refuses), 4 (bad_model_file / unsupported_architecture), 5 (the
# prompt does not fit a context a damaged file made small)
ALLOWED = {0, 2, 4, 5}
CASE_TIMEOUT_S = 20  # per mutant; a healthy one takes milliseconds

TEMPLATE = "{% for m in messages %}<s>{{ m.role }}: {{ m.content }}</s>{% endfor %}"
# an SPM vocabulary with all 256 byte tokens, so any text tokenizes
TOKENS = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), "\u2581hello", "\u2581tok"]
N = len(TOKENS)
TOKEN_TYPES = [2, 3, 3, *([6] * 256), 1, 1]  # UNKNOWN, CONTROL, BYTE, NORMAL


def write_base(path: Path, extra_kv: dict[str, Any] | None = None) -> None:
    write_llama_gguf(
        path,
        weight_type="Q8_0",
        tokens=TOKENS,
        chat_template=TEMPLATE,
        token_types=TOKEN_TYPES,
        extra_kv=extra_kv,
    )


def exercise(path: Path) -> int:
    """Load path with the reference engine and use it; 0, or the InferError's exit status."""
    from stdengine.reference.adapter import ReferenceEngine

    try:
        engine = ReferenceEngine.load(Options(model=str(path), ctx_size=32, threads=1), null_emitter())
        try:
            ids = engine.tokenize("hello tok1 tok2", add_special=True, parse_special=True)
            engine.detokenize(ids)
            if engine.has_chat_template():
                engine.apply_chat_template([{"role": "user", "content": "hi"}])
            request = GenerateRequest(prompt="tok3 tok4", sampling=SamplingParams(n_predict=2, temp=0.0))
            for _ in engine.generate(request):
                pass
        finally:
            engine.close()
    except InferError as e:
        return e.exit_status
    return 0


class _Hung(Exception):
    pass


@contextlib.contextmanager
def deadline(seconds: int) -> Iterator[None]:
    """A hang becomes a failure of this case (SIGALRM, so the main thread only: pytest's)."""

    def fire(signum: int, frame: Any) -> None:
        raise _Hung(f"no result after {seconds} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def check_corpus(tmp: Path, mutants: dict[str, bytes]) -> dict[str, int]:
    """Run every mutant; assert each one's outcome is allowed; return name -> exit status."""
    outcomes: dict[str, int] = {}
    bad: list[str] = []
    path = tmp / "mutant.gguf"
    for name, data in mutants.items():
        path.write_bytes(data)
        try:
            with deadline(CASE_TIMEOUT_S):
                outcomes[name] = status = exercise(path)
        except Exception as e:  # a crash (an exception that is not an InferError) or a hang
            bad.append(f"{name}: {type(e).__name__}: {e}")
            continue
        if status not in ALLOWED:
            bad.append(f"{name}: exit status {status}")
    assert not bad, f"{len(bad)} of {len(mutants)} mutants broke the rules:\n" + "\n".join(bad[:30])
    return outcomes


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, bytes]:
    path = tmp_path_factory.mktemp("hostile") / "base.gguf"
    write_base(path)
    assert exercise(path) == 0  # the unmutated model works
    return path, path.read_bytes()


def _offset(reader: GGUFReader, part: np.ndarray) -> int:
    """Byte offset in the file of one of GGUFReader's part views."""
    return int(part.__array_interface__["data"][0] - reader.data.__array_interface__["data"][0])


def _patched(data: bytes, at: int, fmt: str, value: Any) -> bytes:
    out = bytearray(data)
    struct.pack_into("<" + fmt, out, at, value)
    return bytes(out)


def test_truncations(base: tuple[Path, bytes], tmp_path: Path) -> None:
    """The file cut at many offsets: dense in the header and metadata, spread over the tensors."""
    path, data = base
    reader = GGUFReader(path)
    data_start = int(reader.data_offset)
    cuts = sorted(
        {*range(0, 64), *range(64, data_start, 37), *range(data_start, len(data), max(1, len(data) // 60))}
    )
    outcomes = check_corpus(tmp_path, {f"cut at {n}": data[:n] for n in cuts})
    assert all(s == 4 for s in outcomes.values()), "a truncated file must be bad_model_file"


def test_bit_flips(base: tuple[Path, bytes], tmp_path: Path) -> None:
    """Single bits flipped at seeded positions: most in the header/metadata/tensor table, some in
    the weights (those load and generate from garbage, which is fine: no crash)."""
    path, data = base
    data_start = int(GGUFReader(path).data_offset)
    rng = np.random.default_rng(18)
    positions = [*rng.integers(4, data_start, 240), *rng.integers(data_start, len(data), 30)]
    mutants = {}
    for i, pos in enumerate(positions):
        out = bytearray(data)
        out[int(pos)] ^= 1 << int(rng.integers(0, 8))
        mutants[f"flip #{i} at byte {pos}"] = bytes(out)
    check_corpus(tmp_path, mutants)


def test_structural_faults(base: tuple[Path, bytes], tmp_path: Path) -> None:
    """Counts, lengths, dimensions, offsets, alignments and types set to hostile values."""
    path, data = base
    reader = GGUFReader(path)
    mutants: dict[str, bytes] = {}
    for value in (2**31, 2**62, 2**63 - 1, -1):
        mutants[f"n_tensors={value}"] = _patched(data, 8, "q", value)
        mutants[f"n_kv={value}"] = _patched(data, 16, "q", value)
    for key in ("general.architecture", "tokenizer.ggml.tokens", "tokenizer.chat_template"):
        field = reader.fields[key]
        key_len_at = _offset(reader, field.parts[0])
        for value in (2**40, 2**64 - 1):
            mutants[f"{key} key length {value}"] = _patched(data, key_len_at, "Q", value)
        type_at = _offset(reader, field.parts[2])
        for vtype in (13, 255, -1):
            mutants[f"{key} value type {vtype}"] = _patched(data, type_at, "i", vtype)
    tokens = reader.fields["tokenizer.ggml.tokens"]
    for value in (2**32, 2**60, 0):
        mutants[f"token count {value}"] = _patched(data, _offset(reader, tokens.parts[4]), "Q", value)
    mutants["first token length 2^40"] = _patched(data, _offset(reader, tokens.parts[5]), "Q", 2**40)
    for t in reader.tensors[:3] + reader.tensors[-2:]:
        parts = t.field.parts  # name length, name, n_dims, dims, type, offset
        dims_at, type_at, off_at = (_offset(reader, parts[i]) for i in (3, 4, 5))
        for value in (2**31, 2**62, 2**63 - 1, -5, 0):
            mutants[f"{t.name} dim0={value}"] = _patched(data, dims_at, "q", value)
        mutants[f"{t.name} n_dims=5"] = _patched(data, _offset(reader, parts[2]), "I", 5)
        for ttype in (4, 5, 99, 2**31 - 1, 0, 1, 30, 12):  # removed, unknown, larger and smaller types
            mutants[f"{t.name} type={ttype}"] = _patched(data, type_at, "i", ttype)
        for offset in (0, 1, 8, 2**40, 2**64 - 32, len(data)):
            mutants[f"{t.name} offset={offset}"] = _patched(data, off_at, "Q", offset)
    check_corpus(tmp_path, mutants)


# metadata values of the wrong type or meaning, written by the factory over its own keys
WRONG_METADATA: dict[str, dict[str, Any]] = {
    "context_length string": {"llama.context_length": "abc"},
    "context_length nan": {"llama.context_length": math.nan},
    "context_length inf": {"llama.context_length": math.inf},
    "context_length list": {"llama.context_length": [1, 2]},
    "context_length 2^40": {"llama.context_length": (2**40, GGUFValueType.UINT64)},
    "block_count 0": {"llama.block_count": 0},
    "block_count string": {"llama.block_count": "2"},
    "head_count 0": {"llama.attention.head_count": 0},
    "embedding_length float": {"llama.embedding_length": 64.0},
    "rms eps nan": {"llama.attention.layer_norm_rms_epsilon": math.nan},
    "rope base -1": {"llama.rope.freq_base": -1.0},
    "alignment 3": {"general.alignment": 3},
    "alignment 0": {"general.alignment": 0},
    "alignment 2^31": {"general.alignment": 2**31},
    "alignment string": {"general.alignment": "32"},
    "architecture int": {"general.architecture": 7},
    "architecture unknown": {"general.architecture": "mamba9"},
    "tokens string": {"tokenizer.ggml.tokens": "abc"},
    "tokens ints": {"tokenizer.ggml.tokens": list(range(N))},
    "tokens empty": {"tokenizer.ggml.tokens": []},
    "tokens duplicate": {"tokenizer.ggml.tokens": ["<unk>", "<s>", "</s>", *(["x"] * (N - 3))]},
    "merges string": {"tokenizer.ggml.merges": "a b"},
    "scores string": {"tokenizer.ggml.scores": "abc"},
    "scores short": {"tokenizer.ggml.scores": [0.5]},
    "token_type string": {"tokenizer.ggml.token_type": "abc"},
    "token_type int": {"tokenizer.ggml.token_type": 3},
    "token_type short": {"tokenizer.ggml.token_type": [1, 1]},
    "every token CONTROL": {"tokenizer.ggml.token_type": [3] * N},
    "every token BYTE": {"tokenizer.ggml.token_type": [6] * N},
    "token types unknown": {"tokenizer.ggml.token_type": [99] * N},
    "bos id string": {"tokenizer.ggml.bos_token_id": "x"},
    "bos id nan": {"tokenizer.ggml.bos_token_id": math.nan},
    "bos id out of range": {"tokenizer.ggml.bos_token_id": 10**6},
    "byte token text wrong": {"tokenizer.ggml.tokens": [*TOKENS[:3], "<0xZZ>", *TOKENS[4:]]},
    "eos id negative": {"tokenizer.ggml.eos_token_id": -3},
    "add_bos string": {"tokenizer.ggml.add_bos_token": "no"},
    "model int": {"tokenizer.ggml.model": 5},
    "model unknown": {"tokenizer.ggml.model": "rwkv"},
    "pre array": {"tokenizer.ggml.pre": ["a", "b"]},
    "template int": {"tokenizer.chat_template": 3},
    "template nested loops": {
        "tokenizer.chat_template": "{% for i in range(100000) %}{% for j in range(100000) %}"
        "{% endfor %}{% endfor %}"
    },
    "template string repetition": {"tokenizer.chat_template": "{{ 'x' * 2**31 }}"},
    "template recursive macro": {
        "tokenizer.chat_template": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}"
    },
    "template syntax error": {"tokenizer.chat_template": "{% for %}"},
    "template refuses": {"tokenizer.chat_template": "{{ raise_exception('no') }}"},
}

# the same faults in a byte-level BPE (gpt2) vocabulary, where merges and pre are read
BPE_TOKENS = ["<unk>", "<s>", "</s>", *"abcdefghijklmnopqrstuvwxyz", "ab", "abc"] + [
    f"t{i}" for i in range(33)
]
WRONG_BPE: dict[str, dict[str, Any]] = {
    "bpe merges string": {"tokenizer.ggml.merges": "a b"},
    "bpe merges ints": {"tokenizer.ggml.merges": [1, 2]},
    "bpe merges garbage": {"tokenizer.ggml.merges": ["a", "no such pair", "a b c d"]},
    "bpe pre array": {"tokenizer.ggml.pre": ["gpt-2"]},
    "bpe pre unknown": {"tokenizer.ggml.pre": "nonesuch"},
}


def _metadata_mutants(tmp_path: Path) -> dict[str, bytes]:
    # the writer warns when extra_kv overwrites one of its keys, which is the point here
    logging.getLogger("gguf.gguf_writer").setLevel(logging.ERROR)
    mutants = {}
    src = tmp_path / "src.gguf"
    for name, kv in WRONG_METADATA.items():
        write_base(src, kv)
        mutants[name] = src.read_bytes()
    for name, kv in WRONG_BPE.items():
        write_llama_gguf(
            src, weight_type="Q8_0", tokens=BPE_TOKENS, tokenizer_model="gpt2", tokenizer_pre="gpt-2",
            merges=["a b", "ab c"], extra_kv=kv,
        )  # fmt: skip
        mutants[name] = src.read_bytes()
    return mutants


def test_wrong_metadata(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Metadata of the wrong type or meaning: bad_model_file naming the key (never exit 1)."""
    outcomes = check_corpus(tmp_path, _metadata_mutants(tmp_path))
    for name in ("context_length string", "tokens string", "merges string", "bos id nan", "pre array"):
        assert outcomes[name] in (0, 4), name
    for name in (
        "every token CONTROL",
        "template nested loops",
        "template recursive macro",
        "bpe merges string",
    ):
        assert outcomes[name] == 4, name


def _infer(
    *args: str, env: dict[str, str] | None = None, stdin: bytes | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "stdengine.cli.main", *args],
        input=stdin,
        capture_output=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def test_a_handful_through_the_cli(base: tuple[Path, bytes], tmp_path: Path) -> None:
    """`infer run` on a few mutants: one line naming the file, exit 4 (never a traceback or 1)."""
    path, data = base
    reader = GGUFReader(path)
    cases: dict[str, bytes] = {
        "truncated": data[: len(data) // 2],
        "n_kv huge": _patched(data, 16, "q", 2**62),
        "overlapping tensor": _patched(data, _offset(reader, reader.tensors[1].field.parts[5]), "Q", 0),
    }
    cases.update(
        {
            k: v
            for k, v in _metadata_mutants(tmp_path).items()
            if k in ("context_length nan", "template recursive macro")
        }
    )
    for name, mutant in cases.items():
        p = tmp_path / f"{name.replace(' ', '_')}.gguf"
        p.write_bytes(mutant)
        args = ["run", "-m", str(p), "-e", "reference", "-n", "2", "-c", "32"]
        if "template" not in name:
            args.append("--raw")
        r = _infer(*args, "-p", "hello")
        assert r.returncode == 4, (name, r.returncode, r.stderr.decode()[-600:])
        assert str(p) in r.stderr.decode() and "Traceback" not in r.stderr.decode(), name
