"""The per-token cost of a structured-output constraint, measured.

    python -m stdengine.bench.structured_overhead [--engine reference] [--models A,B] [--tokens 128] [--runs 5]

For each catalogue model, in one process: the same greedy tg of --tokens tokens with no
constraint and with a constraint that lets every step run its full mask (a Lark grammar that
accepts any text, so both runs produce the same tokens and do the same forward passes), runs
interleaved. Prints the median generation ms/token of each and the overhead ratio; the median of
per-run pair ratios is the headline (spec/structured.md). A json_object run is printed too (its
tokens differ, so its ms/token is the fair number).
"""

from __future__ import annotations

import argparse
import io
import statistics
from typing import Any

from stdengine.bench.compare_llamacpp import MODELS, machine

from stdengine.adapter import DoneEvent, GenerateRequest, SamplingParams
from stdengine.events import Emitter
from stdengine.options import Options
from stdengine.registry import engine_class
from stdengine.store import resolve_model
from stdengine.structured import Constraint

PROMPT = "The history of the city of Rome begins"
ANY_TEXT = Constraint.grammar("start: /(.|\\n)*/", "lark")


def ms_per_token(engine: Any, constraint: Constraint | None, n: int) -> tuple[float, int]:
    sampling = SamplingParams(temp=0, n_predict=n, stop=[])
    done = [
        e for e in engine.generate(GenerateRequest(prompt=PROMPT, sampling=sampling, constraint=constraint))
    ][-1]
    assert isinstance(done, DoneEvent)
    t = done.timings
    return t.predicted_ms / max(1, t.predicted_n), t.predicted_n


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", default="reference")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    print(f"# {machine()}; engine {args.engine}; tg{args.tokens}; {args.runs} interleaved runs")
    cls = engine_class(args.engine)
    for model in args.models.split(","):
        engine = cls.load(
            Options(model=str(resolve_model(model)), ctx_size=512, threads=args.threads),
            Emitter(log_format="json", stream=io.StringIO()),
        )
        try:
            ms_per_token(engine, ANY_TEXT, 4)  # warm up, and build the vocabulary's tokenizer once
            free, masked, obj = [], [], []
            for _ in range(args.runs):
                free.append(ms_per_token(engine, None, args.tokens)[0])
                masked.append(ms_per_token(engine, ANY_TEXT, args.tokens)[0])
                obj.append(ms_per_token(engine, Constraint.json_object(), args.tokens)[0])
            ratio = statistics.median(m / f for m, f in zip(masked, free, strict=True))
            print(
                f"{model}: none {statistics.median(free):.2f} ms/token | any-text grammar "
                f"{statistics.median(masked):.2f} ms/token (overhead {100 * (ratio - 1):+.1f}%) | "
                f"json_object {statistics.median(obj):.2f} ms/token"
            )
        finally:
            engine.close()


if __name__ == "__main__":
    main()
