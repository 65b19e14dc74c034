"""The reference engine's sampler over a whole vocabulary's logits, per sample, in one process.

    python -m stdengine.bench.sample_speed [--models A,B] [--samples 2000] [--rounds 5]

For each catalogue model it decodes a 32-token prompt with the full head (so that the sampler reads
the whole vocabulary: what it does for a context of a batched step, with the screen off, or after
a screen that did not pay), then times `Context.sample` for: greedy; greedy with a banned token (as
`ignore_eos` bans the end-of-generation tokens); greedy with the penalties over 64 tokens; and the
CLI's default sampler (top-k 40, top-p 0.95, min-p 0.05, temperature 0.8); and the same without
top-k (top-p then sorts the whole vocabulary). Prints the median of --rounds rounds, in
microseconds per sample.
"""

from __future__ import annotations

import argparse
import statistics
import time

from stdengine.bench.compare_llamacpp import MODELS
from stdengine.bench.printers import md_table
from stdengine.bench.record import cpu_info, stdengine_commit, utc_now

from stdengine.adapter import SamplingParams
from stdengine.store import resolve_model

SAMPLERS = {
    "greedy": (SamplingParams(temp=0.0), []),
    "greedy, a banned token": (SamplingParams(temp=0.0), [2]),
    "greedy, penalties": (
        SamplingParams(temp=0.0, repeat_penalty=1.1, repeat_last_n=64, presence_penalty=0.5),
        [],
    ),
    "top-k 40, top-p 0.95, min-p 0.05, temp 0.8": (
        SamplingParams(temp=0.8, top_k=40, top_p=0.95, min_p=0.05),
        [],
    ),
    # no top-k: top-p sorts the whole vocabulary
    "top-p 0.95, min-p 0.05, temp 0.8": (
        SamplingParams(temp=0.8, top_k=0, top_p=0.95, min_p=0.05),
        [],
    ),
}


def main(argv: list[str] | None = None) -> int:
    from stdengine.reference.core import Context
    from stdengine.reference.model import Model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS), help="catalogue aliases or GGUF paths")
    ap.add_argument("--samples", type=int, default=2000, help="samples per round")
    ap.add_argument("--rounds", type=int, default=5, help="rounds, taking turns (default %(default)s)")
    args = ap.parse_args(argv)
    print(
        f"{utc_now()}, stdengine {stdengine_commit()}, CPU {cpu_info()}; us per sample, median of {args.rounds} rounds of {args.samples}"
    )
    rows = []
    for alias in args.models.split(","):
        with Model.load(str(resolve_model(alias))) as model:
            ctx = Context(model, n_ctx=256)
            ctx.decode([t % model.n_vocab for t in range(100, 132)])  # decode() runs the whole head
            for name, (params, ban) in SAMPLERS.items():
                ctx.ban(ban)
                times = []
                for _ in range(args.rounds):
                    t0 = time.perf_counter()
                    for _ in range(args.samples):
                        ctx.sample(params)
                    times.append((time.perf_counter() - t0) / args.samples * 1e6)
                rows.append([alias, str(model.n_vocab), name, f"{statistics.median(times):.1f}"])
            ctx.close()
    print(md_table(["model", "vocabulary", "sampler", "us per sample"], rows, left=(0, 2)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
