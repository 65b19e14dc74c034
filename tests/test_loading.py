"""registry.load() is the one way an engine is loaded: every verb, infer-bench, conformance and
the server go through it, and the model reference is resolved once (issue 17)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest
from gguf_factory import write_llama_gguf

from stdengine import registry, store
from stdengine.adapter import (
    DoneEvent,
    Engine,
    EngineInfo,
    GenerateRequest,
    GenerationEvent,
    Timings,
    TokenEvent,
    Usage,
)
from stdengine.cli.main import main as infer
from stdengine.events import Emitter
from stdengine.options import Options

N_VOCAB = 16


class FileEngine(Engine):
    """Loads a model file (it only remembers the options it was given); says "hi"."""

    name = "fileeng"
    capabilities = frozenset({"stream", "logits", "tokenize"})
    option_map = {"ctx_size": "n_ctx", "temp": "temp", "n_predict": "n_predict", "batch_size": "n_batch"}
    loaded_with: list[Options] = []

    @classmethod
    def load(cls, options, events):
        cls.loaded_with.append(options)
        return cls()

    def info(self):
        return EngineInfo(name=self.name, version="1", model={"n_vocab": N_VOCAB})

    def tokenize(self, text, add_special=True, parse_special=True):
        return [1] + [ord(c) % N_VOCAB for c in text]

    def detokenize(self, tokens: Sequence[int]) -> str:
        return "".join(chr(97 + t) for t in tokens)

    def decode(self, tokens, all_logits=False):
        return np.zeros((len(tokens), N_VOCAB) if all_logits else N_VOCAB, dtype=np.float32)

    def reset(self):
        pass

    def n_ctx(self):
        return 64

    def generate(self, request: GenerateRequest) -> Iterator[GenerationEvent]:
        yield TokenEvent(7, "hi")
        yield DoneEvent("stop", Usage(1, 1), Timings(1, 1.0, 1, 1.0))


class RemoteEngine(FileEngine):
    name = "remoteeng"
    needs_model_file = False


@pytest.fixture
def engines(tmp_path, monkeypatch):
    registry.register("fileeng", FileEngine)
    registry.register("remoteeng", RemoteEngine)
    FileEngine.loaded_with = []
    resolves: list[str] = []
    real = store.resolve_model

    def counting(ref, **kw):
        resolves.append(str(ref))
        return real(ref, **kw)

    monkeypatch.setattr(store, "resolve_model", counting)
    loads: list[str] = []
    real_load = registry.load

    def spy(options, events, explicitly_set=()):
        loads.append(options.engine)
        return real_load(options, events, explicitly_set)

    monkeypatch.setattr(registry, "load", spy)
    model = tmp_path / "tiny.gguf"
    write_llama_gguf(model)
    yield model, resolves, loads
    registry.unregister("fileeng")
    registry.unregister("remoteeng")


def run(argv: list[str]) -> int:
    with pytest.raises(SystemExit) as e:
        infer(argv)
    return int(e.value.code or 0)


def test_load_resolves_the_model_and_says_what_it_loaded(engines):
    model, resolves, _ = engines
    events = Emitter(stream=None)
    loaded = registry.load(Options(engine="fileeng", model=str(model)), events)
    assert isinstance(loaded.engine, FileEngine)
    assert loaded.model_path == model and loaded.model_ref == str(model)
    assert loaded.options.model == str(model) == FileEngine.loaded_with[-1].model
    assert resolves == [str(model)]
    assert (events.engine, events.model) == ("fileeng", str(model))  # the log lines' labels


def test_an_engine_without_a_model_file_resolves_nothing(engines):
    _, resolves, _ = engines
    loaded = registry.load(Options(engine="remoteeng", url="http://x"), Emitter(stream=None))
    assert loaded.model_path is None and loaded.model_ref == "http://x" and resolves == []
    loaded = registry.load(Options(engine="remoteeng", model="served"), Emitter(stream=None))
    assert loaded.model_ref == "served"


def test_load_refuses_what_the_user_set_and_the_engine_cannot_honour(engines):
    from stdengine.errors import UnsupportedOption

    model, _, _ = engines
    options = Options(engine="fileeng", model=str(model), top_k=3)
    registry.load(options, Emitter(stream=None))  # top_k at a value nobody set: not checked
    with pytest.raises(UnsupportedOption, match="top_k"):
        registry.load(options, Emitter(stream=None), {"top_k"})


def test_run_loads_through_the_registry(engines, capsys):
    model, resolves, loads = engines
    assert run(["run", "-e", "fileeng", "-m", str(model), "-p", "x", "--raw"]) == 0
    assert capsys.readouterr().out.startswith("hi")
    assert loads == ["fileeng"] and resolves == [str(model)]


def test_conformance_resolves_the_model_once(engines, capsys):
    model, resolves, loads = engines
    assert run(["conformance", "-e", "fileeng", "-m", str(model), "--list"]) == 0
    assert "tokenizer" in capsys.readouterr().out
    assert loads == ["fileeng"] and resolves == [str(model)]


def test_serve_resolves_the_model_once_and_serves_the_loaded_path(engines, monkeypatch):
    pytest.importorskip("fastapi")
    from stdengine.server import app

    model, resolves, loads = engines
    served = []
    monkeypatch.setattr(app, "run_server", lambda state, *a, **kw: served.append(state))
    assert run(["serve", "-e", "fileeng", "-m", str(model), "--port", "0"]) == 0
    assert loads == ["fileeng"] and resolves == [str(model)]
    assert served[0].model_path == str(model) and served[0].model_id == str(model)


def test_bench_loads_through_the_registry(engines, capsys):
    model, resolves, loads = engines
    from stdengine.cli.bench import main as bench

    with pytest.raises(SystemExit) as e:
        bench(["-m", str(model), "-e", "fileeng", "-p", "4", "-n", "0", "-r", "1", "-o", "jsonl"])
    assert e.value.code == 0
    assert '"n_prompt": 4' in capsys.readouterr().out
    assert loads == ["fileeng"]
    assert Path(FileEngine.loaded_with[-1].model or "") == model


# --- infer bench is infer-bench ------------------------------------------------------------

TIMED = {"test_time", "samples_ns", "samples_ts", "avg_ns", "stddev_ns", "avg_ts", "stddev_ts"}


def _exit_code(f, argv: list[str]) -> int:
    with pytest.raises(SystemExit) as e:
        f(argv)
    return int(e.value.code or 0)


def test_infer_bench_is_infer_bench(engines, capsys):
    """`infer bench ARGS` and `infer-bench ARGS` are one function: the same records (but for the
    timings), the same usage text, the same errors."""
    import json

    from stdengine.cli.bench import main as infer_bench

    model, _, _ = engines
    argv = ["-m", str(model), "-e", "fileeng", "-p", "4,8", "-n", "2", "-r", "2", "-o", "jsonl"]
    outputs = []
    for f, args in ((infer, ["bench", *argv]), (infer_bench, argv)):
        assert _exit_code(f, args) == 0
        out = capsys.readouterr().out
        outputs.append([{k: v for k, v in json.loads(x).items() if k not in TIMED} for x in out.splitlines()])
    assert outputs[0] == outputs[1] and len(outputs[0]) == 3
    for args in (["-h"], ["-p", "8-4"], ["compare", "--reps", "3"]):
        codes, texts = [], []
        for f, a in ((infer, ["bench", *args]), (infer_bench, args)):
            codes.append(_exit_code(f, a))
            texts.append(capsys.readouterr())
        assert codes[0] == codes[1] and texts[0] == texts[1], args
    pyproject = (Path(__file__).parent.parent / "pyproject.toml").read_text()
    assert 'infer-bench = "stdengine.cli.bench:main"' in pyproject


@pytest.mark.parametrize("args", [[], ["--reps", "3"], ["--out", "x", "--models", "y"]])
def test_bench_compare_without_results_files_points_to_vs_llamacpp(args, capsys):
    assert run(["bench", "compare", *args]) == 1
    err = capsys.readouterr().err
    assert "error: " in err and "hint: " in err and "infer bench vs-llamacpp" in err


def test_bench_compare_of_two_files_gives_no_such_hint(tmp_path, capsys):
    assert run(["bench", "compare", str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")]) == 1
    assert "vs-llamacpp" not in capsys.readouterr().err
