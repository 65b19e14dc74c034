"""The per-token cost of a structured-output constraint, measured.

    python -m stdengine.bench.structured_overhead [--engine reference] [--models A,B] [--tokens 128] [--runs 5]

For each catalogue model, in one process: the same greedy tg of --tokens tokens with no
constraint and with a constraint that lets every step run its full mask (a Lark grammar that
accepts any text, so both runs produce the same tokens and do the same forward passes), runs
interleaved. Prints the median generation ms/token of each, the overhead ratio (the median of
per-run pair ratios), and the median time a step spends in the mask (Matcher.apply + consume:
computing the mask, writing -inf, advancing the matcher), a figure that stays put on a busy
machine, where the whole-token ratios are noisy. A json_object run is printed too (its tokens
differ, so its ms/token is the fair number). spec/structured.md, "Cost".
"""

from __future__ import annotations

import argparse
import io
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from stdengine.bench.compare_llamacpp import MODELS, machine

from stdengine import structured
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


@contextmanager
def mask_steps(steps: list[float]) -> Iterator[None]:
    """The seconds of each step's Matcher.apply + consume, appended to steps."""
    cls = structured.Matcher
    apply, consume = cls.apply, cls.consume

    def timed_apply(self: Any, logits: Any) -> None:
        t = time.perf_counter()
        apply(self, logits)
        steps.append(time.perf_counter() - t)

    def timed_consume(self: Any, token: int) -> None:
        t = time.perf_counter()
        consume(self, token)
        steps[-1] += time.perf_counter() - t

    cls.apply, cls.consume = timed_apply, timed_consume  # type: ignore[method-assign]
    try:
        yield
    finally:
        cls.apply, cls.consume = apply, consume  # type: ignore[method-assign]


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
            free: list[float] = []
            masked: list[float] = []
            obj: list[float] = []
            steps: list[float] = []  # seconds in the mask, each step of the any-text runs
            for _ in range(args.runs):
                free.append(ms_per_token(engine, None, args.tokens)[0])
                with mask_steps(steps):
                    masked.append(ms_per_token(engine, ANY_TEXT, args.tokens)[0])
                obj.append(ms_per_token(engine, Constraint.json_object(), args.tokens)[0])
            ratio = statistics.median(m / f for m, f in zip(masked, free, strict=True))
            print(
                f"{model}: none {statistics.median(free):.2f} ms/token | any-text grammar "
                f"{statistics.median(masked):.2f} ms/token (overhead {100 * (ratio - 1):+.1f}%; "
                f"mask {1e3 * statistics.median(steps):.3f} ms/step) | "
                f"json_object {statistics.median(obj):.2f} ms/token",
                flush=True,
            )
        finally:
            engine.close()


if __name__ == "__main__":
    main()
