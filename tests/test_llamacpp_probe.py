"""A llama.cpp build that dies by a signal (SIGILL on a CPU it was not built for) fails the tests
that need it, with the reason and the README's fix, and the rest of the run goes on to its summary.
An inner pytest runs the project's conftest over a llama_cpp whose model load kills the process."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent

INNER_TESTS = """
import pytest


@pytest.mark.llamacpp
def test_marked_oracle():
    import llama_cpp

    llama_cpp.Llama("model.gguf")  # in process: this would kill the run


def test_unmarked_use():
    import llama_cpp

    llama_cpp.Llama("model.gguf")


def test_unrelated():
    assert 1 + 1 == 2
"""


def run_inner(tmp_path: Path, llama_body: str) -> subprocess.CompletedProcess[str]:
    fake = tmp_path / "site" / "llama_cpp"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(llama_body)
    suite = tmp_path / "suite"
    suite.mkdir()
    for name in ("conftest.py", "llamacpp_probe.py", "gguf_factory.py", "allowed_skips.txt"):
        shutil.copy(HERE / name, suite / name)
    (suite / "test_inner.py").write_text(INNER_TESTS)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "site"), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore", str(suite)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=suite,
        env=env,
    )


def test_a_crashing_llamacpp_fails_its_tests_and_the_run_finishes(tmp_path):
    r = run_inner(
        tmp_path,
        "import os, signal\n\n"
        "class Llama:\n"
        "    def __init__(self, *args, **kwargs):\n"
        "        os.kill(os.getpid(), signal.SIGILL)\n",
    )
    assert r.returncode == 1, r.stdout + r.stderr  # tests failed; not killed by the signal
    assert "2 failed, 1 passed" in r.stdout, r.stdout  # the summary is printed
    assert r.stdout.count("died with SIGILL") >= 3, r.stdout  # each failure and the summary say why
    assert "README.md" in r.stdout and "--no-cache-dir --force-reinstall" in r.stdout


def test_a_working_llamacpp_is_left_alone(tmp_path):
    r = run_inner(
        tmp_path, "class Llama:\n    def __init__(self, *args, **kwargs):\n        self.ok = True\n"
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "3 passed" in r.stdout and "died with" not in r.stdout


@pytest.mark.llamacpp
def test_the_installed_llamacpp_runs_on_this_cpu():
    # The real build, as the probe found it: a crash is reported here too, by name.
    from llamacpp_probe import crash_message

    pytest.importorskip("llama_cpp")
    assert crash_message() is None
