"""The `infer` command line: help, config show, errors as one line with a documented exit status."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def infer(
    *args: str,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
    stdin: str | None = None,
    stdin_closed: bool = False,
):
    """stdin_closed: started as with `<&-`."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "stdengine.cli.main", *args],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=cwd,
        input=stdin,
        preexec_fn=(lambda: os.close(0)) if stdin_closed else None,
        timeout=300,
    )


def test_help_lists_every_verb_and_imports_nothing_heavy():
    code = (
        "import sys\nfrom stdengine.cli.main import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in ('numpy', 'gguf', 'jinja2', 'rich', 'stdengine.reference') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    for verb in ("run", "chat", "serve", "models", "engines", "config", "conformance"):
        assert f"  {verb} " in out
    assert out.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize("verb", ["run", "chat", "serve", "engines", "config", "conformance"])
def test_every_verb_has_help(verb):
    r = infer(verb, "--help")
    assert r.returncode == 0 and "Usage:" in r.stdout


def test_config_show_flag_beats_environment(tmp_path):
    r = infer("config", "show", "--json", "-t", "5", env={"INFER_THREADS": "3"}, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    threads = json.loads(r.stdout)["options"]["threads"]
    assert threads == {"value": 5, "source": "flag"}


def test_misspelt_config_key_is_one_clear_line(tmp_path):
    (tmp_path / "infer.toml").write_text("temprature = 0.2\n")
    r = infer("config", "show", cwd=str(tmp_path), env={"XDG_CONFIG_HOME": str(tmp_path)})
    assert r.returncode == 2
    assert r.stderr.startswith("error: infer.toml:1: unknown option 'temprature'")
    assert "did you mean 'temp'" in r.stderr and "Traceback" not in r.stderr


def test_option_the_engine_cannot_honour_is_refused(tmp_path):
    r = infer("run", "-ctk", "q8_0", "-p", "hi", cwd=str(tmp_path))
    assert r.returncode == 2, r.stderr
    assert "cannot honour cache_type_k" in r.stderr


def test_unknown_engine_and_missing_prompt(tmp_path):
    r = infer("run", "-e", "refrence", "-p", "hi", cwd=str(tmp_path))
    assert r.returncode == 2 and "did you mean 'reference'" in r.stderr
    r = infer("run", "-m", str(tmp_path / "missing.gguf"), "-p", "", cwd=str(tmp_path))
    assert r.returncode == 2 and "empty" in r.stderr


def test_chat_refuses_bad_first_messages_and_closed_stdin_before_loading(tmp_path):
    # -f is the first message, as -p is: a missing file is refused, not ignored; a model that
    # does not exist shows that each check comes before the load (which would exit 3)
    chat = ("chat", "-m", str(tmp_path / "missing.gguf"))
    r = infer(*chat, "-f", str(tmp_path / "missing.txt"), stdin="hi\n", cwd=str(tmp_path))
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("error: prompt file not found:") and r.stdout == ""
    r = infer(*chat, "-p", "hi", "-f", str(tmp_path / "missing.txt"), stdin="", cwd=str(tmp_path))
    assert r.returncode == 2 and "not both" in r.stderr, r.stderr
    # bytes that are not UTF-8 are refused, never sent as U+FFFD (spec/errors.md)
    r = infer(*chat, "-p", os.fsdecode(b"\xff"), stdin="", cwd=str(tmp_path))
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("error: the prompt from -p is not valid UTF-8 (byte 0: b'\\xff')")
    # stdin closed (<&-): a usage error, not an internal one
    r = infer(*chat, cwd=str(tmp_path), stdin_closed=True)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("error: stdin is closed, and `infer chat` reads the conversation from it")


def test_run_refuses_a_directory_prompt_file_and_closed_stdin_before_loading(tmp_path):
    run = ("run", "-m", str(tmp_path / "missing.gguf"), "-n", "2")
    r = infer(*run, "-f", str(tmp_path), cwd=str(tmp_path))
    assert r.returncode == 2 and r.stderr.startswith(f"error: -f {tmp_path} is a directory"), r.stderr
    r = infer(*run, "-p", "hi", env={"INFER_FILE": "x.txt"}, cwd=str(tmp_path))
    assert r.returncode == 2 and "INFER_FILE" in r.stderr, r.stderr
    r = infer(*run, cwd=str(tmp_path), stdin_closed=True)
    assert r.returncode == 2 and r.stderr.startswith("error: no prompt given, and stdin is closed"), r.stderr


def test_a_bad_infer_verbosity_is_one_clear_error_without_a_traceback(tmp_path):
    r = infer("config", "show", env={"INFER_VERBOSITY": "abc"}, cwd=str(tmp_path))
    assert r.returncode == 2 and "INFER_VERBOSITY" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_disk_is_not_reported_as_a_bug(tmp_path):
    with open("/dev/full", "w") as full:
        r = subprocess.run(
            [sys.executable, "-m", "stdengine.cli.main", "config", "show"],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            cwd=str(tmp_path),
            timeout=120,
        )
    assert r.returncode == 1 and "error: cannot write: No space left on device" in r.stderr, r.stderr
    assert "report it" not in r.stderr


def test_engines_json_lists_reference():
    r = infer("engines", "--json")
    assert r.returncode == 0, r.stderr
    rows = {e["name"]: e for e in json.loads(r.stdout)}
    ref = rows["reference"]
    assert "logits" in ref["capabilities"] and "ctx_size" in ref["honoured_options"]
    assert ref["option_values"]["cache_type_k"] == ["f32", "f16"]  # honoured at these values only
    r = infer("engines")
    assert 'cache_type_k "f32"|"f16"' in " ".join(r.stdout.split()), r.stdout


@pytest.mark.parametrize(
    ("args", "env", "where"), [(["-m", ""], {}, "-m ''"), ([], {"INFER_MODEL": " "}, "INFER_MODEL ' '")]
)
def test_empty_model_reference_is_an_error_not_the_default(tmp_path, args, env, where):
    r = infer("run", *args, "-n", "2", "-p", "hi", env=env, cwd=str(tmp_path))
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith(f"error: the model reference is empty ({where})")
    assert "hint: give a .gguf path, a catalogue alias" in r.stderr
    assert "model.loaded" not in r.stderr and r.stdout == ""


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("INFER_")}


def config_show(*args: str, cwd: str) -> dict:
    r = subprocess.run(
        [sys.executable, "-m", "stdengine.cli.main", "config", "show", "--json", *args],
        capture_output=True,
        text=True,
        env={**_clean_env(), "XDG_CONFIG_HOME": cwd},
        cwd=cwd,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["options"]


def test_config_show_prints_the_model_and_threads_the_engine_will_use(tmp_path):
    """Not `null`: the catalogue's default model, and threads as the local engines choose them
    (physical cores, counted here from /proc/cpuinfo's distinct physical id/core id pairs)."""
    cores: set[tuple[str, str]] = set()
    phys = ""
    if os.path.exists("/proc/cpuinfo"):
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            key, _, value = line.partition(":")
            if key.strip() == "physical id":
                phys = value.strip()
            elif key.strip() == "core id":
                cores.add((phys, value.strip()))
    expected = len(cores) or os.cpu_count()
    opts = config_show(cwd=str(tmp_path))
    assert opts["model"] == {"value": "smollm2-135m-instruct", "source": "default"}
    assert opts["threads"] == {"value": expected, "source": "default"}
    assert opts["threads_batch"] == {"value": expected, "source": "default"}
    opts = config_show("-t", "3", cwd=str(tmp_path))
    assert opts["threads"] == {"value": 3, "source": "flag"}
    assert opts["threads_batch"] == {"value": 3, "source": "default"}  # threads_batch follows threads
    # the text table says the same
    r = infer(
        "config", "show", env={"COLUMNS": "120", "INFER_MODEL": "", "INFER_THREADS": ""}, cwd=str(tmp_path)
    )
    rows = {
        line.split("│")[1].strip(): line.split("│")[2].strip()
        for line in r.stdout.splitlines()
        if "│" in line
    }
    assert rows["model"] == "smollm2-135m-instruct" and rows["threads"] == str(expected)


def test_config_show_leaves_what_a_remote_engine_decides_null(tmp_path):
    """The openai engine's model defaults to the server's first model, unknown without asking it."""
    opts = config_show("-e", "openai", cwd=str(tmp_path))
    assert opts["model"] == {"value": None, "source": "default"}


def test_engines_is_readable_at_80_columns():
    """One block per engine: no line wider than the terminal, no option name split across lines."""
    r = infer("engines", env={"COLUMNS": "80"})
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert all(len(line) <= 80 for line in lines), max(lines, key=len)
    words = {w.strip(",") for line in lines for w in line.split()}
    for row in json.loads(infer("engines", "--json").stdout):
        assert row["name"] in words
        for option in row["honoured_options"]:
            assert option in words, f"{row['name']}: option {option} is not shown whole"


def test_engines_shows_the_install_hint_of_an_engine_that_cannot_load():
    """rich markup would read `[llamacpp]` as a tag and print `pip install 'stdengine'`."""
    code = (
        "import sys\nsys.modules['llama_cpp'] = None  # as if llama-cpp-python were not installed\n"
        "from stdengine.cli.main import main\nmain(['engines'])\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"}
    )
    assert r.returncode == 0, r.stderr
    block = r.stdout.split("llamacpp", 1)[1].split("\n\n")[0]
    assert "not available" in block
    assert "pip install 'stdengine[llamacpp]'" in block


def help_text(*verb: str) -> str:
    r = infer(*verb, "--help", env={"COLUMNS": "100"})
    assert r.returncode == 0, r.stderr
    return " ".join(r.stdout.split())  # click wraps lines: compare on single spaces


def shown_flags(text: str) -> set[str]:
    return {w.rstrip(",") for w in text.split() if w.startswith("-") and len(w) > 1}


@pytest.mark.parametrize("verb", ["run", "chat"])
def test_run_and_chat_help_show_no_server_options_and_their_defaults(verb):
    text = help_text(verb)
    flags = shown_flags(text)
    for server_only in ("--host", "--port", "-np", "--parallel"):
        assert server_only not in flags, f"infer {verb} --help shows {server_only}"
    # a remote engine's URL and key are still options of run/chat (-e openai --url URL)
    assert {"--url", "--api-key", "-p", "-n", "--temp"} <= flags
    # the standard's defaults (spec/options.md), not what the code computes
    assert "temperature (0 = greedy) [default: 0.8; env: INFER_TEMP]" in text
    assert "[default: -1; env: INFER_N_PREDICT]" in text
    assert "[default: 4096; env: INFER_CTX_SIZE]" in text
    assert "[default: smollm2-135m-instruct" in text
    assert "[default: off; env: INFER_FLASH_ATTN]" in text


def test_serve_help_shows_server_options_and_no_prompt_options():
    text = help_text("serve")
    flags = shown_flags(text)
    assert {"--host", "--port", "-np", "--api-key"} <= flags
    assert not {"-p", "--prompt", "-f", "-sys"} & flags
    assert "[default: 127.0.0.1; env: INFER_HOST]" in text and "[default: 8080; env: INFER_PORT]" in text


def test_conformance_help_shows_no_sampling_or_server_options():
    flags = shown_flags(help_text("conformance"))
    assert not {"--temp", "-p", "--host", "--port", "-np"} & flags


def interrupt_after_words(cmd: list[str], words: int) -> tuple[int, str, list[dict]]:
    """Start a run, wait for `words` words of its output, press Ctrl-C (SIGINT); returns the exit
    status, everything it printed and its JSON log events."""
    import signal

    # Ctrl-C's default action in the child even when this process ignores SIGINT (a run started in
    # the background with `&` or nohup does): Python installs its handler only where it is not ignored
    def default_sigint() -> None:
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint
    )
    assert proc.stdout is not None
    seen = ""
    while len(seen.split()) <= words:  # one more: the last word seen is complete
        c = proc.stdout.read(1)
        assert c, f"the run ended before {words} words: {seen!r}"
        seen += c
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    events = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    assert events[-1]["event"] == "error" and events[-1]["code"] == "interrupted", err
    return proc.returncode, seen + out, events


