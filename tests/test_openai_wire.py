"""The OpenAI wire module (stdengine/openai_wire.py) on hand-written protocol text: server-sent
event framing however the bytes are cut, error envelopes of llama-server, OpenAI and others, URL
roots, log-probability entries and the tokenize extensions."""

from __future__ import annotations

import math

import pytest

from stdengine.errors import UsageError
from stdengine.openai_wire import (
    DONE,
    ErrorReply,
    SseDecoder,
    WireError,
    api_base,
    choice_text,
    logprob_entries,
    model_ids,
    parse_chunk,
    root_url,
    sse_events,
    tokenize_body,
    tokens_of,
)

# A stream as llama-server and sse-starlette write it: a comment (keep-alive), CR LF line ends in
# one event, a field the client ignores, two data lines that make one event, and the end.
STREAM = (
    ": ping\n\n"
    'data: {"choices":[{"text":"Hel"}]}\r\n\r\n'
    "id: 7\nevent: message\nretry: 100\n"
    'data:{"choices":[{"text":"lo"}]}\n\n'
    "data: first line\ndata: second line\n\n"
    "data: [DONE]\n\n"
)
EVENTS = ['{"choices":[{"text":"Hel"}]}', '{"choices":[{"text":"lo"}]}', "first line\nsecond line", DONE]


def test_sse_events_in_one_piece():
    assert list(sse_events([STREAM])) == EVENTS


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 16])
def test_sse_events_cut_anywhere(size):
    """Chunks cut at every size: in the middle of a field name, of JSON, between CR and LF."""
    chunks = [STREAM[i : i + size] for i in range(0, len(STREAM), size)]
    assert list(sse_events(chunks)) == EVENTS


def test_sse_cr_lf_split_across_chunks_is_one_line_end():
    decoder = SseDecoder()
    assert decoder.feed("data: a\r") == []
    assert decoder.feed("\n") == []  # the LF completes the CR: not a blank line yet
    assert decoder.feed("\r") == ["a"]  # a lone CR is a line end: the blank line ends the event
    assert decoder.feed("\ndata: b\n\n") == ["b"]


def test_sse_lone_cr_line_ends_and_separator_in_json():
    # U+2028 may stand unescaped in JSON; it is no line end in SSE (str.splitlines would cut there)
    assert list(sse_events(['data: {"t":"a\u2028b"}\r\rdata: x\r\r'])) == ['{"t":"a\u2028b"}', "x"]


def test_sse_an_event_left_open_at_the_end_is_delivered():
    assert list(sse_events(["data: {}\n\ndata: last"])) == ["{}", "last"]
    assert list(sse_events(["data: {}\n\ndata: last\n"])) == ["{}", "last"]
    assert list(sse_events([": only a comment\n"])) == []


def test_llama_server_error_field_becomes_an_error_chunk():
    events = list(sse_events(['error: {"code":500,"message":"out of memory","type":"server_error"}\n\n']))
    assert parse_chunk(events[0]) == {
        "error": {"code": 500, "message": "out of memory", "type": "server_error"}
    }


def test_parse_chunk_refuses_what_is_not_an_object():
    assert parse_chunk('{"choices": []}') == {"choices": []}
    with pytest.raises(WireError, match="malformed stream event"):
        parse_chunk("{not json")
    with pytest.raises(WireError, match="not an object"):
        parse_chunk("[1, 2]")


def test_choice_text_of_each_shape():
    assert choice_text({"delta": {"content": "a"}}) == "a"
    assert choice_text({"delta": {"role": "assistant"}}) == ""  # chat's first chunk
    assert choice_text({"message": {"content": "b"}}) == "b"
    assert choice_text({"text": "c"}) == "c"
    assert choice_text({"finish_reason": "stop"}) == ""


# --- error envelopes ----------------------------------------------------------------------------
def test_llama_server_envelope():
    body = (
        b'{"error":{"code":400,"message":"request (300 tokens) exceeds the available context size (128 tokens)",'
        b'"type":"exceed_context_size_error","n_prompt_tokens":300,"n_ctx":128}}'
    )
    e = ErrorReply.of(400, body)
    assert (e.status, e.type, e.code) == (400, "exceed_context_size_error", 400)
    assert e.context_overflow and e.openai_shape
    assert e.details == {"n_prompt_tokens": 300, "n_ctx": 128}


