"""Generation with and without the screened output head, beside llama.cpp, in one run (issue 22).

    python -m stdengine.bench.screen_head [--models A,B] [--tokens 128] [--rounds 3]

For each catalogue model and each sampler (greedy; top-k 40 with top-p 0.95 and min-p 0.05 at
temperature 0.8, the CLI's defaults, which the screen serves by min-p's route; the same without
min-p), it generates --tokens tokens after a short prompt with: the
reference engine as it runs by default (the screen on), the reference engine with
`-E screen_head=off`, and llama.cpp (the llamacpp engine), taking turns for --rounds rounds. The
loop is the one `infer run` uses (evaluate one token, sample the next through the engine's own
sampler) without the end-of-generation stop, so every run makes the same number of tokens; a
token is counted from its evaluation to its sample. It checks that the screened tokens are the
unscreened ones, and reports tokens/s (median, min-max), the rows each screened sample narrowed
with the fifth bits (stage 2) and computed exactly (shares of the vocabulary), the planes' memory
(share of the head) and the time the first screened sample took to build them, and the memory
the screen adds: the peak resident memory of a process that loads the model and generates
--tokens tokens with the screen on, less that of one with it off (each in a process of its own).

A fourth row, "reference, no head", replays the screened run's tokens with the head and the sampler
left out (with the lazy head, a decode whose logits nobody reads never runs the head): the speed no
screen can exceed, so its "vs screen off" is the ceiling of any screen on this machine.
"""

from __future__ import annotations

import argparse
import io
import statistics
import subprocess
import sys
import time
from typing import Any

from stdengine.bench.compare_llamacpp import MODELS, machine
from stdengine.bench.printers import md_table
from stdengine.bench.runner import GREEDY

from stdengine.adapter import SamplingParams
from stdengine.events import Emitter
from stdengine.options import Options
from stdengine.registry import engine_class
from stdengine.store import resolve_model

PROMPT = "The history of the printing press"
SAMPLERS = {
    "greedy": GREEDY,
    "top-k 40": SamplingParams(temp=0.8, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.0, seed=1),
    # the same without min-p: the screen's top-k rule alone (no min-p route), for comparison
    "top-k 40, no min-p": SamplingParams(
        temp=0.8, top_k=40, top_p=0.95, min_p=0.0, repeat_penalty=1.0, seed=1
    ),
}
CONFIGS = {  # label -> (engine, -E settings)
    "reference": ("reference", {}),
    "reference, screen off": ("reference", {"screen_head": "off"}),
    "llama.cpp": ("llamacpp", {}),
}
NO_HEAD = "reference, no head"


def load(engine: str, model: str, args: dict[str, str], threads: int) -> Any:
    opts = Options(model=model, engine=engine, threads=threads, ctx_size=1024, engine_args=args)
    return engine_class(engine).load(opts, Emitter(stream=io.StringIO()))


def generate(engine: Any, sampler: SamplingParams, n: int) -> tuple[list[int], float]:
    """n tokens after the prompt, as infer run makes them (no stop); tokens and tokens/s"""
    engine.reset()
    engine._evaluate(engine.tokenize(PROMPT))
    samples = engine._sample_tokens(sampler)
    out = [next(samples)]
    t0 = time.perf_counter()
    for _ in range(n):
        engine._evaluate([out[-1]])
        out.append(next(samples))
    samples.close()
    return out, n / (time.perf_counter() - t0)


def replay_without_head(engine: Any, tokens: list[int]) -> float:
    """generate's steps for these tokens (its output), without the head and the sampler; tokens/s"""
    engine.reset()
    engine._evaluate(engine.tokenize(PROMPT))
    t0 = time.perf_counter()
    for t in tokens[:-1]:
        engine._evaluate([t])  # the lazy head: nothing reads these logits, so the head never runs
    return (len(tokens) - 1) / (time.perf_counter() - t0)


def first_sample_ms(model: str, threads: int) -> tuple[float, float]:
    """The first screened sample of a fresh model (it builds the plane), and the next one"""
    e = load("reference", model, {}, threads)
    try:
        e._evaluate(e.tokenize(PROMPT))
        greedy = SAMPLERS["greedy"]
        t0 = time.perf_counter()
        tok = e.ctx.sample(greedy)
        t1 = time.perf_counter()
        e._evaluate([tok])
        t2 = time.perf_counter()
        e.ctx.sample(greedy)
        t3 = time.perf_counter()
        return 1e3 * (t1 - t0), 1e3 * (t3 - t2)
    finally:
        e.close()


