"""The suite against real engines on SmolLM2-135M: a working engine passes, and deliberately broken
engines (each a small subclass of the llamacpp adapter) fail exactly the checks that should catch
them. A check that cannot fail is a defect, so each family of checks has a broken engine here.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest
from stdengine.conformance.runner import find_golden, run_suite
from stdengine.conformance.suite import Context

from stdengine.adapter import GenerateRequest, GenerationEvent
from stdengine.events import null_emitter
from stdengine.options import Options

pytestmark = [pytest.mark.models, pytest.mark.llamacpp]
ALIAS = "smollm2-135m-instruct"
N_CTX = 2048  # holds every golden text and case; keeps the over-long prompts of the error checks short


@pytest.fixture(scope="module")
def llamacpp_cls():
    pytest.importorskip("llama_cpp")
    try:
        from stdengine.engines.llamacpp import LlamaCppEngine
    except Exception as e:  # the adapter is someone else's work in progress
        pytest.skip(f"llamacpp adapter unavailable: {e}")
    return LlamaCppEngine


@pytest.fixture(scope="module")
def golden(smollm2_path):
    g, note = find_golden(ALIAS, smollm2_path)
    assert g is not None, note
    return g


def run(
    cls: type,
    path: Any,
    golden: dict[str, Any],
    only: str | None = None,
    level: str = "core",
    ctx_size: int = N_CTX,
) -> dict[str, Any]:
    # one thread: no spin-waiting thread pool fighting other processes for the CI machine's 2 cores
    engine = cls.load(Options(model=str(path), ctx_size=ctx_size, threads=1), null_emitter())
    try:
        ctx = Context(engine=engine, golden=golden, golden_note="test", model=ALIAS, model_path=path)
        results = run_suite(ctx, level=level, only=only)
    finally:
        engine.close()
    return {r.id: r for r in results}


def failing(results: dict[str, Any]) -> set[str]:
    return {i for i, r in results.items() if r.status == "fail"}


# --- the working engine -----------------------------------------------------------------------
def test_working_engine_passes_every_core_check(llamacpp_cls, smollm2_path, golden):
    results = run(llamacpp_cls, smollm2_path, golden)
    assert len(results) > 50
    # llama-cpp-python's Llama has one context: new_context() returns None
    bad = {
        i: r.message
        for i, r in results.items()
        if r.status != "pass" and (i, r.status) != ("generation.concurrent:contexts=3", "not_supported")
    }
    assert not bad, bad


# --- broken engines -----------------------------------------------------------------------------
def test_ignoring_stop_strings_fails_the_stop_checks(llamacpp_cls, smollm2_path, golden):
    class IgnoresStop(llamacpp_cls):  # type: ignore[misc]
        def generate(self, request: GenerateRequest) -> Iterator[GenerationEvent]:
            s = dataclasses.replace(request.sampling, stop=[])
            return super().generate(dataclasses.replace(request, sampling=s))

    results = run(IgnoresStop, smollm2_path, golden, only="generation.stop*")
    assert failing(results) == {"generation.stop:strings=1", "generation.stop:strings=3"}


def test_off_by_one_tokenizer_fails_the_tokenizer_checks(llamacpp_cls, smollm2_path, golden):
    class OffByOne(llamacpp_cls):  # type: ignore[misc]
        """A wrong merge: the third token of a text comes out as its neighbour id."""

        def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
            ids = super().tokenize(text, add_special, parse_special)
            if len(ids) >= 3:
                ids[2] += 1
            return ids

    results = run(OffByOne, smollm2_path, golden, only="tokenizer.*")
    bad = failing(results)
    assert "tokenizer.ids:case=sentence" in bad and "tokenizer.roundtrip:case=sentence" in bad
    assert "tokenizer.ids:case=plain" not in bad  # two tokens: untouched, still passes
    assert results["tokenizer.ids:case=empty"].status == "pass"


def test_rope_error_fails_the_logits_checks(llamacpp_cls, smollm2_path, golden):
    class WrongRope(llamacpp_cls):  # type: ignore[misc]
        """A real RoPE error: the context is built with rope_freq_base 10000, not the model's 100000."""

        @classmethod
        def load(cls, options: Options, events: Any) -> Any:
            engine = super().load(options, events)
            lib = engine.lib
            cp = lib.llama_context_default_params()
            cp.n_ctx, cp.n_batch, cp.n_ubatch = options.ctx_size, options.batch_size, options.ubatch_size
            cp.n_threads = cp.n_threads_batch = 1
            cp.rope_freq_base = 10000.0
            lib.llama_free(engine.ctx)
            engine.ctx = lib.llama_init_from_model(engine.model, cp)
            return engine

    results = run(WrongRope, smollm2_path, golden, only="logits.*")
    assert failing(results) >= {
        "logits.kl:text=prose",
        "logits.kl:text=long",
        "logits.kl:text=all",
        "logits.top1:text=all",
    }
    kl = results["logits.kl:text=all"].details["engine"]["kl_mean"]
    assert kl > 10 * results["logits.kl:text=all"].details["bound"]


