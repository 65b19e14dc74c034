"""Sampling is declared once, by the Options fields: SamplingParams, validate_sampling and the
request-name table derive from them (issue 17)."""

from __future__ import annotations

import dataclasses

import pydantic
import pytest

from stdengine.adapter import SamplingParams
from stdengine.errors import InvalidRequest
from stdengine.generation import validate_sampling
from stdengine.options import ALIASES, SAMPLING, SAMPLING_REQUEST_NAMES, Options


def test_sampling_params_are_the_sampling_options_with_their_defaults():
    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    assert fields == set(SAMPLING)
    defaults = Options()
    params = SamplingParams()
    for name in fields:
        assert getattr(params, name) == getattr(defaults, name), name
    # the list default is not shared between instances
    params.stop.append("x")
    assert SamplingParams().stop == []


def test_from_options_copies_every_sampling_option():
    options = Options(
        temp=0.0, top_k=3, top_p=0.5, min_p=0.1, repeat_penalty=1.1, repeat_last_n=8, seed=7, n_predict=5
    )
    options.stop = ["a", "b"]
    options.presence_penalty = 0.25
    options.frequency_penalty = -0.5
    s = SamplingParams.from_options(options)
    assert dataclasses.asdict(s) == {name: getattr(options, name) for name in SAMPLING}
    s.stop.append("c")
    assert options.stop == ["a", "b"]  # a copy, not the options' own list


# values outside the ranges that spec/options.md gives each option
OUT_OF_RANGE = [
    ("temp", -0.1),
    ("top_k", -1),
    ("top_k", 2**31),  # past the C sampler's int32 field, which would wrap it
    ("top_p", 1.5),
    ("top_p", -0.01),
    ("min_p", 2.0),
    ("repeat_penalty", -1.0),
    ("repeat_last_n", -2),
    ("n_predict", -2),
    ("seed", -2),  # only -1 means random
    ("seed", 2**63),  # past the C sampler's int64 field
]


@pytest.mark.parametrize(("name", "value"), OUT_OF_RANGE)
def test_validate_sampling_refuses_what_the_option_refuses(name, value):
    with pytest.raises(InvalidRequest, match=f"{name}={value}"):
        validate_sampling(dataclasses.replace(SamplingParams(), **{name: value}))
    with pytest.raises(pydantic.ValidationError):
        Options(**{name: value})


def test_validate_sampling_checks_every_declared_range():
    declared = {o.name for o in SAMPLING.values() if o.ge is not None or o.le is not None}
    assert declared == {name for name, _ in OUT_OF_RANGE}
    for o in SAMPLING.values():
        if o.ge is not None:
            validate_sampling(dataclasses.replace(SamplingParams(), **{o.name: o.ge}))  # the bound is in
        if o.le is not None:
            validate_sampling(dataclasses.replace(SamplingParams(), **{o.name: o.le}))


def test_stop_must_be_strings():
    with pytest.raises(InvalidRequest, match="stop"):
        validate_sampling(SamplingParams(stop=["ok", 3]))  # type: ignore[list-item]


def test_request_names():
    # OpenAI's names for llama.cpp's options
    assert SAMPLING_REQUEST_NAMES["temperature"] == "temp"
    assert SAMPLING_REQUEST_NAMES["max_tokens"] == "n_predict"
    assert SAMPLING_REQUEST_NAMES["max_completion_tokens"] == "n_predict"
    assert SAMPLING_REQUEST_NAMES["seed"] == "seed"
    # every request name that differs from the option's is a known alias (suggested in errors)
    for request, name in SAMPLING_REQUEST_NAMES.items():
        assert request == name or ALIASES[request] == name
    # OpenAI bounds the penalties to [-2, 2]; the options themselves are unbounded
    pp = SAMPLING["presence_penalty"]
    assert (pp.ge, pp.le, pp.request_ge, pp.request_le) == (None, None, -2.0, 2.0)
    assert (SAMPLING["top_p"].request_ge, SAMPLING["top_p"].request_le) == (0.0, 1.0)
