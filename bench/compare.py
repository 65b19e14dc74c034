"""`infer-bench compare BASE CANDIDATE`: two result sets side by side, like llama.cpp's
scripts/compare-llama-bench.py, and optionally a plot.

BASE and CANDIDATE are json or jsonl files written by `-o json|jsonl`, sql text written by
`-o sql`, or sqlite databases made from it (`infer-bench -o sql | sqlite3 results.db`). Rows are
matched by configuration (model, test shape and depth, threads, batch sizes, cache types, ngl,
flash attention, mmap), not by engine or build, so an engine can be compared with another one or
with an older build of itself. `--base-engine` / `--candidate-engine` pick the rows of one engine
(the same file may be given twice). speedup = candidate avg_ts / base avg_ts.
"""

from __future__ import annotations

import json
import sqlite3
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stdengine.bench.printers import md_table, test_name

KEY_FIELDS = (
    "model_type",
    "n_prompt",
    "n_gen",
    "n_depth",
    "n_threads",
    "n_batch",
    "n_ubatch",
    "type_k",
    "type_v",
    "n_gpu_layers",
    "flash_attn",
    "use_mmap",
)

VS_LLAMACPP_HINT = (
    "compare reads two results files; to benchmark the reference engine against llama.cpp on this "
    "machine, run `infer bench vs-llamacpp` (`infer bench vs-llamacpp --help` lists its options)"
)

USAGE = """usage: infer-bench compare BASE CANDIDATE [options]

BASE and CANDIDATE: json/jsonl files (-o json|jsonl), sql text (-o sql) or sqlite databases.

options:
  --base-engine NAME        use only BASE's rows of this engine
  --candidate-engine NAME   use only CANDIDATE's rows of this engine
  -o, --output md|csv|json  the comparison's format (default: md)
  --plot FILE.png           also draw the comparison (needs matplotlib: pip install 'stdengine[plot]')
  -h, --help
"""


class CompareError(Exception):
    pass


def _normalise(row: dict[str, Any]) -> dict[str, Any]:
    out = dict(row)
    for name in ("flash_attn", "use_mmap"):
        if name in out and not isinstance(out[name], bool):
            out[name] = str(out[name]) not in ("0", "false", "False", "")
    for name in ("n_prompt", "n_gen", "n_depth", "n_threads", "n_batch", "n_ubatch", "n_gpu_layers"):
        if name in out and out[name] is not None:
            out[name] = int(out[name])
    for name in ("avg_ts", "stddev_ts"):
        out[name] = float(out.get(name) or 0.0)
    out.setdefault("engine", "llama.cpp")
    out.setdefault("n_depth", 0)
    return out


