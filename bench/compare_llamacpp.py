"""The project's own comparison: the reference engine and llama.cpp side by side, same machine, same run.

    infer bench vs-llamacpp [--reps N] [--out DIR] [--models A,B] [--threads 1,2] [--depths 0,512] [--name NAME]
                            [--llamacpp-path DIR]
    (also: python -m stdengine.bench.compare_llamacpp ...)

Runs llama-bench's pp512 and tg128 through infer-bench for both engines on both catalogue models
(by default at 1 and 2 threads, at depth 0 and 512; the engines take turns per model and thread
count, so that both meet the machine in the same state), and writes into the --out folder
(default ./bench-results, in the current directory; the project's measurements are in its
bench/results/, written with --out bench/results):

    NAME.jsonl   the records (infer bench -o jsonl; `infer bench compare` reads it)
    NAME.md      the machine (CPU model, cores, date), the table, the reference/llama.cpp ratios
                 and each engine's peak memory
    NAME.png     the plot (when matplotlib is installed)

NAME.md also describes the machine's limits (the probe of stdengine.bench.record.machine_probe:
read bandwidth from DRAM and the caches, int8 multiply-accumulate throughput, at each thread
count) and has a roofline table (stdengine.bench.roofline): beside each pp and tg figure, the
limit this machine allows that test, the fraction reached and the GB/s or GMAC/s achieved.

--llamacpp-path DIR runs llama.cpp from another llama-cpp-python build: DIR is a folder that holds
a `llama_cpp` package (`pip install --target DIR ...`), put first on the module path of this
process and of the peak-memory processes. The report names the build that ran ("llama.cpp
build: ...": its folder and its system info).

Peak memory is the peak resident set (VmHWM of /proc/self/status, Linux) of a separate
`infer-bench` process per engine and model that runs pp512 and tg128 once at the largest thread
count: the same Python harness around each engine, so the difference between the two is the
engines'.

It prints the table and the ratios. NAME defaults to compare-llamacpp-<UTC date>.
"""

from __future__ import annotations

import argparse
import importlib
import io
import os
import platform
import subprocess
import sys
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from stdengine.bench import roofline
from stdengine.bench.compare import CompareError, pair_rows, plot, render
from stdengine.bench.params import BenchParams, physical_cores, with_defaults
from stdengine.bench.printers import make_printer
from stdengine.bench.record import MachineProbe, cpu_info, machine_probe, stdengine_commit
from stdengine.bench.runner import bench_emitter, run

MODELS = ("smollm2-135m-instruct", "gemma-3-270m")
RESULTS = Path("bench-results")  # relative to the current directory, never the installed package


def machine(threads: tuple[int, ...] = (1, 2)) -> dict[str, Any]:
    return {
        "probe": machine_probe(threads),
        "cpu": cpu_info(),
        "physical_cores": physical_cores(),
        "logical_cpus": os.cpu_count(),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "stdengine_commit": stdengine_commit(),
        "load_average_at_start": _loadavg(),
    }


def _loadavg() -> str:
    """The 1, 5 and 15 minute load averages: other work on the machine skews the figures."""
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


# Run in the child: infer-bench, then its peak resident set on stderr. VmHWM belongs to the
# address space that exec made, so unlike ru_maxrss it does not count the pages the child
# shared with this (large) process between fork and exec.
_PEAK_PROBE = """
import atexit, runpy, sys
if sys.path and sys.path[0] in ("", "."):
    del sys.path[0]  # a source checkout in the current directory must not shadow the installed stdengine
def report():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            sys.stderr.write("peak-rss-kib " + line.split()[1] + "\\n")
atexit.register(report)
sys.argv[0] = "infer-bench"
runpy.run_module("stdengine.cli.bench", run_name="__main__")
"""


def peak_rss_mb(model: str, engine: str, threads: int, llamacpp_path: str | None = None) -> float:
    """Peak resident set, in MiB, of one infer-bench process running pp512 and tg128 once (Linux);
    llamacpp_path: a folder put first on its module path (--llamacpp-path)."""
    args = ["-m", model, "-e", engine, "-p", "512", "-n", "128", "-r", "1", "-t", str(threads), "-o", "jsonl"]
    cmd = [sys.executable, "-c", _PEAK_PROBE, *args]
    env = None
    if llamacpp_path:
        env = dict(
            os.environ,
            PYTHONPATH=os.pathsep.join(filter(None, [llamacpp_path, os.environ.get("PYTHONPATH")])),
        )
    proc = subprocess.run(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, errors="replace", env=env
    )
    peaks = [line.split()[1] for line in proc.stderr.splitlines() if line.startswith("peak-rss-kib ")]
    if proc.returncode or not peaks:
        raise RuntimeError(f"infer-bench {' '.join(args)} exited {proc.returncode}: {proc.stderr.strip()}")
    return int(peaks[-1]) / 1024


