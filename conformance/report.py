"""The report bundle: results.json, junit.xml, summary.md and ENGINE.yaml in one directory.

results.json is the complete record (WebGPU CTS style: one entry per check ID with its status);
junit.xml is for CI systems (fail -> <failure>, skip/not_supported -> <skipped>, warn -> a pass
with the warning in <system-out>); summary.md is for people; ENGINE.yaml says what was tested
(Kubernetes' PRODUCT.yaml: engine, version, adapter, model, machine).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape, quoteattr

from stdengine.conformance.suite import LEVELS, Result, counts, exit_status, worst


def machine() -> dict[str, Any]:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "os": platform.platform(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
    }


def source_commit() -> str:
    """The short git commit of the stdengine checkout this runs from ("-dirty" when tracked files
    differ from it), or "unknown" outside a git checkout."""
    root = str(Path(__file__).resolve().parent.parent)

    def git(*args: str) -> subprocess.CompletedProcess[str] | None:
        try:
            return subprocess.run(["git", "-C", root, *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None

    head = git("rev-parse", "--short=7", "HEAD")
    if head is None or head.returncode != 0 or not head.stdout.strip():
        return "unknown"
    status = git("status", "--porcelain", "--untracked-files=no")
    dirty = status is not None and bool(status.stdout.strip())
    return head.stdout.strip() + ("-dirty" if dirty else "")


def bundle_meta(
    engine_info: dict[str, Any] | None,
    adapter: str | None,
    model: str | None,
    golden_note: str,
    url: str | None,
    level: str,
    only: str | None,
) -> dict[str, Any]:
    from stdengine.conformance.runner import SUITE_VERSION

    from stdengine import __version__

    return {
        "suite_version": SUITE_VERSION,
        "stdengine": __version__,
        "commit": source_commit(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "engine": engine_info or {},
        "adapter": adapter,
        "model": model,
        "golden": golden_note,
        "url": url,
        "level": level,
        "only": only,
        "machine": machine(),
    }


def groups(results: Sequence[Result]) -> dict[str, str]:
    by: dict[str, list[str]] = {}
    for r in results:
        by.setdefault(r.id.split(":", 1)[0].split(".", 1)[0], []).append(r.status)
    return {g: worst(s) for g, s in by.items()}


def to_json(results: Sequence[Result], meta: dict[str, Any]) -> dict[str, Any]:
    from stdengine.conformance.runner import new_checks

    return {
        **meta,
        "new_checks": new_checks([r.id for r in results]),
        "summary": counts(list(results)),
        "groups": groups(results),
        "exit_status": exit_status(list(results)),
        "results": [r.to_dict() for r in results],
    }


def junit(results: Sequence[Result], meta: dict[str, Any]) -> str:
    c = counts(list(results))
    name = f"stdengine conformance: {meta.get('adapter')} / {meta.get('model')}"
    total_s = sum(r.duration_ms for r in results) / 1e3
    lines = [
        '<?xml version="1.0" encoding="UTF-8"?>',
        f'<testsuites name={quoteattr(name)} tests="{len(results)}" failures="{c["fail"]}" '
        f'skipped="{c["skip"] + c["not_supported"]}" time="{total_s:.3f}">',
    ]
    by: dict[str, list[Result]] = {}
    for r in results:
        by.setdefault(r.id.split(":", 1)[0].split(".", 1)[0], []).append(r)
    for group, rs in by.items():
        gc = counts(rs)
        lines.append(
            f'  <testsuite name={quoteattr(group)} tests="{len(rs)}" failures="{gc["fail"]}" '
            f'skipped="{gc["skip"] + gc["not_supported"]}" time="{sum(r.duration_ms for r in rs) / 1e3:.3f}">'
        )
        for r in rs:
            lines.append(
                f"    <testcase classname={quoteattr(group + '.' + r.level)} name={quoteattr(r.id)} "
                f'time="{r.duration_ms / 1e3:.3f}">'
            )
            if r.status == "fail":
                lines.append(
                    f"      <failure message={quoteattr(r.message)}>{escape(json.dumps(r.details, default=str)[:4000])}</failure>"
                )
            elif r.status in ("skip", "not_supported"):
                lines.append(f"      <skipped message={quoteattr(r.status + ': ' + r.message)}/>")
            elif r.status == "warn":
                lines.append(f"      <system-out>{escape('WARN: ' + r.message)}</system-out>")
            lines.append("    </testcase>")
        lines.append("  </testsuite>")
    lines.append("</testsuites>")
    return "\n".join(lines) + "\n"


def summary_md(results: Sequence[Result], meta: dict[str, Any]) -> str:
    c = counts(list(results))
    eng = meta.get("engine") or {}
    verdict = "PASS: no core check failed" if exit_status(list(results)) == 0 else "FAIL: a core check failed"
    out = [
        f"# Conformance: {meta.get('adapter')} on {meta.get('model')}",
        "",
        f"- engine: {eng.get('name', meta.get('adapter'))} {eng.get('version', '')}".rstrip(),
        f"- model: {meta.get('model')} ({meta.get('golden')})",
        f"- level: {meta.get('level')}" + (f", only `{meta['only']}`" if meta.get("only") else ""),
        f"- date: {meta.get('date')}, suite {meta.get('suite_version')}, stdengine {meta.get('stdengine')}"
        f" (commit {meta.get('commit', 'unknown')})",
        f"- **{verdict}** — " + ", ".join(f"{n} {s}" for s, n in c.items() if n),
        "",
        "| group | status |",
        "|---|---|",
    ]
    out += [f"| {g} | {s} |" for g, s in groups(results).items()]
    out += ["", "| check | level | status | message |", "|---|---|---|---|"]
    order = {lvl: i for i, lvl in enumerate(LEVELS)}
    for r in sorted(results, key=lambda r: (r.status != "fail", r.status != "warn", order[r.level])):
        msg = r.message.replace("|", "\\|").replace("\n", " ")
        out.append(f"| `{r.id}` | {r.level} | {r.status} | {msg} |")
    return "\n".join(out) + "\n"


def _yaml_value(v: Any) -> str:
    # JSON scalars are valid YAML scalars: no YAML library needed
    return json.dumps(v, ensure_ascii=False, default=str)


def engine_yaml(meta: dict[str, Any]) -> str:
    eng = meta.get("engine") or {}
    model_meta = eng.get("model") or {}
    lines = [
        "# what was tested (stdengine conformance)",
        f"engine: {_yaml_value(eng.get('name', meta.get('adapter')))}",
        f"version: {_yaml_value(eng.get('version'))}",
        f"build: {_yaml_value(eng.get('build'))}",
        f"backend: {_yaml_value(eng.get('backend'))}",
        f"adapter: {_yaml_value(meta.get('adapter'))}",
        f"model: {_yaml_value(meta.get('model'))}",
        f"golden: {_yaml_value(meta.get('golden'))}",
        f"url: {_yaml_value(meta.get('url'))}",
        "model_info:" if model_meta else "model_info: {}",
    ]
    lines += [f"  {k}: {_yaml_value(v)}" for k, v in model_meta.items()]
    lines.append("machine:")
    lines += [f"  {k}: {_yaml_value(v)}" for k, v in (meta.get("machine") or {}).items()]
    lines += [
        f"suite_version: {_yaml_value(meta.get('suite_version'))}",
        f"stdengine: {_yaml_value(meta.get('stdengine'))}",
        f"commit: {_yaml_value(meta.get('commit'))}",
        f"date: {_yaml_value(meta.get('date'))}",
    ]
    return "\n".join(lines) + "\n"


BUNDLE = ("results.json", "junit.xml", "summary.md", "ENGINE.yaml")  # the files write_bundle writes


def write_bundle(directory: str | Path, results: Sequence[Result], meta: dict[str, Any]) -> Path:
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    texts = (
        json.dumps(to_json(results, meta), indent=2, default=str) + "\n",
        junit(results, meta),
        summary_md(results, meta),
        engine_yaml(meta),
    )
    for name, text in zip(BUNDLE, texts, strict=True):
        (d / name).write_text(text, encoding="utf-8")
    return d