def test_position_bug_across_decode_calls_fails_batch_invariance(llamacpp_cls, smollm2_path, golden):
    class ForgetsOneToken(llamacpp_cls):  # type: ignore[misc]
        """A KV-cache bug: a decode() call that continues a context drops its first cached token."""

        def decode(self, tokens: Sequence[int], all_logits: bool = False) -> np.ndarray:
            if self.tokens and len(self.tokens) > 1:
                mem = self.lib.llama_get_memory(self.ctx)
                self.lib.llama_memory_seq_rm(mem, 0, 0, 1)
            return super().decode(tokens, all_logits)

    results = run(ForgetsOneToken, smollm2_path, golden, only="batch.*")
    assert failing(results) == {"batch.invariance:mode=odd_chunks", "batch.invariance:mode=token_by_token"}


def test_returning_llama_cpps_logits_buffer_fails_logits_stable(llamacpp_cls, smollm2_path, golden):
    class SharesBuffer(llamacpp_cls):  # type: ignore[misc]
        """Returns llama.cpp's own logits row (llama_get_logits_ith), which the next llama_decode
        overwrites, instead of a copy."""

        def decode(self, tokens: Sequence[int], all_logits: bool = False) -> np.ndarray:
            out = super().decode(tokens, all_logits)
            if all_logits:
                return out
            ptr = self.lib.llama_get_logits_ith(self.ctx, -1)
            return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))

    results = run(SharesBuffer, smollm2_path, golden, only="logits.stable")
    assert failing(results) == {"logits.stable"}
    assert "changed:" in results["logits.stable"].message


def test_silent_truncation_fails_the_overflow_check(llamacpp_cls, smollm2_path, golden):
    class Truncates(llamacpp_cls):  # type: ignore[misc]
        """Keeps the last tokens of an over-long prompt instead of refusing it."""

        def generate(self, request: GenerateRequest) -> Iterator[GenerationEvent]:
            if request.prompt:
                ids = self.tokenize(request.prompt)
                if len(ids) > self.n_ctx() - 16:
                    request = dataclasses.replace(
                        request, prompt=self.detokenize(ids[-(self.n_ctx() - 64) :])
                    )
            return super().generate(request)

    # the over-long prompt is a little longer than the context: a small context keeps it quick
    results = run(Truncates, smollm2_path, golden, only="errors.context_overflow*", ctx_size=256)
    assert failing(results) == {"errors.context_overflow:api=generate"}


def test_max_tokens_off_by_one_and_unvalidated_options_fail(llamacpp_cls, smollm2_path, golden):
    class OneTooMany(llamacpp_cls):  # type: ignore[misc, valid-type]
        """Generates one token more than asked, and silently clamps out-of-range sampling values
        instead of refusing them."""

        def generate(self, request: GenerateRequest) -> Iterator[GenerationEvent]:
            s = request.sampling
            s = dataclasses.replace(
                s,
                top_p=min(max(s.top_p, 0.0), 1.0),
                top_k=max(s.top_k, 0),
                n_predict=s.n_predict + 1 if s.n_predict > 0 else max(s.n_predict, -1),
            )
            return super().generate(dataclasses.replace(request, sampling=s))

    results = run(OneTooMany, smollm2_path, golden, only="*max_tokens*")
    assert failing(results) == {"generation.max_tokens:n=1", "generation.max_tokens:n=7"}
    results = run(OneTooMany, smollm2_path, golden, only="errors.invalid_option*")
    assert failing(results) == {
        "errors.invalid_option:option=top_p",
        "errors.invalid_option:option=top_k",
        "errors.invalid_option:option=n_predict",
    }


def test_ignored_temperature_zero_fails_the_greedy_checks(llamacpp_cls, smollm2_path, golden):
    class SamplesAtTempZero(llamacpp_cls):  # type: ignore[misc]
        """Treats temp 0 as 'use the default sampler' instead of greedy."""

        def generate(self, request: GenerateRequest) -> Iterator[GenerationEvent]:
            s = request.sampling
            if s.temp <= 0:
                s = dataclasses.replace(s, temp=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=-1)
            return super().generate(dataclasses.replace(request, sampling=s))

    results = run(SamplesAtTempZero, smollm2_path, golden, only="generation.greedy.*")
    assert failing(results) >= {
        "generation.greedy.top_k1",
        "generation.greedy.temp0",
        "generation.greedy.logits",
    }


