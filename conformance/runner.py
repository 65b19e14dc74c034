"""Running the suite from Python: find the golden data, plan the checks, run them.

    from stdengine.conformance.runner import find_golden, run_suite
    golden, note = find_golden("smollm2-135m-instruct", path)
    results = run_suite(Context(engine=engine, golden=golden, golden_note=note), level="core")

The CLI (`infer conformance`) is a thin layer over this.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stdengine.conformance import checks, http, structured
from stdengine.conformance.golden import GOLDEN_DIR, golden_path, load_golden, sha256_file
from stdengine.conformance.suite import Check, Context, Result, run_check, select

SUITE_VERSION = "2.1"
# The checks each version added (ID globs): results.json lists the run's checks that are new in
# this version under `new_checks`, so an engine that passed 1.x knows what it is newly judged on.
ADDED: dict[str, tuple[str, ...]] = {
    "1.1": ("logits.stable",),
    "2.0": (
        "tokenizer.*:case=combining",
        "tokenizer.*:case=fullwidth",
        "tokenizer.*:case=ligatures",
        "tokenizer.*:case=superscripts",
        "tokenizer.*:case=nbsp",
        "tokenizer.*:case=ellipsis",
        "tokenizer.*:case=crlf",
        "logprobs.kl:*",
        "generation.golden:*",
        "generation.exact:*",
        "generation.sampler:*",
        "generation.concurrent:*",
        "http.generation.*",
        "http.logprobs.*",
        "http.stop*",
        "http.temperature0.*",
        "http.max_tokens*",
        "http.stream.equals*",
        "http.stream.incremental*",
        "http.sampler:*",
        "http.seed",
        "http.eog",
        "http.tokenize:*",
    ),
    "2.1": ("structured.*", "http.structured.*"),
}


def new_checks(ids: list[str], version: str = SUITE_VERSION) -> list[str]:
    """The check IDs among ids that `version` added."""
    return [i for i in ids if any(fnmatch.fnmatchcase(i, g) for g in ADDED.get(version, ()))]


def find_golden(model_ref: str | None, model_path: Path | None) -> tuple[dict[str, Any] | None, str]:
    """The golden data for a model: by catalogue alias, else by the file's SHA256. When the file
    is not the one the golden data was made from, the data does not apply (returns None, why)."""
    sha = sha256_file(model_path) if model_path is not None and model_path.is_file() else None
    candidates: list[Path] = []
    if model_ref and golden_path(model_ref).is_file():
        candidates.append(golden_path(model_ref))
    candidates += [p for p in sorted(GOLDEN_DIR.glob("*.json.gz")) if p not in candidates]
    for p in candidates:
        data = load_golden(p)
        if sha is not None and data.get("sha256") == sha:
            return data, f"golden data {p.name}"
        if sha is None and p.name == f"{model_ref}.json.gz":
            # a remote engine: no file to hash, trust the alias
            return data, f"golden data {p.name} (by name; the served file cannot be verified)"
        if sha is not None and p.name == f"{model_ref}.json.gz":
            return None, (
                f"the golden data {p.name} was made from a file with SHA256 {data.get('sha256')}, "
                f"this file's is {sha}"
            )
    known = ", ".join(p.name.removesuffix(".json.gz") for p in sorted(GOLDEN_DIR.glob("*.json.gz")))
    return None, f"no golden data for this model (golden data exists for: {known})"


def plan(ctx: Context) -> list[Check]:
    engine = checks.plan(ctx) + structured.plan_structured(ctx) if ctx.engine is not None else []
    return engine + http.plan_http(ctx) + structured.plan_http(ctx)


def run_suite(
    ctx: Context,
    level: str = "core",
    only: str | None = None,
    on_start: Callable[[list[Check]], None] | None = None,
    on_result: Callable[[Check, Result], None] | None = None,
) -> list[Result]:
    selected = select(plan(ctx), level, only)
    if on_start is not None:
        on_start(selected)
    results = []
    for check in selected:
        result = run_check(check, ctx)
        results.append(result)
        if on_result is not None:
            on_result(check, result)
    return results
