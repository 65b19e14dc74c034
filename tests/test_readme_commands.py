"""The README's "What you get" commands, run as a new user runs them (with a small -n), each in a
fresh process: each exits 0 and prints what the README says it prints. `infer run -p` and
`infer chat` are in test_cli_real.py; `infer bench vs-llamacpp` in test_bench_real.py."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.models

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = {"infer": "stdengine.cli.main", "infer-bench": "stdengine.cli.bench"}

# Each command of the README's block (its first words) -> the test here (or elsewhere) that runs it.
COVERED = {
    'infer run -p "Write a haiku': "test_cli_real.py::test_infer_run_answers_a_chat_prompt",
    "infer run -m gemma-3-270m --raw": "test_cli_real.py::test_readme_gemma_example_completes_the_text",
    'echo "Once upon a time" | infer run --raw': "test_run_raw_from_stdin",
    "infer run --json": "test_run_json",
    "infer chat": "test_cli_real.py::test_infer_chat_answers_and_exits",
    "infer run -e llamacpp": "test_run_through_llamacpp",
    "infer serve -np 2": "test_serve_starts_answers_and_stops",
    "infer bench -e reference,llamacpp": "test_infer_bench",
    "infer bench vs-llamacpp": "test_bench_real.py::test_bench_vs_llamacpp_writes_into_the_current_directory",
    "infer conformance -e reference --report out/": "test_conformance_report",
    "infer models pull gemma-3-270m": "test_models_pull",
    "infer models info smollm2-135m-instruct": "test_models_info",
    "infer engines": "test_engines",
    "infer config show": "test_config_show",
}


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("INFER_") or k == "INFER_HOME"}


def sh(
    script: str, *args: str, stdin: str | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", SCRIPTS[script], *args]
    return subprocess.run(
        cmd, input=stdin, capture_output=True, text=True, timeout=600, env=clean_env(), cwd=cwd
    )


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = text.split("## What you get", 1)[1].split("```sh", 1)[1].split("```", 1)[0]
    return [line.split("  #", 1)[0].strip() for line in block.splitlines() if line.strip()]


def test_every_readme_command_is_tested():
    commands = readme_commands()
    assert len(commands) >= 12
    untested = [c for c in commands if not any(c.startswith(k) for k in COVERED)]
    assert not untested, f"README commands no test runs: {untested}"


@pytest.fixture(scope="module", autouse=True)
def models_cached(smollm2_path, gemma3_path):
    """The README's commands name the catalogue aliases: both are in the cache before they run."""


def test_run_raw_from_stdin():
    # echo "Once upon a time" | infer run --raw -n 32: the text as given, continued
    r = sh("infer", "run", "--raw", "-n", "8", "--temp", "0", stdin="Once upon a time\n")
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.split()) >= 3 and "<|im_" not in r.stdout
    assert "generation.done" in r.stderr and "prompt: 5 tokens" in r.stderr  # no template added


def test_run_json():
    # infer run --json -n 16 -p "Hi" | jq .timings: one JSON result on stdout, logs on stderr
    r = sh("infer", "run", "--json", "-n", "4", "-p", "Hi")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)  # the whole of stdout is one JSON document
    assert result["timings"]["predicted_n"] <= 4 and result["timings"]["prompt_n"] > 0
    assert "model.loaded" in r.stderr


@pytest.mark.llamacpp
def test_run_through_llamacpp():
    pytest.importorskip("llama_cpp")
    r = sh("infer", "run", "-e", "llamacpp", "-n", "8", "--temp", "0", "-p", "Hi")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() and "generation.done" in r.stderr


def test_serve_starts_answers_and_stops(tmp_path):
    # infer serve -np 2: the OpenAI API and the web chat, until Ctrl-C
    log = tmp_path / "serve.log"
    with open(log, "w", encoding="utf-8") as err:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "stdengine.cli.main",
                "serve",
                "-np",
                "2",
                "--port",
                "0",
                "--log-format",
                "json",
            ],
            stdout=subprocess.DEVNULL,
            stderr=err,
            env=clean_env(),
        )
        try:
            url = None
            while url is None and proc.poll() is None:
                for line in log.read_text(encoding="utf-8").splitlines():
                    if line.startswith("{") and json.loads(line).get("event") == "run.start":
                        url = json.loads(line).get("url") or url
                time.sleep(0.05)
            assert url, log.read_text()
            with urllib.request.urlopen(f"{url}/v1/models", timeout=60) as resp:
                models = json.loads(resp.read())
            assert models["data"] and "smollm2" in models["data"][0]["id"].lower()
            with urllib.request.urlopen(f"{url}/", timeout=60) as resp:
                assert "<html" in resp.read().decode().lower()  # the web chat
            body = json.dumps({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}).encode()
            req = urllib.request.Request(
                f"{url}/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(req, timeout=120) as resp:
                answer = json.loads(resp.read())
            assert answer["choices"][0]["message"]["content"]
        finally:
            proc.send_signal(signal.SIGINT)  # Ctrl-C
            code = proc.wait(60)
    assert code == 0, log.read_text()
    assert any(
        json.loads(x).get("event") == "server.stop" for x in log.read_text().splitlines() if x.startswith("{")
    )


def test_infer_bench(tmp_path):
    # infer bench -e reference,llamacpp -p 512 -n 128: llama-bench's md table (the reference engine here)
    r = sh("infer", "bench", "-e", "reference", "-p", "16", "-n", "4", "-r", "1")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines[0].startswith("| model") and "t/s" in lines[0]
    assert re.search(r"\|\s+pp16\s+\|", r.stdout) and re.search(r"\|\s+tg4\s+\|", r.stdout)


def test_conformance_report(tmp_path):
    # infer conformance -e reference --report out/: the report bundle (one check here)
    r = sh(
        "infer",
        "conformance",
        "-e",
        "reference",
        "--report",
        "out/",
        "--only",
        "tokenizer.ids:case=plain",
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    out = tmp_path / "out"
    assert {"results.json", "junit.xml", "summary.md", "ENGINE.yaml"} <= {p.name for p in out.iterdir()}
    results = json.loads((out / "results.json").read_text())
    assert "tokenizer.ids:case=plain" in json.dumps(results) and "pass" in json.dumps(results)


def test_models_pull(gemma3_path):
    # infer models pull gemma-3-270m: fetched and verified (cached here), its path on stdout
    r = sh("infer", "models", "pull", "gemma-3-270m")
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()).name == Path(gemma3_path).name


def test_models_info():
    # infer models info smollm2-135m-instruct: architecture, tensor types, memory needed
    r = sh("infer", "models", "info", "smollm2-135m-instruct")
    assert r.returncode == 0, r.stderr
    assert "architecture" in r.stdout and "llama" in r.stdout
    assert "tensors" in r.stdout and "q4_1" in r.stdout
    assert "memory at ctx_size 4096" in r.stdout


def test_engines():
    # infer engines: installed engines, capabilities, options
    r = sh("infer", "engines")
    assert r.returncode == 0, r.stderr
    assert "reference" in r.stdout and "openai" in r.stdout
    assert "capabilities" in r.stdout.lower() and "options" in r.stdout.lower()


def test_config_show():
    # infer config show: every effective option and where it came from
    r = sh("infer", "config", "show")
    assert r.returncode == 0, r.stderr
    assert "smollm2-135m-instruct" in r.stdout and "default" in r.stdout
    assert "temp" in r.stdout and "ctx_size" in r.stdout
