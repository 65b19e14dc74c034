"""The reference engine behind the adapter interface, on a tiny synthetic model: decode() gives
the caller arrays of its own, and the kernels' SIMD path is visible (info, model.loaded, `infer
engines`)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from isa import PATH_FLAGS, best_path

from stdengine.events import Emitter
from stdengine.options import Options

TOKENS = [1, 17, 42, 5, 63, 8, 21, 50]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from gguf_factory import write_llama_gguf

    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    write_llama_gguf(path, weight_type="Q8_0", n_layer=2, n_embd=64, n_ff=128, n_head=4, n_head_kv=2)
    return path


def load(path, stream: io.StringIO | None = None):
    from stdengine.reference.adapter import ReferenceEngine

    events = Emitter(log_format="json", stream=stream or io.StringIO())
    return ReferenceEngine.load(Options(model=str(path), ctx_size=64, threads=1), events)


def test_logits_returned_earlier_do_not_change_after_later_calls(tiny):
    engine = load(tiny)
    try:
        kept, copies = [], []
        for t in TOKENS:
            logits = engine.decode([t])
            kept.append(logits)
            copies.append(np.array(logits, copy=True))
        rows = engine.decode(TOKENS[:3], all_logits=True)
        rows_copy = rows.copy()
        engine.reset()
        last = engine.decode(TOKENS[:2])
        last_copy = last.copy()
        engine.decode(TOKENS[2:4])
        # the inputs differ, so the logits do: a shared buffer would show the last call's values
        assert all(not np.array_equal(a, b) for a, b in zip(copies, copies[1:], strict=False))
        for i, (got, copy) in enumerate(zip(kept, copies, strict=True)):
            np.testing.assert_array_equal(got, copy, err_msg=f"logits of decode() call {i} changed")
        np.testing.assert_array_equal(rows, rows_copy)
        np.testing.assert_array_equal(last, last_copy)
        # the caller may write into its array without touching the engine's next result
        last[:] = 0.0
        engine.reset()
        np.testing.assert_array_equal(engine.decode(TOKENS[:2]), last_copy)
    finally:
        engine.close()


def test_the_isa_is_in_info_and_model_loaded(tiny):
    from stdengine.reference.core import isa_name

    log = io.StringIO()
    engine = load(tiny, log)
    try:
        assert isa_name() in ("scalar", "avx2", "avx512", "amx")
        assert engine.info().build == f"isa={isa_name()}"
        loaded = [json.loads(line) for line in log.getvalue().splitlines()]
        loaded = [e for e in loaded if e["event"] == "model.loaded"]
        assert len(loaded) == 1 and loaded[0]["isa"] == isa_name()
    finally:
        engine.close()


def engines_build(env_isa: str | None) -> str:
    """The reference engine's build column of `infer engines --json`, INFER_REF_ISA unset or set."""
    env = {k: v for k, v in os.environ.items() if k != "INFER_REF_ISA"}
    if env_isa:
        env["INFER_REF_ISA"] = env_isa
    out = subprocess.run(
        [sys.executable, "-m", "stdengine.cli.main", "engines", "--json"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    ).stdout
    return str({r["name"]: r for r in json.loads(out)}["reference"]["build"])


def test_infer_engines_shows_the_isa_this_cpu_allows():
    """The best path this CPU's flags allow (the kernels' rule, tests/isa.py PATH_FLAGS), and a
    lower one when INFER_REF_ISA forces it."""
    assert engines_build(None) == f"isa={best_path()}"
    assert engines_build("scalar") == "isa=scalar"


def infer_run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if k != "INFER_REF_ISA"}
    full.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "stdengine.cli.main", "run", *args],
        capture_output=True,
        text=True,
        env=full,
        timeout=300,
    )


def test_unknown_engine_args_are_refused_not_ignored(tiny):
    """The reference engine's -E settings are screen_head and batch_panels: any other key is an
    unsupported_option error naming it and the valid keys (spec/options.md: engines refuse keys
    they do not know), in the API and on the command line; a bad value of either is a usage error."""
    from stdengine.reference.adapter import ReferenceEngine

    from stdengine.errors import UnsupportedOption

    options = Options(model=str(tiny), ctx_size=64, threads=1, engine_args={"kv_layout": "interleaved"})
    with pytest.raises(UnsupportedOption, match="kv_layout"):
        ReferenceEngine.load(options, Emitter(log_format="json", stream=io.StringIO()))
    r = infer_run("-m", str(tiny), "-E", "foo=bar", "-n", "2", "-p", "hi")
    assert r.returncode == 2, r.stderr
    assert "error: engine 'reference' has no -E setting foo" in r.stderr
    assert "hint: valid -E keys: screen_head: on (default) or off" in r.stderr and r.stdout == ""
    assert "batch_panels: on (default) or off" in r.stderr
    for key in ("screen_head", "batch_panels"):
        r = infer_run("-m", str(tiny), "-E", f"{key}=maybe", "-n", "2", "-p", "hi")
        assert r.returncode == 2 and f"-E {key} takes on or off, not 'maybe'" in r.stderr, r.stderr
    options = Options(model=str(tiny), ctx_size=64, threads=1, engine_args={"batch_panels": "off"})
    ReferenceEngine.load(options, Emitter(log_format="json", stream=io.StringIO())).close()
    # the same key from a config file's [engine_args] table
    cfg = tiny.parent / "with-args.toml"
    cfg.write_text('[engine_args]\nkv_layout = "interleaved"\n')
    r = infer_run("--config", str(cfg), "-m", str(tiny), "-n", "2", "-p", "hi")
    assert r.returncode == 2 and "no -E setting kv_layout" in r.stderr


