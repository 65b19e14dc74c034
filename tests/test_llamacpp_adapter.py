"""The llamacpp engine on the catalogue models: against the reference engine (token ids, chat
template, greedy text), decode() logits, generation semantics, option refusal and the CLI.

Expected values come from elsewhere than the code under test: the reference engine's tokenizer
and engine, the same run without a stop string, or plain facts ("Paris").
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from stdengine import registry
from stdengine.adapter import DoneEvent, GenerateRequest, SamplingParams, TokenEvent
from stdengine.errors import BadModelFile, ContextOverflow, InvalidRequest, UnsupportedOption
from stdengine.events import Emitter
from stdengine.options import Options

pytest.importorskip("llama_cpp")
pytestmark = [pytest.mark.llamacpp, pytest.mark.models]

from stdengine.engines.llamacpp import LlamaCppEngine  # noqa: E402

TEXTS = [
    "Hello world",
    " leading space and  double  spaces",
    "café, naïve, 日本語, emoji 😀",
    "line\nbreaks\n\nand\ttabs",
    "numbers 12345 and 3.14159",
    "<|im_start|>user\nHi<|im_end|>",
    "<start_of_turn>user\nHi<end_of_turn>",
]


def load(path: Path, **kw: object) -> LlamaCppEngine:
    opts = {"model": str(path), "engine": "llamacpp", "threads": 2, "ctx_size": 512, **kw}
    return LlamaCppEngine.load(Options(**opts), Emitter(verbosity=0))


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def model_path(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(f"{request.param}_path")


@pytest.fixture(scope="module")
def engine(model_path: Path):
    e = load(model_path)
    yield e
    e.close()


@pytest.fixture(scope="module")
def smol(smollm2_path: Path):
    e = load(smollm2_path)
    yield e
    e.close()


def run(engine, request: GenerateRequest) -> tuple[list[int], str, DoneEvent]:
    ids, text, done = [], "", None
    for ev in engine.generate(request):
        if isinstance(ev, TokenEvent):
            ids += [ev.id] if ev.id >= 0 else []
            text += ev.text
        else:
            done = ev
    assert done is not None
    return ids, text, done


def greedy(n: int, **kw: object) -> SamplingParams:
    return SamplingParams(temp=0.0, n_predict=n, **kw)  # type: ignore[arg-type]


# --- against the reference engine ---------------------------------------------------------
def test_tokenize_matches_the_reference_tokenizer(engine, model_path):
    from stdengine.reference.tokenizer import Tokenizer

    ref = Tokenizer.from_gguf(str(model_path))
    for text in TEXTS:
        for add_special in (True, False):
            assert engine.tokenize(text, add_special=add_special) == list(
                ref.encode(text, add_special=add_special, parse_special=True)
            ), (text, add_special)
    plain = "<|im_start|> and <start_of_turn> as text"
    assert engine.tokenize(plain, parse_special=False) == list(
        ref.encode(plain, add_special=True, parse_special=False)
    )


@pytest.fixture(scope="module")
def reference(model_path: Path):
    try:
        from stdengine.reference.adapter import ReferenceEngine

        e = ReferenceEngine.load(
            Options(model=str(model_path), threads=2, ctx_size=512), Emitter(verbosity=0)
        )
    except Exception as exc:  # the reference engine is built alongside; compare once it runs
        pytest.skip(f"the reference engine cannot run yet: {type(exc).__name__}: {exc}")
    yield e
    e.close()


def prompt_tokens(engine: LlamaCppEngine, request: GenerateRequest) -> list[int]:
    """The prompt as generate() builds it (the reference engine's rule for BOS)."""
    if request.messages is None:
        assert request.prompt is not None
        return engine.tokenize(request.prompt)
    tokens = engine.tokenize(engine.apply_chat_template(request.messages), add_special=False)
    if engine.add_bos and engine.bos_id is not None and tokens[:1] != [engine.bos_id]:
        tokens = [engine.bos_id, *tokens]
    return tokens


def test_greedy_text_matches_the_reference_engine(engine, reference):
    """Same greedy tokens, or a first difference at a near tie: two engines with different
    quantized kernels may rank two almost equal logits differently, and then go their own ways."""
    requests = [GenerateRequest(prompt="The capital of France is", sampling=greedy(12))]
    if engine.has_chat_template():
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        assert engine.apply_chat_template(messages) == reference.apply_chat_template(messages)
        requests.append(GenerateRequest(messages=messages, sampling=greedy(12)))
    else:
        requests.append(GenerateRequest(prompt="Once upon a time", sampling=greedy(12)))
    assert engine.has_chat_template() == reference.has_chat_template()
    for request in requests:
        ids, text, done = run(engine, request)
        ref_ids, ref_text, ref_done = run(reference, request)
        assert done.usage.prompt_tokens == ref_done.usage.prompt_tokens
        if ids == ref_ids:
            assert text == ref_text and done.finish_reason == ref_done.finish_reason
            continue
        i = next(k for k, (a, b) in enumerate(zip(ids, ref_ids, strict=False)) if a != b)
        engine.reset()
        logits = engine.decode(prompt_tokens(engine, request) + ids[:i])
        engine.reset()
        margin = float(logits.max() - logits[ref_ids[i]])
        assert margin < 1.0, (
            f"token {i}: the reference chose {ref_ids[i]}, {margin:.2f} below llama.cpp's top"
        )


# --- decode() -----------------------------------------------------------------------------
def test_decode_logits_are_sane_and_consistent(engine):
    tokens = engine.tokenize("The capital of France is Paris, and the capital of Germany is")
    engine.reset()
    batch = engine.decode(tokens, all_logits=True)
    assert batch.shape == (len(tokens), engine.info().model["n_vocab"]) and batch.dtype == np.float32
    assert np.isfinite(batch).all() and batch.std() > 0.1

    engine.reset()  # a second run from a clean cache is the same computation: bit-identical
    assert np.array_equal(engine.decode(tokens, all_logits=True), batch)

    engine.reset()
    one_by_one = np.stack([engine.decode([t]) for t in tokens])
    engine.reset()
    split = np.concatenate(
        [engine.decode(tokens[:5], all_logits=True), engine.decode(tokens[5:], all_logits=True)]
    )
    engine.reset()
    assert np.array_equal(engine.decode(tokens[:7]), batch[6])  # the last row alone
    # llama.cpp's batched and single-token kernels round differently: close, not equal
    for other in (one_by_one, split):
        for row, ref in zip(other, batch, strict=True):
            assert np.sqrt(np.mean((row - ref) ** 2)) < 0.2 * ref.std()
            top2 = np.sort(ref)[-2:]
            if top2[1] - top2[0] > 1.0:  # a clear winner stays the winner
                assert row.argmax() == ref.argmax()
    engine.reset()


def test_decode_knows_the_capital_of_france(smol):
    smol.reset()
    logits = smol.decode(smol.tokenize("The capital of France is"))
    assert smol.detokenize([int(logits.argmax())]).strip() == "Paris"
    smol.reset()


# --- generation semantics -------------------------------------------------------------------
def test_stop_string_ends_generation_before_it(smol):
    _, full, done = run(smol, GenerateRequest(prompt="Once upon a time", sampling=greedy(16)))
    assert done.finish_reason == "length" and len(full) > 12
    stop = full[8:11]  # a stop string that spans into the middle of the text
    _, text, done = run(smol, GenerateRequest(prompt="Once upon a time", sampling=greedy(16, stop=[stop])))
    assert text == full[: full.find(stop)]
    assert (done.finish_reason, done.stop) == ("stop", stop)


def test_n_predict_and_usage(smol):
    ids, text, done = run(smol, GenerateRequest(prompt="Once upon a time", sampling=greedy(5)))
    assert len(ids) == 5 and done.finish_reason == "length"
    assert done.usage.completion_tokens == 5 and done.usage.prompt_tokens == len(
        smol.tokenize("Once upon a time")
    )
    assert done.timings.predicted_n == 5 and done.timings.prompt_ms > 0
    assert smol.detokenize(ids) == text


def test_seeded_sampling_is_reproducible(smol):
    params = SamplingParams(temp=0.9, seed=1234, n_predict=12)
    first = run(smol, GenerateRequest(prompt="Once upon a time", sampling=params))[0]
    assert run(smol, GenerateRequest(prompt="Once upon a time", sampling=params))[0] == first


def test_context_overflow_then_serves_the_next_request(smollm2_path):
    small = load(smollm2_path, ctx_size=256)
    try:
        assert small.n_ctx() == 256
        with pytest.raises(ContextOverflow):
            run(small, GenerateRequest(prompt="word " * 400, sampling=greedy(4)))
        assert run(small, GenerateRequest(prompt="Hello", sampling=greedy(3)))[2].usage.completion_tokens == 3
    finally:
        small.close()


# --- options, errors, info ---------------------------------------------------------------------
def test_options_accepted_and_refused():
    registry.check_options(LlamaCppEngine, {"top_k", "ctx_size", "cache_type_k", "mlock", "repeat_last_n"})
    with pytest.raises(UnsupportedOption, match="url"):
        registry.check_options(LlamaCppEngine, {"url"})


def test_kv_cache_types_and_their_limits(smollm2_path):
    e = load(smollm2_path, cache_type_k="q8_0", cache_type_v="q8_0", flash_attn=True)
    assert run(e, GenerateRequest(prompt="Hello", sampling=greedy(3)))[2].usage.completion_tokens == 3
    e.close()
    with pytest.raises(UnsupportedOption, match="flash_attn"):  # llama.cpp: quantized V needs flash attention
        load(smollm2_path, cache_type_v="q4_0")


def test_gpu_layers_refused_without_a_gpu_backend(smollm2_path):
    import llama_cpp

    if llama_cpp.llama_supports_gpu_offload():
        pytest.skip("this llama-cpp-python build can offload to a GPU")
    with pytest.raises(UnsupportedOption, match="n_gpu_layers"):
        load(smollm2_path, n_gpu_layers=10)


def test_bad_model_file(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(60))
    with pytest.raises(BadModelFile, match="could not load"):
        load(bad)


def test_info_names_llama_cpp_and_its_build(smol):
    import llama_cpp

    info = smol.info()
    assert info.name == "llamacpp" and info.version == llama_cpp.__version__
    assert info.build == f"llama-cpp-python {llama_cpp.__version__}; {LlamaCppEngine.build_info()}"
    # each x86 feature that decides where a build runs, as llama.cpp's own system info says
    system = " " + llama_cpp.llama_print_system_info().decode()
    shown = info.build.split()
    for feature in ("AVX2", "AVX512", "AVX512_VNNI", "AVX_VNNI", "AMX_INT8"):
        assert f"{feature}={int(f' {feature} = 1 |' in system)}" in shown, (feature, system)
    assert info.model["architecture"] == "llama" and info.model["n_vocab"] == 49152


def test_model_loaded_names_the_build(smollm2_path):
    import io

    log = io.StringIO()
    opts = Options(model=str(smollm2_path), engine="llamacpp", threads=1, ctx_size=256)
    LlamaCppEngine.load(opts, Emitter(log_format="json", stream=log)).close()
    (loaded,) = [e for e in map(json.loads, log.getvalue().splitlines()) if e["event"] == "model.loaded"]
    assert loaded["build"] == LlamaCppEngine.build_info()


def test_build_summary_of_a_gpu_build_with_amx():
    from stdengine.engines.llamacpp import build_summary

    system = (
        "CUDA : ARCHS = 890 | USE_GRAPHS = 1 | PEER_MAX_BATCH_SIZE = 128 | "
        "CPU : SSE3 = 1 | AVX = 1 | AVX2 = 1 | AVX512 = 1 | AVX512_VNNI = 1 | AMX_INT8 = 1 | OPENMP = 1 | "
    )
    assert build_summary(system) == "CUDA CPU AVX2=1 AVX512=1 AVX512_VNNI=1 AVX_VNNI=0 AMX_INT8=1"


def test_listed_as_available_by_infer_engines_with_its_build():
    code = (
        "import sys; from stdengine.registry import describe; "
        "rows = {r['name']: r for r in describe()}; print(rows['llamacpp']['available'], rows['llamacpp']['build'])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == f"True {LlamaCppEngine.build_info()}"
    assert "AMX_INT8=" in out


# --- the CLI --------------------------------------------------------------------------------
def infer(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "stdengine.cli.main", *args],
        capture_output=True,
        text=True,
        input=stdin,
        timeout=300,
    )


def test_cli_run_on_both_models(smollm2_path, gemma3_path):
    for path in (smollm2_path, gemma3_path):
        r = infer(
            *"run -e llamacpp -n 4 -c 512 --temp 0 --top-k 5 -t 2 --json -p".split(),
            "Name a color.",
            "-m",
            str(path),
        )
        assert r.returncode == 0, r.stderr
        result = json.loads(r.stdout)
        assert result["engine"] == "llamacpp" and result["usage"]["completion_tokens"] > 0


def test_cli_chat(smollm2_path):
    r = infer(*"chat -e llamacpp -n 8 --temp 0 -t 2 -m".split(), str(smollm2_path), stdin="Hello!\n/exit\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()


def test_cli_refuses_load_options_for_the_openai_engine():
    r = infer("run", "-e", "openai", "--url", "http://127.0.0.1:9", "-c", "100", "-p", "hi")
    assert r.returncode == 2
    assert "engine 'openai' cannot honour ctx_size" in r.stderr


def test_engine_args_are_refused_not_ignored(tmp_path):
    """llama.cpp takes no -E settings through this adapter: a key is an error naming it."""
    options = Options(engine="llamacpp", model=str(tmp_path / "any.gguf"), engine_args={"n_gqa": "8"})
    with pytest.raises(UnsupportedOption, match="takes no -E settings, got: n_gqa"):
        LlamaCppEngine.load(options, Emitter(log_format="json"))


def _llama_cpp_must_not_run(*args: object) -> None:
    raise AssertionError("llama.cpp was called")


# Counts llama.cpp does not refuse itself: more threads than GGML_MAX_N_THREADS (512) crash or hang
# ggml; a context or batch size past its uint32 field wraps (2**32 became n_ctx 8192, -b 2**32 an abort).
TOO_LARGE = [
    ("threads", 100_000, 512),
    ("threads_batch", 513, 512),
    ("ctx_size", 2**32, 2**31 - 1),
    ("batch_size", 2**32, 2**31 - 1),
    ("ubatch_size", 2**31, 2**31 - 1),
]


@pytest.mark.parametrize(("option", "value", "limit"), TOO_LARGE)
def test_counts_llama_cpp_cannot_take_are_refused_before_it_runs(tmp_path, monkeypatch, option, value, limit):
    import llama_cpp

    for name in ("llama_model_load_from_file", "llama_init_from_model"):
        monkeypatch.setattr(llama_cpp, name, _llama_cpp_must_not_run)
    options = Options(engine="llamacpp", model=str(tmp_path / "any.gguf"), **{option: value})
    with pytest.raises(UnsupportedOption) as refused:
        LlamaCppEngine.load(options, Emitter(log_format="json"))
    e = refused.value
    assert (e.code, e.exit_status) == ("unsupported_option", 2)
    assert e.message == f"engine 'llamacpp' cannot honour {option}={value}: at most {limit}"
    assert e.hint is not None and e.hint.startswith(f"use a smaller {option} (")
    assert e.details == {"options": [option]}


def test_counts_at_the_limits_reach_llama_cpp(tmp_path, monkeypatch):
    """The limits are inclusive: at them, the load goes on to llama.cpp (stopped here before it runs)."""
    import llama_cpp

    monkeypatch.setattr(llama_cpp, "llama_model_load_from_file", _llama_cpp_must_not_run)
    limits = {option: limit for option, _, limit in TOO_LARGE}
    options = Options(engine="llamacpp", model=str(tmp_path / "any.gguf"), **limits)
    with pytest.raises(AssertionError, match="llama.cpp was called"):
        LlamaCppEngine.load(options, Emitter(log_format="json"))


def test_cli_refuses_too_many_threads_and_a_wrapping_context(smollm2_path):
    """infer run exits 2 naming the option, and llama.cpp never loads (it would crash: exit 139)."""
    code = (
        "import sys, llama_cpp\n"
        "def boom(*a):\n    raise AssertionError('llama.cpp was called')\n"
        "llama_cpp.llama_model_load_from_file = llama_cpp.llama_init_from_model = boom\n"
        "from stdengine.cli.main import main\nmain(sys.argv[1:])\n"
    )
    for flags, message in (
        ("-t 100000", "threads=100000: at most 512"),
        ("-tb 100000", "threads_batch=100000: at most 512"),
        ("-c 4294967296", "ctx_size=4294967296: at most 2147483647"),
        ("-b 4294967296", "batch_size=4294967296: at most 2147483647"),
    ):
        args = ["run", "-e", "llamacpp", "-p", "hi", "-n", "2", *flags.split(), "-m", str(smollm2_path)]
        r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)
        assert r.returncode == 2, (flags, r.stderr)
        lines = r.stderr.splitlines()
        assert lines[0] == f"error: engine 'llamacpp' cannot honour {message}", (flags, r.stderr)
        assert lines[1].startswith("hint: use a smaller"), (flags, r.stderr)


def test_detokenize_refuses_ids_outside_the_vocabulary(smol) -> None:
    """An id outside the vocabulary is an invalid request, never passed to llama.cpp (which would
    read outside its token table)."""
    for bad in ([-1], [5, -2], [smol.n_vocab]):
        with pytest.raises(InvalidRequest, match="outside the vocabulary"):
            smol.detokenize(bad)
    assert smol.detokenize(smol.tokenize("Hello", add_special=False)).strip() == "Hello"


def test_logprobs_are_log_softmax_of_the_engines_logits(engine) -> None:
    """generate() with logprobs: each token's log-probability and top-5 are numpy's log_softmax of
    the logits decode() gives for the same tokens; score() the same over a prompt. decode() is
    called as generate() evaluates (the prompt in one batch, then one token at a time): llama.cpp's
    logits depend on the batch's shape (0.07 apart in a log-probability on a build without AVX-512)."""
    prompt = engine.tokenize("Emoji 🙂 and text:")
    request = GenerateRequest(prompt_tokens=prompt, sampling=SamplingParams(temp=0, n_predict=3), logprobs=5)
    engine.reset()  # no prefix kept from an earlier test: the whole prompt in one batch
    events = [ev for ev in engine.generate(request) if isinstance(ev, TokenEvent) and ev.token]
    assert len(events) == 3
    engine.reset()
    rows = [engine.decode(prompt, all_logits=True)]
    rows += [engine.decode([ev.id], all_logits=True) for ev in events[:-1]]
    logits = np.concatenate(rows).astype(np.float64)
    engine.reset()
    lp = logits - logits.max(axis=1, keepdims=True)
    lp -= np.log(np.exp(lp).sum(axis=1, keepdims=True))
    for ev, row in zip(events, lp[len(prompt) - 1 :], strict=False):
        assert ev.id == int(np.argmax(row)) and abs(ev.logprob - row[ev.id]) < 1e-4
        assert [t.id for t in ev.top_logprobs] == list(np.argsort(-row, kind="stable")[:5])
        assert np.allclose([t.logprob for t in ev.top_logprobs], np.sort(row)[::-1][:5], atol=1e-4)
    scored = engine.score_prompt(prompt, 3)
    assert b"".join(t.piece for t in scored.tokens).decode("utf-8") == engine.detokenize(prompt)
    for t in range(1, len(prompt)):
        assert abs(scored.tokens[t].logprob - lp[t - 1][prompt[t]]) < 1e-4
        assert scored.top[t - 1][0].id == int(np.argmax(lp[t - 1]))


def test_a_reproducible_request_evaluates_its_whole_prompt_again(smol) -> None:
    """llama.cpp's logits depend on the batch's size, so a greedy or seeded request does not reuse
    the cached prefix (its answer must not depend on what the context held): the same request
    twice evaluates every prompt token both times and gives the same tokens. Randomly seeded
    sampling reuses the prefix (only the last token is evaluated again)."""
    prompt = smol.tokenize("The capital of France is")
    smol.reset()
    for sampling in (greedy(8), SamplingParams(temp=1.0, seed=42, n_predict=8)):
        first = run(smol, GenerateRequest(prompt_tokens=prompt, sampling=sampling))
        second = run(smol, GenerateRequest(prompt_tokens=prompt, sampling=sampling))
        assert second[2].timings.prompt_n == len(prompt) and second[0] == first[0]
    random = SamplingParams(temp=1.0, seed=-1, n_predict=8)
    run(smol, GenerateRequest(prompt_tokens=prompt, sampling=random))
    assert run(smol, GenerateRequest(prompt_tokens=prompt, sampling=random))[2].timings.prompt_n == 1
