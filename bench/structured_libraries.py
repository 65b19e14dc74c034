"""Constrained-decoding libraries compared on the catalogue models' vocabularies: llguidance (the
project's), xgrammar and outlines-core: compile time, per-token mask time, and whether every
output is valid.

    python -m stdengine.bench.structured_libraries [--models A,B] [--walks 3] [--steps 128]

Only llguidance is a project dependency. Try the others in a scratch venv, never the project's
(xgrammar pulls in torch):

    python3.11 -m venv /tmp/sv
    /tmp/sv/bin/pip install numpy regex jsonschema llguidance xgrammar outlines-core
    cp .venv/lib/python3.11/site-packages/__editable__*stdengine* /tmp/sv/lib/python3.11/site-packages/
    /tmp/sv/bin/python -m stdengine.bench.structured_libraries

(the copied .pth and finder put this checkout on the scratch venv's path, as the project's venv
has it). A library that is not installed is skipped.

The vocabulary of each model comes from its GGUF through the project's tokenizer (no weights
loaded): each token's bytes, control tokens excluded, the end-of-generation ids. The cases are
the conformance suite's JSON schemas (nested, array, enum, numbers, required, pattern) and
regular expressions. No model runs: each output is a random walk over the allowed tokens (seeded;
an allowed end-of-generation token is taken half the time), so it explores far more of the
constraint than a model's greedy answer, and each finished output is judged by jsonschema or
Python's re, never by a library. Times: "compile" is building the matcher for the case and its
first mask (some libraries compile lazily); "mask" the median and 90th percentile of the masks
after it, over all walks; the vocabulary's one-time preparation is printed per library.
spec/structured.md, "Why llguidance", has the table and the reading.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
from stdengine.bench.compare_llamacpp import MODELS, machine
from stdengine.conformance.structured import REGEXES, SCHEMAS

from stdengine.store import resolve_model
from stdengine.structured import JSON_OPTIONS, Vocabulary

WHITESPACE = JSON_OPTIONS["whitespace_pattern"]  # the same bounded JSON whitespace for all three
WHITESPACE_MAX = 20


@dataclass
class Case:
    name: str
    kind: str  # "json_schema" or "regex"
    source: Any  # the schema or the pattern

    def valid(self, text: str) -> bool:
        import jsonschema

        if self.kind == "regex":
            return re.fullmatch(self.source, text) is not None
        try:
            value = json.loads(text)
        except ValueError:
            return False
        return not list(jsonschema.Draft202012Validator(self.source).iter_errors(value))


CASES = [Case(c.name, "json_schema", c.schema) for c in SCHEMAS] + [
    Case(name, "regex", pattern) for name, (_, pattern) in REGEXES.items()
]


class Walk:
    """One library's matcher for one case: mask() fills the int32 bitmask (1 = allowed),
    accept() advances by a token (an end-of-generation one ends the walk)."""

    mask: Callable[[np.ndarray], object]
    accept: Callable[[int], object]


def vocabulary(model: str) -> Vocabulary:
    """The model's vocabulary as the reference engine gives it to the mask."""
    from stdengine.reference.adapter import ReferenceEngine
    from stdengine.reference.tokenizer import Tokenizer

    tk = Tokenizer.from_gguf(resolve_model(model))
    return ReferenceEngine._vocabulary(SimpleNamespace(tokenizer=tk, n_vocab=tk.n_vocab))


# --- the libraries: each a function vocabulary -> (case -> Walk) ---------------------------------
def llguidance_lib(vocab: Vocabulary) -> Callable[[Case], Walk]:
    import llguidance

    from stdengine.structured import Constraint, tokenizer_for

    class Owner:  # what the compiled vocabulary lives as long as (an engine's tokenizer)
        pass

    owner = Owner()
    tok = tokenizer_for(owner, lambda: vocab)

    def start(case: Case) -> Walk:
        assert owner
        c = (
            Constraint.json_schema(case.source)
            if case.kind == "json_schema"
            else Constraint.regex(case.source)
        )
        m = llguidance.LLMatcher(tok, c.compiled, log_level=0)  # the library alone
        w = Walk()
        w.mask = lambda bits: m.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
        w.accept = m.consume_token
        return w

    return start


def xgrammar_lib(vocab: Vocabulary) -> Callable[[Case], Walk]:
    import xgrammar as xgr

    special = set(vocab.special)
    pieces = [b"" if i in special else p for i, p in enumerate(vocab.pieces)]  # empty: never allowed
    info = xgr.TokenizerInfo(pieces, xgr.VocabType.RAW, vocab_size=len(pieces), stop_token_ids=vocab.eog)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def start(case: Case) -> Walk:
        if case.kind == "json_schema":
            g = compiler.compile_json_schema(
                json.dumps(case.source), any_whitespace=True, max_whitespace_cnt=WHITESPACE_MAX
            )
        else:
            g = compiler.compile_regex(case.source)
        m = xgr.GrammarMatcher(g)
        w = Walk()
        w.mask = lambda bits: m.fill_next_token_bitmask(bits.reshape(1, -1))
        w.accept = m.accept_token
        return w

    return start