def test_unknown_infer_ref_isa_is_an_error_with_the_valid_names(tiny):
    r = infer_run("-m", str(tiny), "-n", "2", "-p", "hi", env={"INFER_REF_ISA": "bogus"})
    assert r.returncode == 2, r.stderr
    assert "error: INFER_REF_ISA='bogus' is not a SIMD path" in r.stderr
    assert "scalar|avx2|avx512" in r.stderr and r.stdout == ""
    # a valid, runnable path still runs
    r = infer_run("-m", str(tiny), "-n", "2", "--raw", "-p", "hi", env={"INFER_REF_ISA": "scalar"})
    assert "isa=scalar" in r.stderr and "INFER_REF_ISA" not in r.stderr, r.stderr


def test_infer_ref_isa_this_cpu_cannot_run_is_an_error(monkeypatch):
    """The C core falls back to the best path when asked for one the CPU lacks; the engine sees the
    difference and refuses, naming the paths this CPU runs."""
    from stdengine.reference import core

    from stdengine.errors import ConfigError

    monkeypatch.setattr(core, "isa_name", lambda: "avx2")  # as on a CPU without AVX-512
    with pytest.raises(ConfigError, match="cannot run") as e:
        core.check_isa_env({"INFER_REF_ISA": "avx512"})
    assert e.value.hint is not None and "this CPU runs scalar|avx2" in e.value.hint
    core.check_isa_env({"INFER_REF_ISA": "avx2"})  # what runs is what was asked: no error
    core.check_isa_env({})


def test_infer_ref_isa_above_this_cpu_fails_the_run(tiny):
    paths = list(PATH_FLAGS)
    best = paths.index(best_path())
    if best == len(paths) - 1:
        pytest.skip("this CPU runs every path")
    want = paths[best + 1]
    r = infer_run("-m", str(tiny), "-n", "2", "-p", "hi", env={"INFER_REF_ISA": want})
    assert r.returncode == 2 and "cannot run" in r.stderr, r.stderr


def test_generation_that_fills_the_context_ends_with_length(smollm2_path):
    """n_predict -1 generates until the context is full, then finishes with "length" (no
    ContextOverflow mid-stream): the n_ctx positions hold prompt and answer, and the last token is
    sampled from the last of them."""
    from stdengine.reference.adapter import ReferenceEngine

    from stdengine.adapter import DoneEvent, GenerateRequest, SamplingParams

    engine = ReferenceEngine.load(
        Options(model=str(smollm2_path), ctx_size=48, threads=2), Emitter(stream=io.StringIO())
    )
    request = GenerateRequest(prompt="1, 2, 3, 4, 5,", sampling=SamplingParams(temp=0, n_predict=-1))
    events = list(engine.generate(request))
    done = events[-1]
    assert isinstance(done, DoneEvent) and done.finish_reason == "length"
    assert done.usage.prompt_tokens + done.usage.completion_tokens == 48 + 1
    assert "".join(e.text for e in events[:-1]).startswith(" 6, 7, 8")  # a real answer, not garbage


def test_detokenize_refuses_ids_outside_the_vocabulary(tiny):
    from stdengine.errors import InvalidRequest

    engine = load(tiny)
    assert engine.detokenize(TOKENS[:3]) == engine.detokenize(TOKENS[:3])  # in range: fine
    for bad in ([-1], [5, -2], [64], [10**9]):  # -1 once gave the last token's text
        with pytest.raises(InvalidRequest, match="outside the vocabulary"):
            engine.detokenize(bad)


@pytest.mark.parametrize(
    "flags, option",
    [
        (["-c", "4294967552"], "ctx_size=4294967552"),
        (["-c", "10000000"], "ctx_size=10000000"),
        (["-t", "1000"], "threads=1000"),
    ],
)
def test_sizes_past_the_c_cores_limits_are_refused(tiny, flags, option):
    """Past the C core's limits a size is an error naming it (exit 2), never truncated to int32
    (-c 4294967552 became a 256-position context), clamped (-t 1000 ran on 255 threads) or reported
    as out of memory."""
    r = infer_run("-m", str(tiny), "-n", "2", "-p", "hi", *flags)
    assert r.returncode == 2 and f"cannot honour {option}: at most" in r.stderr, r.stderr


def test_load_reads_the_file_once(tiny, monkeypatch):
    """One scan of the GGUF per load, shared by the model and the tokenizer (issue 17): a second
    reader of the same untrusted file would be a second place to get the bounds wrong."""
    from stdengine import gguf_file

    calls = []
    scan = gguf_file.scan_gguf

    def counting_scan(*args, **kwargs):
        calls.append(args)
        return scan(*args, **kwargs)

    monkeypatch.setattr(gguf_file, "scan_gguf", counting_scan)
    engine = load(tiny)
    try:
        assert len(calls) == 1
        assert engine.tokenizer.n_vocab == engine.model.n_vocab
        assert engine.decode(TOKENS[:2]).shape == (engine.n_vocab,)
    finally:
        engine.close()