def test_unknown_end_of_generation_tokens_fail_the_eog_check(llamacpp_cls, smollm2_path, golden):
    class NoEog(llamacpp_cls):  # type: ignore[misc]
        """Does not know its end-of-generation tokens: generates through them."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            real = self.lib

            class Lib:
                def __getattr__(self, name: str) -> Any:
                    return getattr(real, name)

                @staticmethod
                def llama_vocab_is_eog(vocab: Any, token: int) -> bool:
                    return False

            self.lib = Lib()

    results = run(NoEog, smollm2_path, golden, only="generation.eog")
    assert failing(results) == {"generation.eog"}


def test_accepting_an_empty_prompt_fails(llamacpp_cls, smollm2_path, golden):
    class AcceptsEmpty(llamacpp_cls):  # type: ignore[misc]
        def generate(self, request: GenerateRequest) -> Iterator[GenerationEvent]:
            if request.prompt == "":
                request = dataclasses.replace(request, prompt=" ")
            return super().generate(request)

    results = run(AcceptsEmpty, smollm2_path, golden, only="errors.empty_prompt")
    assert failing(results) == {"errors.empty_prompt"}


def test_wrong_chat_rendering_and_ignored_seed_fail(llamacpp_cls, smollm2_path, golden):
    class Sloppy(llamacpp_cls):  # type: ignore[misc]
        """Renders the template without trim_blocks (a stray newline) and ignores seeds."""

        def apply_chat_template(
            self, messages: list[dict[str, str]], add_generation_prompt: bool = True
        ) -> str:
            return super().apply_chat_template(messages, add_generation_prompt) + "\n"

        def generate(self, request: GenerateRequest) -> Iterator[GenerationEvent]:
            s = dataclasses.replace(request.sampling, seed=-1)
            return super().generate(dataclasses.replace(request, sampling=s))

    results = run(Sloppy, smollm2_path, golden, only="chat.*")
    assert failing(results) == set(results) and len(results) == 6
    results = run(Sloppy, smollm2_path, golden, only="generation.seed", level="optional")
    assert failing(results) == {"generation.seed"}


def test_undeclared_capabilities_are_not_supported(llamacpp_cls, smollm2_path, golden):
    class NoLogits(llamacpp_cls):  # type: ignore[misc]
        capabilities = frozenset({"stream", "tokenize"})

    # checks that need an undeclared capability never run, so this is quick
    results = {}
    for pattern in (
        "logits.*",
        "batch.*",
        "chat.*",
        "generation.seed",
        "generation.greedy.logits",
        "errors.context_overflow:api=decode",
        "tokenizer.ids:case=plain",
    ):
        results.update(run(NoLogits, smollm2_path, golden, only=pattern, level="all"))
    assert len(results) > 15
    for i, r in results.items():
        assert r.status == ("pass" if i.startswith("tokenizer.") else "not_supported"), (i, r.status)


# --- the command --------------------------------------------------------------------------------
def test_cli_runs_and_writes_the_bundle(llamacpp_cls, smollm2_path, tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "stdengine.cli.main",
            "conformance",
            "-e",
            "llamacpp",
            "-m",
            str(smollm2_path),
            "-c",
            str(N_CTX),
            "-t",
            "1",
            "--only",
            "tokenizer.*",
            "--report",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert "PASS" in r.stdout and "tokenizer" in r.stdout
    for name in ("results.json", "junit.xml", "summary.md", "ENGINE.yaml"):
        assert (tmp_path / name).is_file()
    assert 'engine: "llamacpp"' in (tmp_path / "ENGINE.yaml").read_text()


def test_cli_exits_1_when_a_core_check_fails(llamacpp_cls, smollm2_path):
    """`infer conformance` exits 1 when a core check fails (here: an engine that ignores stop)."""
    from stdengine import registry
    from stdengine.cli.main import main

    class IgnoresStop(llamacpp_cls):  # type: ignore[misc]
        name = "ignores-stop"

        def generate(self, request: GenerateRequest) -> Iterator[GenerationEvent]:
            s = dataclasses.replace(request.sampling, stop=[])
            return super().generate(dataclasses.replace(request, sampling=s))

    registry.register("ignores-stop", IgnoresStop)
    argv = ["conformance", "-e", "ignores-stop", "-m", str(smollm2_path), "-c", str(N_CTX), "-t", "1"]
    try:
        with pytest.raises(SystemExit) as e:
            main([*argv, "--only", "generation.stop*"])
    finally:
        registry.unregister("ignores-stop")
    assert e.value.code == 1
