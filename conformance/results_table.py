"""The conformance results table of spec/conformance.md, made from report bundles, never by hand.

    python -m stdengine.conformance.results_table --run [DIR]   # run the suite, then print the table
    python -m stdengine.conformance.results_table DIR            # the table of bundles already in DIR

--run runs `infer conformance --report DIR/ENGINE-MODEL` for each pair in RUNS (what CI proves:
the reference engine and llama.cpp on both catalogue models), one after another, their
output on stderr. The table (markdown, on stdout and in DIR/results.md) has one row per bundle
found in DIR and says the commit, machine and date the bundles were made at. Exit status: 1 when a
run (or, without --run, a bundle) had a failing core check or did not complete, else 0.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

RUNS = (
    ("reference", "smollm2-135m-instruct"),
    ("reference", "gemma-3-270m"),
    ("llamacpp", "smollm2-135m-instruct"),
    ("llamacpp", "gemma-3-270m"),
)
DEFAULT_DIR = "artifacts/conformance"


def run_all(directory: Path, level: str, runs: tuple[tuple[str, str], ...] = RUNS) -> list[str]:
    """Run each engine/model pair into directory/ENGINE-MODEL; the pairs that did not pass."""
    bad = []
    for engine, model in runs:
        bundle = directory / f"{engine}-{model}"
        shutil.rmtree(bundle, ignore_errors=True)  # never report a stale bundle
        argv = ["-m", "stdengine.cli.main", "conformance", "-e", engine, "-m", model]
        argv += ["--level", level, "--report", str(bundle)]
        print(f"\n--- infer {' '.join(argv[2:])}", file=sys.stderr, flush=True)
        rc = subprocess.run([sys.executable, *argv], stdout=sys.stderr).returncode
        if rc != 0:
            bad.append(f"{engine} on {model} (exit status {rc})")
    return bad


def load_bundles(directory: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text(encoding="utf-8")) for p in sorted(directory.glob("*/results.json"))]


def _counts(results: list[dict[str, Any]]) -> str:
    by: dict[str, int] = {}
    for r in results:
        by[r["status"]] = by.get(r["status"], 0) + 1
    order = ("pass", "fail", "warn", "skip", "not_supported")
    return ", ".join(f"{by[s]} {s}" for s in order if by.get(s)) or "none ran"


def _kl(results: list[dict[str, Any]]) -> str:
    r = next((r for r in results if r["id"] == "logits.kl:text=all"), None)
    details = (r or {}).get("details") or {}
    if "engine" not in details:
        return "—"
    return f"{details['engine']['kl_mean']:.5f} ({details['llama_cpp']['kl_mean']:.5f})"


def _one(values: list[Any]) -> str:
    distinct = list(dict.fromkeys(str(v) for v in values))
    return " / ".join(distinct) if distinct else "unknown"


def table(bundles: list[dict[str, Any]]) -> str:
    machines = [
        f"{m.get('cpu') or '?'}, {m.get('cores')} cores" for m in (b.get("machine") or {} for b in bundles)
    ]
    lines = [
        f"Report bundles made at commit {_one([b.get('commit', 'unknown') for b in bundles])} "
        f"on {_one(machines)}, {_one([str(b.get('date', ''))[:10] for b in bundles])} "
        f"(suite {_one([b.get('suite_version') for b in bundles])}, "
        f"level {_one([b.get('level') for b in bundles])}); "
        "table by `python -m stdengine.conformance.results_table`.",
        "",
        "| engine | build | model | core | optional, ext | failing checks | logits mean KL (llama.cpp's) |",
        "|---|---|---|---|---|---|---|",
    ]
    for b in bundles:
        results = b.get("results", [])
        core = [r for r in results if r["level"] == "core"]
        other = [r for r in results if r["level"] != "core"]
        failing = ", ".join(f"`{r['id']}`" for r in results if r["status"] == "fail") or "—"
        engine = b.get("engine") or {}
        cells = [
            str(b.get("adapter")),
            str(engine.get("build") or "").replace("|", "/"),
            str(b.get("model")),
            _counts(core),
            _counts(other) if other else "—",
            failing,
            _kl(results),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m stdengine.conformance.results_table",
        description="Print the conformance results table (markdown) from report bundles.",
    )
    ap.add_argument("dir", nargs="?", default=DEFAULT_DIR, help=f"bundle folder (default {DEFAULT_DIR})")
    ap.add_argument("--run", action="store_true", help="run the suite for each engine/model pair first")
    ap.add_argument("--level", choices=["core", "optional", "all"], default="core", help="with --run")
    args = ap.parse_args(argv)
    directory = Path(args.dir)
    bad = run_all(directory, args.level) if args.run else []
    bundles = load_bundles(directory)
    if not bundles:
        print(f"no report bundles (*/results.json) in {directory}", file=sys.stderr)
        return 1
    text = table(bundles)
    (directory / "results.md").write_text(text, encoding="utf-8")
    print(text, end="")
    if not args.run:
        bad = [f"{b.get('adapter')} on {b.get('model')}" for b in bundles if b.get("exit_status") != 0]
    if bad:
        print(
            f"not conforming (a core check failed or the run did not complete): {'; '.join(bad)}",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