def test_openai_envelope():
    body = {
        "error": {
            "message": "This model's maximum context length is 4097 tokens.",
            "type": "invalid_request_error",
            "param": "messages",
            "code": "context_length_exceeded",
        }
    }
    e = ErrorReply.of(400, body)
    assert e.openai_shape and e.context_overflow and e.code == "context_length_exceeded"
    assert e.message.startswith("This model's maximum context length")
    auth = ErrorReply.of(401, b'{"error":{"message":"Invalid API key","type":"invalid_request_error"}}')
    assert auth.status == 401 and not auth.context_overflow


def test_an_error_inside_a_stream_takes_its_status_from_the_code():
    assert (
        ErrorReply.of(500, {"error": {"code": 503, "message": "loading", "type": "unavailable_error"}}).status
        == 503
    )
    assert ErrorReply.of(500, {"error": {"code": "oops", "message": "m", "type": "t"}}).status == 500


def test_other_envelopes_are_read_but_not_openai_shaped():
    detail = ErrorReply.of(422, b'{"detail": [{"loc": ["body"], "msg": "field required"}]}')
    assert "field required" in detail.message and not detail.openai_shape
    bare = ErrorReply.of(400, {"error": "bad"})
    assert bare.message == "bad" and not bare.openai_shape
    text = ErrorReply.of(502, b"  Bad Gateway\n")
    assert text.message == "Bad Gateway" and not text.openai_shape
    no_type = ErrorReply.of(400, b'{"error": {"message": "m"}}')
    assert no_type.message == "m" and not no_type.openai_shape


# --- URL roots ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "url",
    ["http://h:8080", "http://h:8080/", "http://h:8080/v1", "http://h:8080/v1/", " http://h:8080/v1 "],
)
def test_root_url_with_or_without_v1(url):
    assert root_url(url) == "http://h:8080"
    assert api_base(url) == "http://h:8080/v1"


def test_root_url_keeps_a_prefix_and_refuses_other_schemes():
    assert root_url("https://proxy.example/llm/v1") == "https://proxy.example/llm"
    assert root_url("http://h/v10") == "http://h/v10"  # only a whole /v1 segment is the API base
    with pytest.raises(UsageError, match="must start with http"):
        root_url("h:8080")


def test_model_ids():
    assert model_ids({"object": "list", "data": [{"id": "a"}, {"id": "b"}, "junk"]}) == ["a", "b"]
    assert model_ids({"data": None}) == [] and model_ids([]) == []


# --- log-probabilities --------------------------------------------------------------------------------
def test_completions_logprobs_shape():
    lp = {
        "tokens": ["Hello", " world"],
        "token_logprobs": [None, -0.5],
        "top_logprobs": [None, {" world": -0.5, " there": -1.25}],
    }
    (first, top0), (second, top1) = logprob_entries(lp)
    assert first.token == "Hello" and math.isnan(first.logprob) and top0 == []
    assert (second.token, second.logprob, second.id) == (" world", -0.5, -1)
    assert [(t.token, t.logprob) for t in top1] == [(" world", -0.5), (" there", -1.25)]


def test_chat_logprobs_shape_with_ids_and_bytes():
    lp = {
        "content": [
            {
                "id": 42,
                "token": "\ufffd",
                "logprob": -0.1,
                "bytes": [0xE2],
                "top_logprobs": [{"id": 42, "token": "\ufffd", "logprob": -0.1, "bytes": [0xE2]}],
            }
        ]
    }
    [(tok, top)] = logprob_entries(lp)
    assert (tok.id, tok.piece, tok.logprob) == (42, b"\xe2", -0.1) and top[0].id == 42


def test_logprobs_absent_or_in_an_unknown_shape():
    assert logprob_entries(None) == [] and logprob_entries({}) == []
    with pytest.raises(WireError, match="unknown shape"):
        logprob_entries({"tokens": ["a", "b"], "token_logprobs": [-1.0], "top_logprobs": [None]})
    with pytest.raises(WireError, match="unknown shape"):
        logprob_entries({"content": [{"logprob": -1.0}]})


# --- tokenize extensions --------------------------------------------------------------------------------
def test_tokenize_bodies_and_answers():
    assert tokenize_body("/tokenize", "hi", add_special=False) == {
        "content": "hi",
        "add_special": False,
        "parse_special": True,
    }
    assert tokenize_body("/extras/tokenize", "hi", model="m") == {"input": "hi", "model": "m"}
    assert tokens_of({"tokens": [1, 2]}) == [1, 2]
    assert tokens_of({"tokens": [{"id": 1, "piece": "a"}]}) == [1]  # with_pieces
    assert tokens_of({"error": {}}) is None and tokens_of([1]) is None
