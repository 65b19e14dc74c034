"""The engine registry with test-only engines defined here."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest

from stdengine import registry
from stdengine.adapter import DoneEvent, Engine, EngineInfo, GenerateRequest, GenerationEvent, Timings, Usage
from stdengine.errors import EngineUnavailable, UnsupportedOption, UsageError


class EchoEngine(Engine):
    """A test engine: 'generates' the prompt back."""

    name = "echo"
    capabilities = frozenset({"stream"})
    option_map = {"temp": "ignored by design", "n_predict": "max words"}
    accepted_values = {"n_gpu_layers": (0,)}
    needs_model_file = False

    @classmethod
    def load(cls, options, events):
        return cls()

    def info(self):
        return EngineInfo(name="echo", version="1")

    def tokenize(self, text, add_special=True, parse_special=True):
        return [ord(c) for c in text]

    def detokenize(self, tokens: Sequence[int]) -> str:
        return "".join(map(chr, tokens))

    def decode(self, tokens, all_logits=False):
        raise NotImplementedError

    def reset(self):
        pass

    def generate(self, request: GenerateRequest) -> Iterator[GenerationEvent]:
        yield DoneEvent("stop", Usage(), Timings())


class Unavailable(EchoEngine):
    name = "unavailable"

    @classmethod
    def availability(cls):
        return False, "the 'foo' extra is not installed"


@pytest.fixture
def engines():
    registry.register("echo", EchoEngine)
    registry.register("unavailable", Unavailable)
    registry.register("broken", "no_such_module_xyz:Engine")
    yield
    for name in ("echo", "unavailable", "broken"):
        registry.unregister(name)


def test_builtin_reference_is_registered_by_entry_point():
    assert "reference" in registry.entries()
    assert registry.entries()["reference"].distribution == "stdengine"


def test_describe_reports_each_engine_without_failing(engines):
    rows = {r["name"]: r for r in registry.describe()}
    assert rows["echo"]["available"] and rows["echo"]["capabilities"] == ["stream"]
    assert rows["echo"]["honoured_options"] == ["n_predict", "temp"]
    assert rows["unavailable"]["available"] is False and "foo" in rows["unavailable"]["reason"]
    assert rows["broken"]["available"] is False and "failed to import" in rows["broken"]["reason"]


def test_unknown_engine_suggests_the_closest(engines):
    with pytest.raises(UsageError) as e:
        registry.engine_class("ecko")
    assert "did you mean 'echo'" in (e.value.hint or "")


def test_broken_engine_is_engine_unavailable(engines):
    with pytest.raises(EngineUnavailable, match="failed to import"):
        registry.engine_class("broken")


def test_options_the_engine_cannot_honour_are_refused():
    registry.check_options(EchoEngine, {"temp", "n_predict", "model", "log_format"})
    with pytest.raises(UnsupportedOption) as e:
        registry.check_options(EchoEngine, {"temp", "ctx_size", "top_k"})
    assert "ctx_size, top_k" in e.value.message and "echo" in e.value.message


def test_accepted_values(engines):
    registry.check_options(EchoEngine, {"n_gpu_layers"}, {"n_gpu_layers": 0})
    with pytest.raises(UnsupportedOption, match="n_gpu_layers"):
        registry.check_options(EchoEngine, {"n_gpu_layers"}, {"n_gpu_layers": 10})
