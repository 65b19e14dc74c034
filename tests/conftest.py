"""Shared fixtures: the real catalogue models (pulled into the cache on first use)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# A recipe in the user's folder or the project's (./.infer/recipes) would change the options every
# test runs with; tests of recipes set their own folders and INFER_RECIPE.
os.environ.setdefault("INFER_RECIPE", "none")


def _catalogue_model(alias: str, env: str) -> Path:
    override = os.environ.get(env)
    if override:
        return Path(override)
    from stdengine.store import resolve_model

    return resolve_model(alias)


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """SmolLM2-135M-Instruct Q4_1 (catalogue alias smollm2-135m-instruct); INFER_TEST_SMOLLM2 overrides."""
    return _catalogue_model("smollm2-135m-instruct", "INFER_TEST_SMOLLM2")


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    """Gemma-3-270M Q4_K_M (catalogue alias gemma-3-270m); INFER_TEST_GEMMA3 overrides."""
    return _catalogue_model("gemma-3-270m", "INFER_TEST_GEMMA3")


# Tests that read a catalogue model (through these fixtures, directly or through another fixture)
# are marked `models`, so that `pytest -m "not models"` runs exactly the ones that need none.
MODEL_FIXTURES = frozenset({"smollm2_path", "gemma3_path"})


def pytest_collection_modifyitems(config, items):
    for item in items:
        if MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.models)
        if LLAMACPP_CRASH and item.get_closest_marker("llamacpp"):
            item.runtest = _fail_with_crash  # fails (not skips) with the probe's reason


# llama.cpp is imported in process by the oracle tests: first check in a subprocess that its build
# runs on this CPU (tests/llamacpp_probe.py). If it dies by a signal, the llamacpp tests fail with
# the reason and the rest of the run goes on.
LLAMACPP_CRASH: str | None = None


def pytest_sessionstart(session):
    global LLAMACPP_CRASH
    import sys

    from llamacpp_probe import CrashedLlamaCpp, crash_message

    LLAMACPP_CRASH = crash_message()
    if LLAMACPP_CRASH:
        sys.modules["llama_cpp"] = CrashedLlamaCpp(LLAMACPP_CRASH)


def _fail_with_crash() -> None:
    pytest.fail(LLAMACPP_CRASH or "", pytrace=False)


def pytest_terminal_summary(terminalreporter):
    if LLAMACPP_CRASH:
        terminalreporter.write_line(f"\n{LLAMACPP_CRASH}", red=True, bold=True)


# In CI (CI=true) a skip fails the run unless its reason matches a line of allowed_skips.txt:
# a fixture that cannot load something must not turn a broken install into a green run.
ALLOWED_SKIPS = Path(__file__).with_name("allowed_skips.txt")


def _allowed_skip_reasons() -> list[str]:
    lines = ALLOWED_SKIPS.read_text(encoding="utf-8").splitlines() if ALLOWED_SKIPS.exists() else []
    return [line.split("#", 1)[0].strip() for line in lines if line.split("#", 1)[0].strip()]


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    if os.environ.get("CI", "").lower() not in ("1", "true", "yes"):
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter else []
    allowed = _allowed_skip_reasons()
    unexpected = []
    for report in skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        if not any(a in reason for a in allowed):
            unexpected.append(f"{report.nodeid}: {reason}")
    if unexpected:
        print(
            f"\n{len(unexpected)} unexpected skip(s) in CI (tests/allowed_skips.txt lists the allowed ones):"
        )
        for line in unexpected:
            print(f"  {line}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session")
def smollm2_golden(smollm2_path: Path) -> dict:
    """SmolLM2's golden conformance data (format 2: with generation cases)."""
    from stdengine.conformance.runner import find_golden

    golden, note = find_golden("smollm2-135m-instruct", smollm2_path)
    assert golden is not None, note
    assert golden.get("generation", {}).get("cases"), "golden data without generation cases: regenerate it"
    return golden


@pytest.fixture
def skewed_shares():
    """Passes of more than one token start every matmul step with all its rows in the last
    thread's share (se_set_share_rows_skew), so the other threads compute only rows they take from
    it: what the threads' timing does now and then, made certain. Yields a function that returns
    how many rows were taken from another thread's share since the fixture began."""
    from stdengine.reference import core

    before = core.rows_taken_from_others()
    was = core.set_share_rows_skew(True)
    try:
        yield lambda: core.rows_taken_from_others() - before
    finally:
        core.set_share_rows_skew(was)
