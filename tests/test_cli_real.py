"""The README's headline commands with the reference engine on the default model: `infer run`
and `infer chat` answer, in a fresh process, as a new user runs them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.models


def infer(smollm2_path: Path, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFER_")}
    cmd = [
        sys.executable,
        "-m",
        "stdengine.cli.main",
        *args,
        "-m",
        str(smollm2_path),
        "-n",
        "24",
        "--temp",
        "0",
    ]
    return subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=300, env=env)


def test_infer_run_answers_a_chat_prompt(smollm2_path):
    r = infer(smollm2_path, "run", "-p", "Why is the sky blue?")
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.split()) >= 10  # an answer, on stdout
    assert "generation.done" in r.stderr and "finish: length" in r.stderr  # timings on stderr
    assert "<|im_" not in r.stdout  # the chat template's control tokens are not text


def test_infer_chat_answers_and_exits(smollm2_path):
    r = infer(smollm2_path, "chat", stdin="What is the capital of France?\n/exit\n")
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.split()) >= 10, r.stdout  # the answer, then a clean exit at /exit
