"""The suite's power: every broken engine of tests/broken_engines.py (the reference engine plus one
realistic bug) fails the checks that name its fault, and the correct reference engine passes them.

Each fault runs only the checks that name it (a full core run per fault would take minutes); the
correct engine runs every family those checks belong to, so a check that fails every engine cannot
pass this test.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
from broken_engines import FAULTS, Faulty, SkipsLayer, without_layer
from served import KEY, InProcessServer
from stdengine.conformance.runner import run_suite
from stdengine.conformance.suite import Context, exit_status
from stdengine.reference.adapter import ReferenceEngine

from stdengine.events import null_emitter
from stdengine.options import Options

ALIAS = "smollm2-135m-instruct"
N_CTX = 2048  # holds the induction case (about 1220 positions)
# the families the faults' checks belong to, all run for the correct engine
FAMILIES = ("tokenizer.ids:*", "tokenizer.roundtrip:*", "logits.kl:*", "generation.*")


@pytest.fixture(scope="module")
def golden(smollm2_golden: dict[str, Any]) -> dict[str, Any]:
    return smollm2_golden


def run(
    cls: type[ReferenceEngine], model: Path, golden: dict[str, Any], original: Path, globs: Iterable[str]
) -> dict[str, Any]:
    engine = cls.load(Options(model=str(model), ctx_size=N_CTX, threads=2), null_emitter())
    try:
        # the exact reference reads the original file: a broken copy is judged against the model
        ctx = Context(engine=engine, golden=golden, golden_note="test", model=ALIAS, model_path=original)
        results = []
        for glob in globs:
            results += run_suite(ctx, level="core", only=glob)
    finally:
        engine.close()
    return {r.id: r for r in results}


def model_for(fault: type[Faulty], model: Path, tmp: Path) -> Path:
    """The file a broken engine loads: the model, or for SkipsLayer a copy without layer 15."""
    return without_layer(model, 15, tmp / "skips-layer-15.gguf") if fault is SkipsLayer else model


def matching(results: dict[str, Any], glob: str) -> list[str]:
    return [i for i in results if fnmatch.fnmatchcase(i, glob)]


@pytest.fixture(scope="module")
def correct(smollm2_path: Path, golden: dict[str, Any]) -> dict[str, Any]:
    return run(ReferenceEngine, smollm2_path, golden, smollm2_path, FAMILIES)


def test_the_correct_engine_passes_every_check_the_faults_fail(correct: dict[str, Any]) -> None:
    bad = {i: r.message for i, r in correct.items() if r.status != "pass"}
    assert not bad, bad
    for cls in FAULTS:
        for glob in cls.fails:
            assert matching(correct, glob), f"{cls.__name__}: no check matches {glob}"


@pytest.mark.parametrize("fault", FAULTS, ids=lambda c: c.__name__)
def test_the_suite_fails_each_broken_engine_with_the_check_that_names_it(
    fault: type[Faulty], smollm2_path: Path, golden: dict[str, Any], tmp_path: Path
) -> None:
    results = run(fault, model_for(fault, smollm2_path, tmp_path), golden, smollm2_path, fault.fails)
    failed = {i for i, r in results.items() if r.status == "fail"}
    for glob in fault.fails:
        ids = matching(results, glob)
        assert ids, f"no check matches {glob}"
        assert set(ids) & failed, {i: (results[i].status, results[i].message) for i in ids}
    assert exit_status(list(results.values())) == 1


SERVED = [cls for cls in FAULTS if cls.fails_served]


@pytest.mark.parametrize("fault", SERVED, ids=lambda c: c.__name__)
def test_served_by_infer_serve_each_broken_engine_fails_an_http_check(
    fault: type[Faulty], smollm2_path: Path, golden: dict[str, Any], tmp_path: Path
) -> None:
    """The same engines behind `infer serve`, judged by the HTTP checks alone (a black box)."""
    server = InProcessServer(fault, model_for(fault, smollm2_path, tmp_path))
    try:
        ctx = Context(url=server.url, api_key=KEY, golden=golden, golden_note="test", model=ALIAS)
        results = {r.id: r for glob in fault.fails_served for r in run_suite(ctx, level="core", only=glob)}
    finally:
        server.stop()
    failed = {i for i, r in results.items() if r.status == "fail"}
    assert failed, {i: (r.status, r.message) for i, r in results.items()}
    assert exit_status(list(results.values())) == 1
