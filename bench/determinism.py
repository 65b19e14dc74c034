"""How much an engine's logits move with the thread count and the batch split, measured.

    python -m stdengine.bench.determinism [--engines reference,llamacpp] [--models A,B] [--tokens 80]

For each engine and catalogue model, the same token sequence is decoded in several layouts (2
threads and one batch as the baseline; 1 and 3 threads; ubatches of 1, 7 and 17; two decode() calls)
and every position's logits are compared with the baseline's: how many positions are not
bit-identical, and the largest absolute difference of a logit. The reference engine promises 0
(spec/reference-engine.md, "Determinism"); this prints what each engine does, with the machine.
"""

from __future__ import annotations

import argparse
import io
import sys
from typing import Any

import numpy as np
from stdengine.bench.compare_llamacpp import MODELS, machine

from stdengine.events import Emitter
from stdengine.options import Options
from stdengine.registry import engine_class
from stdengine.store import resolve_model

LAYOUTS: dict[str, dict[str, Any]] = {
    "threads=1": {"threads": 1},
    "threads=3": {"threads": 3},
    "ubatch=1": {"ubatch_size": 1},
    "ubatch=7": {"ubatch_size": 7},
    "ubatch=17": {"ubatch_size": 17},
    "two calls": {"two_calls": True},
}


def logits(
    engine_name: str,
    model: str,
    tokens: list[int],
    threads: int = 2,
    ubatch_size: int = 512,
    two_calls: bool = False,
) -> np.ndarray:
    """Every position's logits, one decode() per ubatch; with two_calls, the whole sequence first,
    then (after a reset) the first half and the second half in two calls."""
    cls = engine_class(engine_name)
    opts = Options(
        model=model,
        engine=engine_name,
        threads=threads,
        ubatch_size=ubatch_size,
        batch_size=512,
        ctx_size=1024,
    )
    engine = cls.load(opts, Emitter(stream=io.StringIO()))
    try:
        rows = []
        if two_calls:
            half = len(tokens) // 2
            engine.decode(tokens, all_logits=True)
            engine.reset()
            rows.append(engine.decode(tokens[:half], all_logits=True))
            rows.append(engine.decode(tokens[half:], all_logits=True))
        else:
            for i in range(0, len(tokens), ubatch_size):
                rows.append(engine.decode(tokens[i : i + ubatch_size], all_logits=True))
        return np.concatenate(rows).astype(np.float32)
    finally:
        close = getattr(engine, "close", None)
        if close:
            close()


def measure(engine_name: str, model: str, n_tokens: int) -> list[tuple[str, int, float]]:
    path = str(resolve_model(model))
    rng = np.random.default_rng(1234)
    tokens = [int(t) for t in rng.integers(100, 30000, n_tokens)]
    base = logits(engine_name, path, tokens)
    out = []
    for name, kw in LAYOUTS.items():
        got = logits(engine_name, path, tokens, **kw)
        differ = int((got.view(np.uint32) != base.view(np.uint32)).any(axis=1).sum())
        out.append((name, differ, float(np.abs(got.astype(np.float64) - base).max())))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--engines", default="reference,llamacpp", help="comma-separated engines (default %(default)s)"
    )
    ap.add_argument(
        "--models", default=",".join(MODELS), help="comma-separated catalogue aliases or GGUF paths"
    )
    ap.add_argument("--tokens", type=int, default=80, help="tokens of text compared (default %(default)s)")
    args = ap.parse_args(argv)
    m = machine()
    print(f"machine: {m['cpu']}, {m['logical_cpus']} CPUs; {m['date']}; stdengine {m['stdengine_commit']}")
    print(f"{args.tokens} tokens; baseline: 2 threads, one ubatch of all of them\n")
    print("| engine | model | layout | positions not bit-identical | max abs logit difference |")
    print("|---|---|---|---:|---:|")
    for engine_name in args.engines.split(","):
        for model in args.models.split(","):
            for name, differ, worst in measure(engine_name, model, args.tokens):
                print(f"| {engine_name} | {model} | {name} | {differ} of {args.tokens} | {worst:.3g} |")
            sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
