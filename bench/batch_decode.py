"""One-token steps of N contexts of one model: batched (one se_decode_batch per step, the weights
read once) against N separate se_decode calls per step, in one process, in alternation.

    python -m stdengine.bench.batch_decode MODEL [-n 1 2 4 8 16] [-t 2] [--steps 16] [--rounds 5]

Each context first holds its own 32-token prompt; a round times `--steps` steps of every context
in each mode (the contexts truncated back to their prompts before each), A B A B, and the table
gives the median aggregate tokens/s of the rounds, its min-max, and the ratio batched/separate.
`--modes separate` times se_decode alone (it runs on a build without se_decode_batch, for an
old/new comparison of the single-context path).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from stdengine.reference.core import Context
from stdengine.reference.model import Model

PROMPT = 32


def _round(mode: str, contexts: list[Context], steps: int, rng: np.random.Generator) -> float:
    """Aggregate tokens/s of `steps` one-token steps of every context."""
    from stdengine.reference import core

    for c in contexts:
        c.truncate(PROMPT)
    toks = rng.integers(100, 30000, (steps, len(contexts))).tolist()
    t0 = time.perf_counter()
    for row in toks:
        if mode == "batched":
            core.decode_batch(contexts, [[t] for t in row])
        else:
            for c, t in zip(contexts, row, strict=True):
                c.decode([t])
    return steps * len(contexts) / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="GGUF file, or a catalogue alias")
    ap.add_argument("-n", type=int, nargs="+", default=[1, 2, 4, 8, 16], help="context counts")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=16, help="one-token steps per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--modes", nargs="+", default=["batched", "separate"], choices=["batched", "separate"])
    args = ap.parse_args(argv)
    path = args.model
    if not path.endswith(".gguf"):
        from stdengine.store import resolve_model

        path = str(resolve_model(path))
    rng = np.random.default_rng(0)
    print(
        f"model {path}, {args.threads} threads, {args.steps} steps x {args.rounds} rounds, tokens/s aggregate"
    )
    print("| N | " + " | ".join(f"{m} t/s (min-max)" for m in args.modes) + " | batched/separate |")
    print("|---|" + "---|" * (len(args.modes) + 1))
    with Model.load(path) as model:
        for n in args.n:
            contexts = [Context(model, n_ctx=PROMPT + args.steps, n_threads=args.threads) for _ in range(n)]
            for c in contexts:
                c.decode(rng.integers(100, 30000, PROMPT).tolist())
            _round(args.modes[0], contexts, 2, rng)  # warm-up: pages, thread pools
            rates: dict[str, list[float]] = {m: [] for m in args.modes}
            for _ in range(args.rounds):
                for m in args.modes:
                    rates[m].append(_round(m, contexts, args.steps, rng))
            med = {m: statistics.median(r) for m, r in rates.items()}
            cells = [f"{med[m]:.1f} ({min(r):.1f}-{max(r):.1f})" for m, r in rates.items()]
            ratio = f"{med['batched'] / med['separate']:.2f}" if len(med) == 2 else "-"
            print(f"| {n} | " + " | ".join(cells) + f" | {ratio} |", flush=True)
            for c in contexts:
                c.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