def peak_rss(path: str, sampler: str, n: int, threads: int, screen: str) -> int:
    """Peak resident bytes of a process that loads the model and generates n tokens (--child). The
    child reads its own high-water mark: the parent's pages a fork copies would count in the
    child's rusage."""
    cmd = [sys.executable, "-m", "stdengine.bench.screen_head", "--child", path, sampler, str(n), screen]
    out = subprocess.run([*cmd, "--threads", str(threads)], capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({out.returncode}): {out.stderr.strip()[-500:]}")
    return int(out.stdout.split()[-1])


def vm_hwm() -> int:
    """This process's peak resident bytes (VmHWM, Linux)"""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def study(model: str, n: int, rounds: int, threads: int) -> list[list[str]]:
    from stdengine.reference.core import api

    path = str(resolve_model(model))
    build_ms, next_ms = first_sample_ms(path, threads)
    engines = {label: load(eng, path, args, threads) for label, (eng, args) in CONFIGS.items()}
    rows = []
    try:
        ref = engines["reference"]
        head = ref.model.tensors.get("output.weight") or ref.model.tensors["token_embd.weight"]
        for name, sampler in SAMPLERS.items():
            speeds: dict[str, list[float]] = {label: [] for label in [*engines, NO_HEAD]}
            tokens: dict[str, list[int]] = {}
            before = ref.ctx.screen_stats
            for _ in range(rounds):
                for label, e in engines.items():
                    toks, speed = generate(e, sampler, n)
                    speeds[label].append(speed)
                    tokens.setdefault(label, toks)
                speeds[NO_HEAD].append(replay_without_head(ref, tokens["reference"]))
            if tokens["reference"] != tokens["reference, screen off"]:
                raise SystemExit(f"{model} {name}: the screened tokens differ from the full head's")
            after = ref.ctx.screen_stats
            screened = after[0] - before[0]
            per_step = (after[1] - before[1]) / screened if screened else 0.0
            narrowed = (after[3] - before[3]) / screened if screened else 0.0
            plane = api().se_model_screen_bytes(ref.model.handle)
            extra = peak_rss(path, name, n, threads, "on") - peak_rss(path, name, n, threads, "off")
            base = statistics.median(speeds["reference, screen off"])
            for label, s in speeds.items():
                med = statistics.median(s)
                is_ref = label == "reference"
                rows.append(
                    [
                        model,
                        name,
                        label,
                        f"{med:.1f} ({min(s):.1f}-{max(s):.1f})",
                        f"{med / base:.2f}x",
                        f"{screened / (rounds * (n + 1)):.0%}" if is_ref else "",
                        f"{narrowed / ref.n_vocab:.2%}" if is_ref else "",
                        f"{per_step / ref.n_vocab:.2%}" if is_ref else "",
                        f"{plane / 2**20:.0f} MiB ({plane / head.n_bytes:.0%})" if is_ref else "",
                        f"{extra / 2**20:+.0f} MiB ({extra / head.n_bytes:+.0%})" if is_ref else "",
                        f"{build_ms:.0f} ms (then {next_ms:.0f})" if is_ref and name == "greedy" else "",
                    ]
                )
    finally:
        for e in engines.values():
            e.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--models", default=",".join(MODELS), help="comma-separated catalogue aliases or GGUF paths"
    )
    ap.add_argument("--tokens", type=int, default=128, help="tokens generated per run (default 128)")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each engine, taking turns (default 3)")
    ap.add_argument("--threads", type=int, default=2, help="compute threads (default %(default)s)")
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)  # PATH SAMPLER N on|off: peak_rss's process
    args = ap.parse_args(argv)
    if args.child:
        path, sampler, n, screen = args.child
        generate(load("reference", path, {"screen_head": screen}, args.threads), SAMPLERS[sampler], int(n))
        print(vm_hwm())
        return 0
    if args.tokens < 1 or args.rounds < 1:
        ap.error("--tokens and --rounds must be at least 1")
    m = machine()
    print(
        f"machine: {m['cpu']}, {m['logical_cpus']} CPUs; {m['date']}; stdengine {m['stdengine_commit']}; "
        f"load average {m['load_average_at_start']}\n"
    )
    table = []
    for model in args.models.split(","):
        table += study(model, args.tokens, args.rounds, args.threads)
        sys.stdout.flush()
    header = [
        "model",
        "sampler",
        "engine",
        "tok/s median (min-max)",
        "vs screen off",
        "samples screened",
        "rows narrowed (stage 2)",
        "rows computed exactly",
        "planes",
        "extra memory (peak RSS, of the head)",
        "first sample (builds the planes)",
    ]
    print(md_table(header, table, left=(0, 1, 2)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