def use_llamacpp_path(path: str) -> str:
    """Put a folder holding another llama-cpp-python build first on the module path and import
    llama_cpp from it; the folder, resolved. ValueError if it holds no llama_cpp package or
    llama_cpp was already imported from elsewhere."""
    folder = Path(path).resolve()
    if not (folder / "llama_cpp" / "__init__.py").is_file():
        raise ValueError(
            f"--llamacpp-path {path}: no llama_cpp package in this folder (pip install --target {path} ...)"
        )
    loaded = sys.modules.get("llama_cpp")
    if loaded is None:
        sys.path.insert(0, str(folder))
        importlib.invalidate_caches()
        loaded = importlib.import_module("llama_cpp")
    where = Path(loaded.__file__ or "").resolve()
    if folder not in where.parents:
        raise ValueError(f"--llamacpp-path {path}: llama_cpp was already imported from {where.parent}")
    return str(folder)


def llamacpp_build() -> str:
    """The llama-cpp-python build this process runs: its version, folder and llama.cpp's system
    info (the instruction sets it was built with); "not loaded" before the llamacpp engine ran."""
    lib = sys.modules.get("llama_cpp")
    if lib is None:
        return "not loaded"
    folder = Path(lib.__file__ or "").resolve().parent.parent
    info = lib.llama_print_system_info().decode("utf-8", errors="replace").strip().rstrip("|").strip()
    return f"llama-cpp-python {lib.__version__} from {folder} (system info: {info})"


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x != ""]


