"""The serving load sweep (issue 21): the HTTP load test (bench/load.py) at several concurrencies
against servers this command starts itself, one after the other, written to
bench/results/load-<stamp>.md (and .jsonl, one load-test result a line).

    python -m stdengine.bench.load_sweep -m smollm2-135m-instruct -m gemma-3-270m \\
        --server after=infer --server before=infer:/path/to/old/checkout \\
        --server llama-cpp-python=llama-cpp-python --concurrency 1,2,4,8,16 -n 128

A server is LABEL=KIND[:PYTHONPATH]: KIND `infer` (`infer serve -np <largest concurrency>`, the
reference engine), `infer-unbatched` (the same with --no-batching: one context per slot, each in
its own thread) or `llama-cpp-python` (`python -m llama_cpp.server`); PYTHONPATH, when given,
is put first on the server's import path and is its working directory (an older checkout of
stdengine: "before"; its stdengine package, while stdengine.reference, the C engine, is the
installed one's: an editable install maps it to its own checkout). KIND `llama-server` is
llama.cpp's own server (`-np <largest concurrency>`, continuous batching, the context of every
slot together: -c slots x per-slot context), LABEL=llama-server:BINARY (default: llama-server on
PATH; README, "Serving many users at once", says how to build it from the llama-cpp-python
source). Every request is a streamed completion of a fresh prompt of -p tokens, greedy, exactly
-n tokens (min_tokens and ignore_eos); --requests-per R sends R x concurrency requests (at least
4) per run. --rounds N runs the whole sweep N times, the servers started afresh each round, and
adds each round's throughput at every concurrency over that at the lowest (issue 21's targets are
such ratios: a VM's speed drifts within minutes, and a ratio within one round drifts less).
The results name the code each server ran (server_code): an `infer` server's stdengine commit,
found through its own import path.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from stdengine.bench.load import client_ms_per_token, run_load_test
from stdengine.bench.params import parse_args, parse_int_range
from stdengine.bench.record import cpu_info, git_commit, stdengine_commit, utc_now

RESULTS = Path(__file__).resolve().parent / "results"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_command(
    kind: str, model: Path, port: int, n_seq: int, n_ctx: int, threads: int, binary: str = ""
) -> list[str]:
    if kind == "llama-server":  # its -c is shared by the slots: each gets c / np
        program = shutil.which(binary or "llama-server")
        if program is None:
            raise SystemExit(
                f"no such program: {binary or 'llama-server'} (give its path as LABEL=llama-server:BINARY; "
                'README, "Serving many users at once", says how to build it)'
            )
        return [
            *(program, "-m", str(model), "--host", "127.0.0.1", "--port", str(port)),
            *("-np", str(n_seq), "-c", str(n_ctx * n_seq), "-t", str(threads), "-tb", str(threads)),
            "--no-webui",
        ]
    if kind in ("infer", "infer-unbatched"):
        return [
            *(sys.executable, "-m", "stdengine.cli.main", "serve", "-e", "reference", "-m", str(model)),
            *("--port", str(port), "-np", str(n_seq), "-c", str(n_ctx), "-t", str(threads)),
            *("--queue", str(4 * n_seq)),
            *(("--no-batching",) if kind == "infer-unbatched" else ()),
        ]
    if kind == "llama-cpp-python":
        return [
            *(sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--host", "127.0.0.1"),
            *("--port", str(port), "--n_ctx", str(n_ctx), "--n_threads", str(threads)),
            *("--n_threads_batch", str(threads), "--interrupt_requests", "False"),
        ]
    raise SystemExit(
        f"unknown server kind {kind!r} (infer, infer-unbatched, llama-cpp-python or llama-server)"
    )


def server_code(kind: str, cmd: list[str], env: dict[str, str], cwd: str | None) -> str:
    """What a server runs, as its results record it: for `infer`, the commit of the stdengine
    checkout that the server's import path gives (a PYTHONPATH may hold another checkout than
    this sweep's), marked when it has uncommitted changes; llama-cpp-python's version; or
    llama-server's program."""
    if kind == "llama-server":
        return cmd[0]
    probe = {
        "llama-cpp-python": "import llama_cpp; print(llama_cpp.__version__)",
        "infer": "import pathlib, stdengine; print(pathlib.Path(stdengine.__file__).resolve().parent.parent)",
    }[kind.removesuffix("-unbatched")]
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=cwd)
    found = out.stdout.strip() if out.returncode == 0 else "unknown"
    if kind == "llama-cpp-python" or found == "unknown":
        return f"{kind} {found}"
    root = Path(found)
    changed = subprocess.run(
        ["git", "-C", found, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
    ).stdout.strip()
    return f"stdengine {git_commit(root)}{' with uncommitted changes' if changed else ''} ({root})"


class Served:
    """A server subprocess on a free port, up until closed."""

    def __init__(self, kind: str, cmd: list[str], pythonpath: str | None, log: Path) -> None:
        import httpx

        env = dict(os.environ)
        if pythonpath:
            env["PYTHONPATH"] = os.pathsep.join([pythonpath, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        self.log = open(log, "w")  # noqa: SIM115 - closed in close()
        # `python -m` puts its working directory first on the import path, before PYTHONPATH: a
        # server run from a checkout would import that checkout's stdengine, not the given one's
        cwd = pythonpath or None
        self.code = server_code(kind, cmd, env, cwd)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        port = cmd[cmd.index("--port") + 1]
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"the server exited: {log.read_text()[-2000:]}")
            try:
                if httpx.get(self.url + "/v1/models", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.close()
        raise SystemExit(f"the server did not start in 180 s: {log.read_text()[-2000:]}")

    def cpu_seconds(self) -> float:
        """CPU time (user + system, all threads) the server has used: the cost of its tokens,
        which a busy machine changes less than their wall-clock rate."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def sweep(args: argparse.Namespace, save: Any) -> list[dict[str, Any]]:
    """Every round x model x server x concurrency; save(results) after each run, so that an
    interrupted sweep keeps what it measured."""
    from stdengine.store import resolve_model

    concurrencies = args.concurrency
    n_ctx = args.n_prompt + args.n_gen + 64
    out: list[dict[str, Any]] = []
    paths = {model: resolve_model(model) for model in args.model}
    runs = [
        (rnd, model, spec)
        for rnd in range(1, args.rounds + 1)
        for model in args.model
        for spec in args.server
    ]
    for rnd, model, spec in runs:
        path = paths[model]
        label, _, rest = spec.partition("=")
        kind, _, where = rest.partition(":")  # PYTHONPATH, or llama-server's binary
        binary, pythonpath = (where, None) if kind == "llama-server" else ("", where or None)
        cmd = server_command(kind, path, _free_port(), max(concurrencies), n_ctx, args.threads, binary)
        served = Served(kind, cmd, pythonpath, Path(tempfile.mkdtemp()) / "server.log")
        try:
            for c in concurrencies:
                argv = [
                    "-e",
                    "openai",
                    "--url",
                    served.url,
                    "-p",
                    str(args.n_prompt),
                    "-n",
                    str(args.n_gen),
                ]
                argv += ["--concurrency", str(c), "--requests", str(max(4, args.requests_per * c))]
                cpu0 = served.cpu_seconds()
                result = run_load_test(parse_args(argv))
                cpu = served.cpu_seconds() - cpu0  # the warm-up request included
                result.update(server=label, kind=kind, model_alias=model, server_cpu_s=cpu, round=rnd)
                result["server_code"] = served.code
                result["tokens_per_cpu_s"] = result["total_output_tokens"] / cpu if cpu > 0 else 0.0
                out.append(result)
                save(out)
                print(one_line(result), file=sys.stderr, flush=True)
        finally:
            served.close()
    return out


def one_line(r: dict[str, Any]) -> str:
    return (
        f"{r['model_alias']} {r['server']} c={r['concurrency']}: {r['output_throughput']:.1f} tok/s, "
        f"TTFT median {r['ttft_ms']['median']:.0f} ms p99 {r['ttft_ms']['p99']:.0f} ms, ITL median "
        f"{r['itl_ms']['median']:.1f} ms p99 {r['itl_ms']['p99']:.1f} ms, {r['tokens_per_cpu_s']:.1f} tok per "
        f"server CPU-s, client {client_ms_per_token(r):.3f} CPU-ms per token, errors {r['errors']}, short {r['short']}"
    )


def render(results: list[dict[str, Any]], command: str, note: str) -> str:
    lines = [
        "# Serving load sweep",
        "",
        f"- date: {utc_now()}; the sweep's stdengine commit {stdengine_commit()}; CPU: {cpu_info()}",
        f"- command: `{command}`",
    ]
    ran = {r["server"]: r.get("server_code", "not recorded") for r in results}
    lines += [f"- server {label} ran: {code}" for label, code in ran.items()]
    if note:
        lines.append(f"- note: {note}")
    lines += [
        "- each run: streamed completions of fresh random prompts, greedy, exactly -n tokens each;"
        " aggregate tok/s = generated tokens / wall time of the run; TTFT and ITL as the client sees"
        " them (spec/bench-record.md §6.2); tok/CPU-s = generated tokens / CPU time (user + system,"
        " all threads) the server process used during the run: what the tokens cost, which other"
        " load on the machine changes less than the wall-clock rate; client ms/tok = the load"
        " client's CPU time per generated token, taken from the same cores",
        "",
        "| round | model | server | concurrency | requests | tok/s (aggregate) | TTFT median (ms) | TTFT p99 (ms) |"
        " ITL median (ms) | ITL p99 (ms) | tok/CPU-s | client ms/tok | errors |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r['round']} | {r['model_alias']} | {r['server']} | {r['concurrency']} | {r['requests']} | "
            f"{r['output_throughput']:.1f} | {r['ttft_ms']['median']:.0f} | {r['ttft_ms']['p99']:.0f} | "
            f"{r['itl_ms']['median']:.1f} | {r['itl_ms']['p99']:.1f} | {r.get('tokens_per_cpu_s', 0):.1f} | "
            f"{client_ms_per_token(r):.3f} | {r['errors']} |"
        )
    ratios = ratio_lines(results)
    if ratios:
        lines += [
            "",
            "Each round's figure at a concurrency over the same round's at the lowest concurrency:",
            "",
        ]
        lines += ratios
    return "\n".join(lines) + "\n"


def ratio_lines(results: list[dict[str, Any]]) -> list[str]:
    """A table of aggregate tok/s and p99 inter-token latency at each concurrency over those at the
    lowest, per model, server and round, with the median over rounds; empty with one round."""
    groups: dict[tuple[str, str], dict[tuple[int, int], dict[str, Any]]] = {}  # (model, server): (round, c)
    for r in results:
        groups.setdefault((r["model_alias"], r["server"]), {})[r["round"], r["concurrency"]] = r
    if len({rnd for runs in groups.values() for rnd, _ in runs}) < 2:
        return []
    lines = [
        "| model | server | concurrency | tok/s ratio, each round | median | p99 ITL ratio, each round | median |",
        "|---|---|---:|---|---:|---|---:|",
    ]
    for (model, server), runs in groups.items():
        low = min(c for _, c in runs)
        rounds = sorted({rnd for rnd, _ in runs})
        for c in sorted({c for _, c in runs} - {low}):
            # rounds with both runs, the low one with tokens (a round cut short has fewer)
            pairs = [
                (runs[rnd, low], runs[rnd, c]) for rnd in rounds if (rnd, low) in runs and (rnd, c) in runs
            ]
            pairs = [(a, b) for a, b in pairs if a["output_throughput"] and a["itl_ms"]["p99"]]
            if not pairs:
                continue
            tps = [b["output_throughput"] / a["output_throughput"] for a, b in pairs]
            itl = [b["itl_ms"]["p99"] / a["itl_ms"]["p99"] for a, b in pairs]
            lines.append(
                f"| {model} | {server} | {c} / {low} | {', '.join(f'{x:.2f}' for x in tps)} | "
                f"{statistics.median(tps):.2f}x | {', '.join(f'{x:.2f}' for x in itl)} | {statistics.median(itl):.2f}x |"
            )
    return lines


def _counts(text: str) -> list[int]:
    """--concurrency's value: positive whole numbers, comma-separated (infer-bench's lists, so
    llama-bench's ranges such as 1-16*2 too)."""
    try:
        counts = parse_int_range(text)
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give positive whole numbers separated by commas, e.g. 1,8"
        )
    return counts


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m stdengine.bench.load_sweep",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("-m", "--model", action="append", required=True, help="catalogue alias or GGUF path")
    ap.add_argument(
        "--server",
        action="append",
        required=True,
        help="LABEL=KIND[:PYTHONPATH], or LABEL=llama-server[:BINARY]",
    )
    ap.add_argument(
        "--concurrency",
        type=_counts,
        default="1,2,4,8,16",
        help="numbers of requests in flight, comma-separated, or a range such as 1-16*2 (default %(default)s)",
    )
    ap.add_argument(
        "-p", "--n-prompt", type=int, default=32, help="prompt tokens a request (default %(default)s)"
    )
    ap.add_argument(
        "-n", "--n-gen", type=int, default=128, help="generated tokens a request (default %(default)s)"
    )
    ap.add_argument("--requests-per", type=int, default=2, help="requests per run = this x concurrency")
    ap.add_argument(
        "-t", "--threads", type=int, default=2, help="each server's compute threads (default %(default)s)"
    )
    ap.add_argument(
        "--rounds", type=int, default=1, help="run the whole sweep this many times (servers started afresh)"
    )
    ap.add_argument("--note", default="", help="a line for the results file (e.g. the machine was busy)")
    ap.add_argument("--out", help="results file stem (default: bench/results/load-<UTC stamp>)")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    stem = Path(args.out) if args.out else RESULTS / time.strftime("load-%Y%m%d-%H%M", time.gmtime())
    command = "python -m stdengine.bench.load_sweep " + " ".join(argv if argv is not None else sys.argv[1:])

    def save(results: list[dict[str, Any]]) -> None:
        stem.with_suffix(".md").write_text(render(results, command, args.note), encoding="utf-8")
        with open(stem.with_suffix(".jsonl"), "w", encoding="utf-8") as f:
            for r in results:
                f.write(json.dumps(r) + "\n")

    sweep(args, save)
    print(stem.with_suffix(".md"))


if __name__ == "__main__":
    main()