def test_ctrl_c_prints_the_timings_so_far_for_any_engine():
    """The toy engine (tests/test_server_toy.py) gives no partial timings: `infer run` counts the
    tokens it received."""
    toy = os.path.join(os.path.dirname(__file__), "test_server_toy.py")
    cmd = [sys.executable, toy, "run", "-e", "toy", "-m", "toy", "-E", "delay_ms=20", "-n", "100000"]
    rc, out, events = interrupt_after_words([*cmd, "--log-format", "json", "-p", "hi"], 4)
    assert rc == 130
    (done,) = [e for e in events if e["event"] == "generation.done"]
    assert done["finish_reason"] == "interrupted"
    assert done["timings"]["predicted_n"] >= 4  # one word per token
    assert done["timings"]["predicted_n"] < 100000
    assert done["summary"].endswith("finish: interrupted")


@pytest.mark.models
def test_ctrl_c_prints_the_timings_so_far_of_the_reference_engine(smollm2_path):
    cmd = [sys.executable, "-m", "stdengine.cli.main", "run", "-m", str(smollm2_path), "--temp", "0"]
    cmd += [
        "-n",
        "2000",
        "--log-format",
        "json",
        "-p",
        "Write a very long story about a dragon who learns to read.",
    ]
    rc, out, events = interrupt_after_words(cmd, 5)
    assert rc == 130
    (done,) = [e for e in events if e["event"] == "generation.done"]
    t = done["timings"]
    assert done["finish_reason"] == "interrupted"
    assert t["prompt_n"] > 10 and t["prompt_ms"] > 0  # the prompt was evaluated, and says so
    assert 5 <= t["predicted_n"] < 2000 and t["predicted_per_second"] > 0