def _from_sqlite(con: sqlite3.Connection, where: str) -> list[dict[str, Any]]:
    con.row_factory = sqlite3.Row
    tables = [r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")]
    table = "llama_bench" if "llama_bench" in tables else ("test" if "test" in tables else None)
    if table is None:
        raise CompareError(f"{where}: no llama_bench table in this database")
    return [dict(r) for r in con.execute(f"SELECT * FROM {table}")]


def load_rows(path: str) -> list[dict[str, Any]]:
    """The records of a results file (json, jsonl, sql text or sqlite database)."""
    p = Path(path)
    if not p.is_file():
        raise CompareError(f"no such file: {path}")
    head = p.read_bytes()[:16]
    if head.startswith(b"SQLite format 3"):
        con = sqlite3.connect(str(p))
        try:
            rows = _from_sqlite(con, path)
        finally:
            con.close()
    else:
        text = p.read_text(encoding="utf-8")
        stripped = text.lstrip()
        try:
            if stripped.startswith("["):
                rows = json.loads(text)
            elif stripped.startswith("{"):
                rows = [json.loads(line) for line in text.splitlines() if line.strip()]
            elif stripped.upper().startswith("CREATE TABLE"):
                con = sqlite3.connect(":memory:")
                con.executescript(text)
                rows = _from_sqlite(con, path)
                con.close()
            else:
                raise CompareError(f"{path}: not a json, jsonl, sql or sqlite results file")
        except (json.JSONDecodeError, sqlite3.Error) as e:
            raise CompareError(f"{path}: cannot read it: {e}") from e
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise CompareError(f"{path}: expected a list of benchmark records")
    missing = [f for f in ("n_prompt", "n_gen", "avg_ts") if rows and f not in rows[0]]
    if missing:
        raise CompareError(
            f"{path}: the records lack {', '.join(missing)}: not infer-bench/llama-bench output"
        )
    return [_normalise(r) for r in rows]


def key_of(row: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(row.get(f) for f in KEY_FIELDS)


def _index(rows: list[dict[str, Any]], side: str) -> dict[tuple[Any, ...], dict[str, Any]]:
    out: dict[tuple[Any, ...], dict[str, Any]] = {}
    for r in rows:
        k = key_of(r)
        if k in out:
            engines = sorted({out[k]["engine"], r["engine"]})
            name = test_name(r["n_prompt"], r["n_gen"], r["n_depth"])
            hint = (
                f"choose one with --{side}-engine ({', '.join(engines)})"
                if len(engines) > 1
                else "the file holds the same test twice; keep one run per file"
            )
            raise CompareError(f"{side} has several rows for {r['model_type']} {name}: {hint}")
        out[k] = r
    return out


@dataclass
class Pair:
    base: dict[str, Any]
    cand: dict[str, Any]

    @property
    def speedup(self) -> float:
        return self.cand["avg_ts"] / self.base["avg_ts"] if self.base["avg_ts"] else float("nan")

    @property
    def test(self) -> str:
        return test_name(self.base["n_prompt"], self.base["n_gen"], self.base["n_depth"])


def pair_rows(
    base: list[dict[str, Any]],
    cand: list[dict[str, Any]],
    base_engine: str | None = None,
    cand_engine: str | None = None,
) -> list[Pair]:
    if base_engine:
        base = [r for r in base if r["engine"] == base_engine]
        if not base:
            raise CompareError(f"BASE has no rows of engine '{base_engine}'")
    if cand_engine:
        cand = [r for r in cand if r["engine"] == cand_engine]
        if not cand:
            raise CompareError(f"CANDIDATE has no rows of engine '{cand_engine}'")
    b, c = _index(base, "base"), _index(cand, "candidate")
    pairs = [Pair(b[k], c[k]) for k in b if k in c]
    if not pairs:
        raise CompareError("no test appears in both BASE and CANDIDATE with the same configuration")
    return pairs


def _varying(pairs: list[Pair]) -> list[str]:
    shown = []
    for f in ("n_threads", "n_batch", "n_ubatch", "type_k", "type_v", "n_gpu_layers", "flash_attn"):
        if len({p.base.get(f) for p in pairs}) > 1:
            shown.append(f)
    return shown


def _label(rows: list[dict[str, Any]]) -> str:
    engines = sorted({r["engine"] for r in rows})
    builds = sorted({str(r.get("build_commit", "")) for r in rows})
    return f"{'/'.join(engines)} ({'/'.join(builds)})" if builds else "/".join(engines)


def render(pairs: list[Pair], fmt: str = "md") -> str:
    extra = _varying(pairs)
    if fmt == "json":
        return (
            json.dumps(
                [
                    {
                        "model_type": p.base["model_type"],
                        "test": p.test,
                        **{f: p.base.get(f) for f in extra},
                        "base_engine": p.base["engine"],
                        "base_build": p.base.get("build_commit"),
                        "base_avg_ts": p.base["avg_ts"],
                        "base_stddev_ts": p.base["stddev_ts"],
                        "candidate_engine": p.cand["engine"],
                        "candidate_build": p.cand.get("build_commit"),
                        "candidate_avg_ts": p.cand["avg_ts"],
                        "candidate_stddev_ts": p.cand["stddev_ts"],
                        "speedup": p.speedup,
                    }
                    for p in pairs
                ],
                indent=2,
            )
            + "\n"
        )
    header = ["model", *extra, "test", "base", "t/s base", "candidate", "t/s candidate", "speedup"]
    rows = []
    for p in pairs:
        rows.append(
            [
                p.base["model_type"],
                *(str(p.base.get(f)) for f in extra),
                p.test,
                p.base["engine"],
                f"{p.base['avg_ts']:.2f} ± {p.base['stddev_ts']:.2f}",
                p.cand["engine"],
                f"{p.cand['avg_ts']:.2f} ± {p.cand['stddev_ts']:.2f}",
                f"{p.speedup:.2f}",
            ]
        )
    if fmt == "csv":
        lines = [",".join(header)] + [",".join('"' + c.replace('"', '""') + '"' for c in r) for r in rows]
        return "\n".join(lines) + "\n"
    left = tuple(i for i, name in enumerate(header) if name in ("model", "base", "candidate"))
    return md_table(header, rows, left)


def _kind(p: Pair) -> str:
    if p.base["n_gen"] == 0:
        return "prompt processing (pp)"
    if p.base["n_prompt"] == 0:
        return "text generation (tg)"
    return "prompt + generation (pp+tg)"


def _have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def plot(pairs: list[Pair], path: str, title: str | None = None) -> None:
    """One panel per kind of test (pp, tg, pp+tg); in each, bars per test for base and candidate
    side by side with their standard deviations, and the speedup above the candidate's bar."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise CompareError(
            "--plot needs matplotlib: pip install 'stdengine[plot]' (or pip install matplotlib)"
        ) from e
    varying = _varying(pairs)
    several_models = len({p.base["model_type"] for p in pairs}) > 1
    base_name = "/".join(sorted({p.base["engine"] for p in pairs}))
    cand_name = "/".join(sorted({p.cand["engine"] for p in pairs}))
    if base_name == cand_name:
        base_name, cand_name = f"base ({base_name})", f"candidate ({cand_name})"
    kinds: dict[str, list[Pair]] = {}
    for p in pairs:
        kinds.setdefault(_kind(p), []).append(p)
    widest = max(len(ps) for ps in kinds.values())
    fig, axes = plt.subplots(
        1, len(kinds), figsize=(max(6.0, (1.1 * widest + 1.5) * len(kinds)), 5.0), squeeze=False
    )
    width = 0.38
    for ax, (kind, ps) in zip(axes[0], kinds.items(), strict=True):
        xs = list(range(len(ps)))
        ax.bar(
            [x - width / 2 for x in xs],
            [p.base["avg_ts"] for p in ps],
            width,
            yerr=[p.base["stddev_ts"] for p in ps],
            capsize=3,
            label=base_name,
            color="tab:blue",
        )
        ax.bar(
            [x + width / 2 for x in xs],
            [p.cand["avg_ts"] for p in ps],
            width,
            yerr=[p.cand["stddev_ts"] for p in ps],
            capsize=3,
            label=cand_name,
            color="tab:orange",
        )
        for x, p in zip(xs, ps, strict=True):
            top = max(p.base["avg_ts"] + p.base["stddev_ts"], p.cand["avg_ts"] + p.cand["stddev_ts"])
            ax.annotate(
                f"{p.speedup:.2f}x",
                (x, top),
                textcoords="offset points",
                xytext=(0, 4),
                ha="center",
                fontsize=8,
            )
        labels = []
        for p in ps:
            lines = [" ".join(p.base["model_type"].split(" ")[:2])] if several_models else []
            lines.append(p.test)
            lines += [f"{f}={p.base.get(f)}" for f in varying]
            labels.append("\n".join(lines))
        ax.set_xticks(xs)
        ax.set_xticklabels(labels, fontsize=8)
        ax.set_title(kind, fontsize=10)
        ax.set_ylabel("tokens per second (mean ± sd)")
        ax.margins(y=0.12)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title or f"{cand_name} vs {base_name} (speedup = {cand_name} / {base_name})", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str]) -> int:
    files: list[str] = []
    opts: dict[str, str] = {"output": "md"}
    i = 0
    try:
        while i < len(argv):
            arg = argv[i]
            if arg in ("-h", "--help"):
                print(USAGE, end="")
                return 0
            if arg in ("--base-engine", "--candidate-engine", "--plot", "-o", "--output", "--title"):
                if i + 1 >= len(argv):
                    raise CompareError(f"invalid parameter for argument: {arg}")
                opts[{"-o": "output", "--output": "output"}.get(arg, arg[2:].replace("-", "_"))] = argv[i + 1]
                i += 2
                continue
            if arg.startswith("-"):
                raise CompareError(f"invalid parameter for argument: {arg}")
            files.append(arg)
            i += 1
        if len(files) != 2:
            raise CompareError("compare takes two results files: BASE CANDIDATE")
        if opts["output"] not in ("md", "csv", "json"):
            raise CompareError(f"invalid parameter for argument: -o {opts['output']} (md, csv or json)")
        if "plot" in opts and not _have_matplotlib():
            # before the table: a run that cannot do all it was asked does none of it
            from stdengine.errors import UsageError

            print("error: --plot needs matplotlib, which is not installed", file=sys.stderr)
            print(
                "hint: pip install 'stdengine[plot]' (or pip install matplotlib), or leave out --plot",
                file=sys.stderr,
            )
            return UsageError.exit_status
        pairs = pair_rows(
            load_rows(files[0]), load_rows(files[1]), opts.get("base_engine"), opts.get("candidate_engine")
        )
        sys.stdout.write(render(pairs, opts["output"]))
        if "plot" in opts:
            plot(pairs, opts["plot"], opts.get("title"))
            print(f"infer-bench: wrote {opts['plot']}", file=sys.stderr)
    except CompareError as e:
        print(f"error: {e}", file=sys.stderr)
        if not files:
            # no results file at all: most likely the reference-vs-llama.cpp run, which was
            # `infer bench compare` before it was named for what it does
            print(f"hint: {VS_LLAMACPP_HINT}", file=sys.stderr)
        if "invalid parameter" in str(e) or "two results files" in str(e):
            print(USAGE, end="", file=sys.stderr)
        return 1
    return 0