def main(argv: list[str] | None = None, prog: str = "python -m stdengine.bench.compare_llamacpp") -> int:
    ap = argparse.ArgumentParser(
        prog=prog,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--reps", type=int, default=5, help="repetitions per test (default 5, llama-bench's)")
    ap.add_argument("--models", default=",".join(MODELS), help="catalogue aliases or paths, comma-separated")
    ap.add_argument("--threads", default="1,2", help="thread counts (default 1,2)")
    ap.add_argument("--depths", default="0,512", help="depths (default 0,512)")
    ap.add_argument("-p", "--n-prompt", default="512", help="prompt sizes (default 512)")
    ap.add_argument("-n", "--n-gen", default="128", help="generation lengths (default 128)")
    ap.add_argument("--out", default=str(RESULTS), help="output folder (default ./bench-results)")
    ap.add_argument("--name", default=None, help="file name stem (default compare-llamacpp-<date>)")
    ap.add_argument("--progress", action="store_true", help="infer-bench's progress lines on stderr")
    ap.add_argument(
        "--llamacpp-path",
        metavar="DIR",
        default=None,
        help="run llama.cpp from the llama-cpp-python build in DIR (pip install --target DIR ...) "
        "instead of the installed one",
    )
    args = ap.parse_args(argv)
    llamacpp_path = None
    if args.llamacpp_path:
        try:
            llamacpp_path = use_llamacpp_path(args.llamacpp_path)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2

    params = with_defaults(
        BenchParams(
            models=args.models.split(","),
            engines=["llamacpp", "reference"],
            n_prompt=_ints(args.n_prompt),
            n_gen=_ints(args.n_gen),
            n_depth=_ints(args.depths),
            n_threads=_ints(args.threads),
            reps=args.reps,
            given={"threads"},
        )
    )
    desc = machine(tuple(params.n_threads))
    probe: MachineProbe = desc["probe"]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.name or f"compare-llamacpp-{datetime.now(timezone.utc).strftime('%Y%m%d-%H%M')}"
    jsonl_path, md_path, png_path = (out_dir / f"{stem}{ext}" for ext in (".jsonl", ".md", ".png"))

    records: list[dict[str, Any]] = []
    with open(jsonl_path, "w", encoding="utf-8") as f:
        printer = make_printer("jsonl", f, params)
        md = io.StringIO()
        md_printer = make_printer("md", md, params)

        def on_record(rec: dict[str, Any]) -> None:
            records.append(rec)
            printer.record(rec)
            md_printer.record(rec)
            print(
                f"  {rec['engine']:<10} {rec['model_type']:<28} t={rec['n_threads']} "
                f"{'pp' if rec['n_prompt'] else 'tg'}{rec['n_prompt'] or rec['n_gen']} d={rec['n_depth']}: "
                f"{rec['avg_ts']:.2f} ± {rec['stddev_ts']:.2f} t/s",
                file=sys.stderr,
                flush=True,
            )

        from stdengine.bench.progress import LineProgress

        print(f"machine: {desc['cpu']}, {desc['physical_cores']} cores, {desc['date']}", file=sys.stderr)
        for line in probe.lines():
            print(f"  {line}", file=sys.stderr)
        # The engines take turns per (model, threads), so that both see the machine in the same state.
        status = 0
        for model in params.models:
            for threads in params.n_threads:
                part = replace(params, models=[model], n_threads=[threads])
                progress = LineProgress() if args.progress else None
                status = run(part, on_record, bench_emitter(params), progress=progress) or status
        md_printer.footer()

    # Peak memory, one process per engine and model (after the timed runs, so it cannot skew them).
    threads = max(params.n_threads)
    memory = ["| model | llama.cpp MiB | reference MiB | reference / llama.cpp |", "|---|---:|---:|---:|"]
    for model in params.models:
        try:
            base_mb, ref_mb = (
                peak_rss_mb(model, engine, threads, llamacpp_path) for engine in ("llamacpp", "reference")
            )
        except RuntimeError as e:
            print(f"error: peak memory: {e}", file=sys.stderr)
            status = status or 1
            continue
        memory.append(f"| {model} | {base_mb:.1f} | {ref_mb:.1f} | {ref_mb / base_mb:.2f} |")
        print(
            f"peak memory {model}: llama.cpp {base_mb:.1f} MiB, reference {ref_mb:.1f} MiB", file=sys.stderr
        )

    text = [
        f"# reference vs llama.cpp ({desc['date']})",
        "",
        f"- CPU: {desc['cpu']} ({desc['physical_cores']} physical cores, {desc['logical_cpus']} logical CPUs)",
        f"- OS: {desc['os']}, Python {desc['python']}, stdengine {desc['stdengine_commit']}",
        f"- load average (1, 5, 15 min): {desc['load_average_at_start']} at the start, {_loadavg()} at the end"
        f" (with {desc['physical_cores']} cores, other work on the machine competes with the engines)",
        f"- llama.cpp build: {llamacpp_build()}",
        *(f"- machine probe: {line}" for line in probe.lines()),
        f"- command: {prog} {' '.join(sys.argv[1:] if argv is None else argv)}".rstrip(),
        f"- records: {jsonl_path.name}",
        "",
        "## infer-bench",
        "",
        md.getvalue().rstrip(),
        "",
    ]
    try:
        base = [r for r in records if r["engine"] == "llamacpp"]
        cand = [r for r in records if r["engine"] == "reference"]
        pairs = pair_rows(base, cand)
    except CompareError as e:
        print(f"error: no comparison: {e}", file=sys.stderr)
        md_path.write_text("\n".join(text) + "\n", encoding="utf-8")
        return status or 1
    table = render(pairs)
    text += ["## reference / llama.cpp (speedup = reference t/s / llama.cpp t/s)", "", table.rstrip(), ""]
    limits = roofline.render([(p.base, p.cand) for p in pairs], probe)
    costs = [
        f"- {model_type}: {roofline.describe_cost(roofline.model_cost(path))}"
        for model_type, path in {r["model_type"]: r["model_filename"] for r in records}.items()
    ]
    text += [
        "## roofline (the limit this machine allows each test, from the machine probe; spec/bench-record.md §7.2)",
        "",
        limits.rstrip(),
        "",
        *costs,
        "",
    ]
    text += [f"## peak memory (resident set of a pp512 + tg128 run, {threads} threads)", "", *memory, ""]
    try:
        plot(pairs, str(png_path), title=f"reference vs llama.cpp: {desc['cpu']}, {desc['date']}")
        text += [f"![plot]({png_path.name})", ""]
    except CompareError as e:
        print(f"warning: {e}", file=sys.stderr)
    md_path.write_text("\n".join(text) + "\n", encoding="utf-8")
    print(table, end="")
    print()
    print(limits, end="")
    print("\n".join(costs))
    print(f"llama.cpp build: {llamacpp_build()}")
    print(f"wrote {jsonl_path}, {md_path}" + (f", {png_path}" if png_path.exists() else ""), file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
