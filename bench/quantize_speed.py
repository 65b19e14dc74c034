"""Speed of `infer quantize` beside llama.cpp's quantizer on the same F32 input, A B A B.

    python -m stdengine.bench.quantize_speed [--models smollm2-135m-instruct gemma-3-270m]
        [--types Q4_K_M Q2_K Q4_0] [--rounds 3] [--threads 2] [--no-llama] [--label TEXT]

Each round quantizes every (model, type) with our quantizer (reference_engine.quantize_model, in
process) and then with llama.cpp's (llama_cpp.llama_model_quantize), so that both see the same
machine load; it reports per file the median wall seconds and CPU seconds (process time, all
threads) over the rounds, and their ratios. The sources are bench/quantize_quality.py's F32 files
(the catalogue models dequantized to F32; made if missing). --no-llama times ours only (for a
before/after comparison of two builds, run once per build with --label).

Writes bench/results/quantize-speed-<stamp>.jsonl (one line per file) and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from stdengine.bench.quantize_quality import MODELS, TYPES, llama_quantize


def timed(fn: Callable[..., object], *a: object, **kw: object) -> tuple[float, float]:
    """fn(*a, **kw)'s wall and CPU seconds (process time: every thread of this process)."""
    w0, c0 = time.perf_counter(), time.process_time()
    fn(*a, **kw)
    return time.perf_counter() - w0, time.process_time() - c0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), help="catalogue aliases or GGUF paths")
    ap.add_argument(
        "--types", nargs="+", default=["Q4_K_M", "Q2_K", "Q4_0"], help="file types to quantize to"
    )
    ap.add_argument(
        "--rounds", type=int, default=3, help="runs of each quantizer, taking turns (default %(default)s)"
    )
    ap.add_argument("--threads", type=int, default=2, help="compute threads (default %(default)s)")
    ap.add_argument(
        "--work",
        type=Path,
        default=Path("/tmp/stdengine-quantize-quality"),
        help="where the files go (default %(default)s)",
    )
    ap.add_argument("--no-llama", action="store_true", help="time our quantizer only")
    ap.add_argument("--label", default="", help="a note stored with each row (e.g. the build)")
    args = ap.parse_args()
    from stdengine.reference.quantize import quantize_model

    from stdengine.store import resolve_model

    args.work.mkdir(parents=True, exist_ok=True)
    times: dict[tuple[str, str, str], list[tuple[float, float]]] = {}
    for model in args.models:
        src = args.work / f"{model}-f32.gguf"
        if not src.exists():
            quantize_model(resolve_model(model, pull=False), src, "F32")
    for _ in range(args.rounds):
        for model in args.models:
            src = args.work / f"{model}-f32.gguf"
            for ft in args.types:
                ours, theirs = (
                    args.work / f"speed-{model}-{ft}-ours.gguf",
                    args.work / f"speed-{model}-{ft}-llama.gguf",
                )
                times.setdefault((model, ft, "ours"), []).append(
                    timed(quantize_model, src, ours, ft, threads=args.threads)
                )
                ours.unlink()
                if not args.no_llama:
                    times.setdefault((model, ft, "llama.cpp"), []).append(
                        timed(llama_quantize, src, theirs, TYPES[ft], args.threads)
                    )
                    theirs.unlink()
    stamp = time.strftime("%Y%m%d-%H%M")
    out = Path(__file__).parent / "results" / f"quantize-speed-{stamp}.jsonl"
    lines = [
        "| model | type | ours wall s | ours CPU s | llama.cpp wall s | llama.cpp CPU s | CPU ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for model in args.models:
        for ft in args.types:
            row = {
                "model": model,
                "type": ft,
                "threads": args.threads,
                "rounds": args.rounds,
                "label": args.label,
            }
            for who in ("ours", "llama.cpp"):
                t = times.get((model, ft, who))
                if t:
                    row[who] = {
                        "wall_s": statistics.median(w for w, _ in t),
                        "cpu_s": statistics.median(c for _, c in t),
                        "runs": [[round(w, 2), round(c, 2)] for w, c in t],
                    }
            with out.open("a") as f:
                f.write(json.dumps(row) + "\n")
            o, t2 = row["ours"], row.get("llama.cpp")
            lines.append(
                f"| {model} | {ft} | {o['wall_s']:.2f} | {o['cpu_s']:.2f} | "
                + (
                    f"{t2['wall_s']:.2f} | {t2['cpu_s']:.2f} | {o['cpu_s'] / t2['cpu_s']:.2f} |"
                    if t2
                    else "— | — | — |"
                )
            )
    print("\n".join(lines))
    print(f"(medians of {args.rounds} rounds; {out})")


if __name__ == "__main__":
    main()
