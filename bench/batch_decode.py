"""One-token steps of N contexts of one model: batched (one se_decode_batch per step, the weights
read once) against N separate se_decode calls per step, in one process, in alternation.

    python -m stdengine.bench.batch_decode MODEL [-n 1 2 4 8 16] [-t 2] [--steps 16] [--rounds 5] [--cache f16]

Each context first holds its own 32-token prompt; a round times `--steps` steps of every context
in each mode (the contexts truncated back to their prompts before each), A B A B, and the table
gives the median aggregate tokens/s of the rounds, its min-max, the median tokens per CPU-second
of the process, the ratios of each mode to the last one (batched/separate), and how many matmul
rows a thread took from another's share per batched step (se_share_rows: the threads' imbalance
that the static split would have left waiting at a barrier).
`--modes separate` times se_decode alone (it runs on a build without se_decode_batch, for an
old/new comparison of the single-context path). `--gemm-min A B ...` times the batched mode once
per value, alternating, with batches of that many rows or more on the GEMM (kernels.h's
se_set_gemm_min_tokens): the crossover of the tiles and the GEMM, measured in one process. (On
AMX the packed panels take the batches below SE_AMX_PANELS_MAX_TOKENS whatever it says.)
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from stdengine.reference import core
from stdengine.reference.core import Context
from stdengine.reference.model import Model

PROMPT = 32


def _round(mode: str, contexts: list[Context], steps: int, rng: np.random.Generator) -> tuple[float, float]:
    """Aggregate tokens/s of `steps` one-token steps of every context, and tokens per CPU-second
    of the process (all threads): what a token costs, which other load changes less than the
    wall-clock rate. A mode "batched/gN" is the batched mode with the GEMM from N rows on."""
    from stdengine.reference import kernels

    mode, _, gemm = mode.partition("/g")
    kernels.set_gemm_min_tokens(int(gemm) if gemm else None)
    for c in contexts:
        c.truncate(PROMPT)
    toks = rng.integers(100, 30000, (steps, len(contexts))).tolist()
    t0, c0 = time.perf_counter(), time.process_time()
    for row in toks:
        if mode == "batched":
            core.decode_batch(contexts, [[t] for t in row])
        else:
            for c, t in zip(contexts, row, strict=True):
                c.decode([t])
    n = steps * len(contexts)
    return n / (time.perf_counter() - t0), n / max(time.process_time() - c0, 1e-9)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="GGUF file, or a catalogue alias")
    ap.add_argument("-n", type=int, nargs="+", default=[1, 2, 4, 8, 16], help="context counts")
    ap.add_argument("-t", "--threads", type=int, default=2, help="compute threads (default %(default)s)")
    ap.add_argument("--steps", type=int, default=16, help="one-token steps per round")
    ap.add_argument(
        "--rounds", type=int, default=5, help="rounds of every mode, taking turns (default %(default)s)"
    )
    ap.add_argument(
        "--cache", choices=["f32", "f16"], default="f32", help="KV cache type (infer serve's default: f16)"
    )
    ap.add_argument(
        "--modes",
        nargs="+",
        default=["batched", "separate"],
        choices=["batched", "separate"],
        help="batched: one se_decode_batch a step; separate: one se_decode per context (default: both)",
    )
    ap.add_argument("--gemm-min", type=int, nargs="+", help="batched once per value: the GEMM from N rows on")
    args = ap.parse_args(argv)
    if args.gemm_min:
        args.modes = [f"batched/g{g}" for g in args.gemm_min] + [m for m in args.modes if m != "batched"]
    path = args.model
    if not path.endswith(".gguf"):
        from stdengine.store import resolve_model

        path = str(resolve_model(path))
    rng = np.random.default_rng(0)
    print(
        f"model {path}, {args.threads} threads, {args.cache} cache, {args.steps} steps x {args.rounds} rounds, tokens/s aggregate"
        " and tokens per CPU-second (medians)"
    )
    last = args.modes[-1]
    print(
        "| N | "
        + " | ".join(f"{m} t/s (min-max), tok/CPU-s" for m in args.modes)
        + f" | ratios to {last}: t/s, tok/CPU-s | rows taken per batched step |"
    )
    print("|---|" + "---|" * (len(args.modes) + 2))
    with Model.load(path) as model:
        for n in args.n:
            contexts = [
                Context(
                    model,
                    n_ctx=PROMPT + args.steps,
                    n_threads=args.threads,
                    cache_type_k=args.cache,
                    cache_type_v=args.cache,
                )
                for _ in range(n)
            ]
            for c in contexts:
                c.decode(rng.integers(100, 30000, PROMPT).tolist())
            _round(args.modes[0], contexts, 2, rng)  # warm-up: pages, thread pools
            taken0, batched_steps = core.rows_taken_from_others(), 0
            rates: dict[str, list[float]] = {m: [] for m in args.modes}
            per_cpu: dict[str, list[float]] = {m: [] for m in args.modes}
            for _ in range(args.rounds):
                for m in args.modes:
                    wall, cpu = _round(m, contexts, args.steps, rng)
                    rates[m].append(wall)
                    per_cpu[m].append(cpu)
                    batched_steps += args.steps if m.startswith("batched") else 0
            med = {m: statistics.median(r) for m, r in rates.items()}
            med_cpu = {m: statistics.median(r) for m, r in per_cpu.items()}
            cells = [f"{med[m]:.1f} ({min(r):.1f}-{max(r):.1f}), {med_cpu[m]:.0f}" for m, r in rates.items()]
            ratio = (
                " / ".join(
                    f"{med[m] / med[last]:.2f}, {med_cpu[m] / med_cpu[last]:.2f}" for m in args.modes[:-1]
                )
                or "-"
            )
            taken = (core.rows_taken_from_others() - taken0) / batched_steps if batched_steps else 0
            print(f"| {n} | " + " | ".join(cells) + f" | {ratio} | {taken:.0f} |", flush=True)
            for c in contexts:
                c.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
