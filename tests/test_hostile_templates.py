"""Hostile chat templates (issue 18 item 1): rendering is bounded in steps, time, string size and
recursion, and ends in a clear error — bad_model_file (exit 4) for the model file's template,
invalid_request (exit 2) for one given by the user — instead of hanging or eating memory."""

from __future__ import annotations

import threading

import pytest

from stdengine.errors import BadModelFile, InvalidRequest
from stdengine.generation import (
    BUILTIN_TEMPLATES,
    ModelTemplate,
    choose_chat_template,
    render_chat_template,
)

MESSAGES = [{"role": "user", "content": "hi"}]

HOSTILE = {
    "nested range loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "nested list loops": "{% for x in [0] * 100000 %}{% for y in [0] * 100000 %}{% endfor %}{% endfor %}",
    "string repetition": "{{ 'x' * 2**31 }}",
    "repetition through a variable": "{% set n = 2**31 %}{{ 'x' * n }}",
    "huge power": "{{ 10 ** 100000000 }}",
    "doubling with ~": "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
    "{% endfor %}{{ ns.s }}",
    "doubling with +": "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}"
    "{% endfor %}{{ ns.s }}",
    "recursive macro": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "macro fan-out": "{% macro f(n) %}{% if n < 40 %}{{ f(n + 1) }}{{ f(n + 1) }}{% endif %}{% endmacro %}{{ f(0) }}",
    "center filter width": "{{ 'x' | center(2**31) }}",
    "ljust width": "{{ 'x'.ljust(3000000000) }}",
    "join of big strings": "{{ (['x' * 1000000] * 1000) | join }}",
    "replace amplifies": "{% set s = 'a' * 1000000 %}{{ s.replace('a', s) }}",
    "percent-format width": "{{ '%2000000000d' % 1 }}",
    "indent amplifies": "{% set s = '\\n' * 1000000 %}{{ s | indent(1000) }}",
    "output too long": "{% for i in range(100000) %}{{ 'y' * 100 }}{% endfor %}",
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_template_from_the_model_is_bad_model_file(name: str) -> None:
    with pytest.raises(BadModelFile, match="the model's chat template") as err:
        render_chat_template(ModelTemplate(HOSTILE[name]), MESSAGES)
    assert err.value.exit_status == 4


@pytest.mark.parametrize("name", ["nested range loops", "string repetition", "recursive macro"])
def test_hostile_template_given_by_the_user_is_invalid_request(name: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        render_chat_template(HOSTILE[name], MESSAGES)
    assert err.value.exit_status == 2


def test_the_file_template_is_marked_and_others_are_not() -> None:
    template, source = choose_chat_template(None, {"tokenizer.chat_template": "{{ messages }}"})
    assert isinstance(template, ModelTemplate) and source == "model file"
    given, _ = choose_chat_template("{{ messages }}", {"tokenizer.chat_template": "x"})
    assert not isinstance(given, ModelTemplate)


def test_syntax_error_in_the_model_template_is_bad_model_file() -> None:
    with pytest.raises(BadModelFile, match="not valid Jinja"):
        render_chat_template(ModelTemplate("{% for %}"), MESSAGES)


def test_a_refusal_stays_invalid_request() -> None:
    """raise_exception is the template judging the conversation, not a broken template."""
    with pytest.raises(InvalidRequest, match="refused the conversation: no"):
        render_chat_template(ModelTemplate("{{ raise_exception('no') }}"), MESSAGES)


def test_cancel_stops_rendering() -> None:
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(BadModelFile, match="cancelled"):
        render_chat_template(ModelTemplate(HOSTILE["nested range loops"]), MESSAGES, cancel=cancel)


def test_ordinary_templates_and_long_conversations_still_render() -> None:
    """The limits scale with the input: a 2 MB conversation renders through a loop over it."""
    long = [{"role": "user", "content": "word " * 400_000}, {"role": "assistant", "content": "ok"}]
    text = render_chat_template(ModelTemplate(BUILTIN_TEMPLATES["chatml"]), long)
    assert text.startswith("<|im_start|>user\nword word") and text.endswith("<|im_start|>assistant\n")
    many = [{"role": "user", "content": str(i)} for i in range(20_000)]
    assert render_chat_template(BUILTIN_TEMPLATES["chatml"], many).count("<|im_end|>") == 20_000
    # short messages: their markers weigh more than their text (28 characters each in chatml)
    empty = [{"role": "user", "content": ""}] * 40_000
    assert (
        render_chat_template(ModelTemplate(BUILTIN_TEMPLATES["chatml"]), empty).count("<|im_end|>") == 40_000
    )
    assert render_chat_template("{{ 'ab' * 3 }}{{ ['a', 'b'] | join('-') }}", MESSAGES) == "abababa-b"
