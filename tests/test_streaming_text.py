"""Streamed text is whole UTF-8, for every in-process engine: a continuation of emoji, whose
4-byte characters are split across tokens, never shows U+FFFD and adds up to the detokenized ids."""

from __future__ import annotations

import io

import pytest

from stdengine.adapter import DoneEvent, GenerateRequest, SamplingParams, TokenEvent
from stdengine.events import Emitter
from stdengine.options import Options
from stdengine.registry import engine_class

pytestmark = pytest.mark.models


@pytest.mark.parametrize("engine", ["reference", pytest.param("llamacpp", marks=pytest.mark.llamacpp)])
def test_split_characters_are_held_until_complete(engine, smollm2_path):
    cls = engine_class(engine)
    ok, why = cls.availability()
    assert ok, why
    e = cls.load(
        Options(model=str(smollm2_path), engine=engine, ctx_size=256, threads=2),
        Emitter(stream=io.StringIO()),
    )
    request = GenerateRequest(
        prompt="Emoji party: 🎉🎉🎉 🎂🎂", sampling=SamplingParams(temp=0, n_predict=24)
    )
    events = list(e.generate(request))
    assert isinstance(events[-1], DoneEvent)
    tokens = [ev for ev in events if isinstance(ev, TokenEvent)]
    assert sum(1 for ev in tokens if ev.text == "") >= 4  # bytes were held: the case is exercised
    text = "".join(ev.text for ev in tokens)
    assert "\ufffd" not in text and "🎂" in text
    assert text == e.detokenize([ev.id for ev in tokens if ev.id >= 0])