def outlines_lib(vocab: Vocabulary) -> Callable[[Case], Walk]:
    import outlines_core as oc
    from outlines_core.json_schema import build_regex_from_schema

    skip = set(vocab.special) | set(vocab.eog)
    ids: dict[bytes, list[int]] = {}
    for i, piece in enumerate(vocab.pieces):
        if i not in skip and piece:
            ids.setdefault(piece, []).append(i)
    # one end-of-generation id: the library takes one
    voc = oc.Vocabulary(vocab.eog[0], ids)

    def start(case: Case) -> Walk:
        pattern = case.source
        if case.kind == "json_schema":
            pattern = build_regex_from_schema(json.dumps(case.source), whitespace_pattern=WHITESPACE)
        guide = oc.Guide(oc.Index(pattern, voc))
        w = Walk()
        w.mask = lambda bits: guide.write_mask_into(bits.ctypes.data, bits.size, 4)
        w.accept = lambda t: guide.advance(t, return_tokens=False)
        return w

    return start


LIBRARIES: dict[str, tuple[str, Callable[[Vocabulary], Callable[[Case], Walk]]]] = {
    "llguidance": ("llguidance", llguidance_lib),
    "xgrammar": ("xgrammar", xgrammar_lib),
    "outlines-core": ("outlines_core", outlines_lib),
}


# --- the walk ------------------------------------------------------------------------------------
@dataclass
class Tally:
    compile_s: list[float]
    mask_s: list[float]
    walks: int = 0
    finished: int = 0
    valid: int = 0
    invalid: list[str] | None = None


def walk(
    start: Callable[[Case], Walk], case: Case, vocab: Vocabulary, seed: int, steps: int, t: Tally
) -> None:
    rng = np.random.default_rng(seed)
    n = len(vocab.pieces)
    bits = np.zeros((n + 31) // 32, dtype=np.int32)
    eog = np.array(vocab.eog)
    t0 = time.perf_counter()
    w = start(case)
    out = b""
    for step in range(steps):
        bits[:] = 0
        t1 = time.perf_counter()
        w.mask(bits)
        t2 = time.perf_counter()
        if step == 0:
            t.compile_s.append(t2 - t0)
        else:
            t.mask_s.append(t2 - t1)
        allowed = np.flatnonzero(np.unpackbits(bits.view(np.uint8), count=n, bitorder="little"))
        ends = np.isin(allowed, eog)
        text_ids = allowed[~ends]
        if ends.any() and (not len(text_ids) or rng.random() < 0.5):
            t.finished += 1
            text = out.decode("utf-8", errors="replace")
            if case.valid(text):
                t.valid += 1
            else:
                t.invalid = (t.invalid or []) + [text[:80]]
            return
        if not len(text_ids):
            t.invalid = (t.invalid or []) + [f"nothing allowed after {out[:80]!r}"]
            return
        tok = int(rng.choice(text_ids))
        w.accept(tok)
        out += vocab.pieces[tok]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--libraries", default=",".join(LIBRARIES))
    ap.add_argument("--walks", type=int, default=3, help="random walks per case")
    ap.add_argument("--steps", type=int, default=128, help="tokens at most per walk")
    args = ap.parse_args(argv)
    import importlib
    import importlib.util

    print(f"# {machine()}; {len(CASES)} cases x {args.walks} walks of <= {args.steps} tokens")
    print(
        "| model | library | vocabulary prep s | compile ms (median, max) | mask us (median, p90) | valid / finished / walks |"
    )
    print("|---|---|---|---|---|---|")
    for model in args.models.split(","):
        vocab = vocabulary(model)
        for lib in args.libraries.split(","):
            module, make = LIBRARIES[lib]
            if importlib.util.find_spec(module) is None:
                print(f"| {model} | {lib} | not installed | | | |", flush=True)
                continue
            importlib.import_module(module)  # its import (xgrammar's pulls in torch) is not timed
            t0 = time.perf_counter()
            start = make(vocab)
            prep = time.perf_counter() - t0
            t = Tally([], [])
            for case in CASES:
                for seed in range(args.walks):
                    t.walks += 1
                    walk(start, case, vocab, seed, args.steps, t)
            comp = [1e3 * s for s in t.compile_s]
            mask = sorted(1e6 * s for s in t.mask_s)
            print(
                f"| {model} | {lib} | {prep:.2f} | {statistics.median(comp):.1f}, {max(comp):.1f} | "
                f"{statistics.median(mask):.0f}, {mask[int(0.9 * (len(mask) - 1))]:.0f} | "
                f"{t.valid} / {t.finished} / {t.walks} |",
                flush=True,
            )
            for bad in t.invalid or []:
                print(f"#   {lib} invalid: {bad!r}")


if __name__ == "__main__":
    main()
