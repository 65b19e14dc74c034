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
    # the answer ("The capital of France is Paris." greedy on the AVX2 path), then a clean exit
    assert len(r.stdout.split()) >= 3, r.stdout


def test_infer_chat_sends_the_file_given_with_f_first(smollm2_path, tmp_path):
    (tmp_path / "first.txt").write_text("What is the capital of France?\n")
    r = infer(smollm2_path, "chat", "-f", str(tmp_path / "first.txt"), stdin="")
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.split()) >= 3, r.stdout  # -f was answered, not ignored


def test_infer_chat_refuses_a_bad_chat_template_before_any_turn(smollm2_path):
    r = infer(smollm2_path, "chat", "--chat-template", "{{ bad", stdin="hi\n")
    assert r.returncode == 2, r.stderr
    assert "error: the chat template given is not valid Jinja" in r.stderr and r.stdout == ""


def test_a_failed_turn_ends_a_scripted_chat_with_its_exit_status(smollm2_path):
    # stdin not a terminal: a script must see that the turn failed; later turns are not tried
    r = infer(smollm2_path, "chat", "-c", "16", stdin="a long line of text here\nhi\n")
    assert r.returncode == 5, r.stderr  # context_overflow
    assert r.stderr.count("error: ") == 1 and "but the context holds 16" in r.stderr
    assert r.stdout == ""
    # a line that is not UTF-8 is refused (invalid_usage), never sent as U+FFFD
    cmd = [sys.executable, "-m", "stdengine.cli.main", "chat", "-m", str(smollm2_path), "-n", "4"]
    r2 = subprocess.run(cmd, input=b"hi\n\xff\n", capture_output=True, timeout=300)
    assert r2.returncode == 2, r2.stderr
    assert b"error: the prompt from stdin (line 2) is not valid UTF-8 (byte 0: b'\\xff')" in r2.stderr
    assert len(r2.stdout.split()) >= 1  # the first line was answered


def test_a_failed_turn_at_a_terminal_is_shown_and_the_chat_goes_on(smollm2_path):
    import pty

    primary, secondary = pty.openpty()
    cmd = [sys.executable, "-m", "stdengine.cli.main", "chat", "-m", str(smollm2_path), "-c", "16"]
    try:  # the lines wait in the terminal's input queue until the chat reads them
        os.write(primary, b"a long line of text here, longer than the context\n\xff\n/exit\n")
        r = subprocess.run(cmd, stdin=secondary, capture_output=True, timeout=300)
    finally:
        os.close(primary)
        os.close(secondary)
    assert r.returncode == 0, r.stderr
    assert b"but the context holds 16" in r.stderr
    assert b"error: the prompt from the terminal is not valid UTF-8" in r.stderr


def loaded_event(stderr: str) -> dict:
    import json

    events = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
    return next(e for e in events if e["event"] == "model.loaded")


def test_model_loaded_says_the_file_template_is_used(smollm2_path):
    r = infer(smollm2_path, "run", "--log-format", "json", "-p", "Hi")
    assert r.returncode == 0, r.stderr
    ev = loaded_event(r.stderr)
    assert ev["chat_template"] == "model file" and ev["level"] == "info"


def test_model_loaded_warns_when_a_builtin_template_stands_in(gemma3_path):
    # Gemma-3-270M's file has no template: the run uses the built-in gemma one, and says so.
    r = infer(gemma3_path, "run", "--log-format", "json", "-p", "Name three rivers")
    assert r.returncode == 0, r.stderr
    ev = loaded_event(r.stderr)
    assert ev["chat_template"] == "built-in 'gemma' (the model file has none)"
    assert ev["level"] == "warn"
    r = infer(gemma3_path, "run", "--log-format", "json", "--chat-template", "gemma", "-p", "Hi")
    ev = loaded_event(r.stderr)  # chosen by the user: no warning
    assert ev["chat_template"] == "built-in 'gemma'" and ev["level"] == "info"


def test_readme_gemma_example_completes_the_text(gemma3_path):
    # The README's Gemma line: raw completion of a base model continues the sentence. The prompt
    # leaves little choice: "The Nile, the Amazon and the" went on "Mediterranean are the world's
    # most important ecosystems" on the AVX2 path, rounding's pick among near-ties.
    r = infer(gemma3_path, "run", "--raw", "-p", "The Nile, the Amazon and the Yangtze are")
    assert r.returncode == 0, r.stderr
    assert "river" in r.stdout.lower(), r.stdout
