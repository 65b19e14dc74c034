"""The core's streaming helpers that every in-process engine uses: stop strings and UTF-8."""

from __future__ import annotations

import random

from stdengine.generation import StopMatcher, Utf8Stream


def stream_stops(stops: list[str], pieces: list[str]) -> tuple[str, str | None, list[str]]:
    """Feed pieces as a generation loop does; returns (all text emitted, the stop, the emissions)."""
    m = StopMatcher(stops)
    emitted: list[str] = []
    for piece in pieces:
        out, hit = m.feed(piece)
        emitted.append(out)
        if hit is not None:
            return "".join(emitted), hit, emitted
    emitted.append(m.flush())
    return "".join(emitted), None, emitted


def test_stop_string_across_pieces_is_cut_and_never_emitted():
    text, hit, emitted = stream_stops(["\nUser:"], ["Hello", " there\n", "Us", "er:", " more"])
    assert (text, hit) == ("Hello there", "\nUser:")
    assert not any("\n" in e for e in emitted)  # the held-back start of the stop never got out


def test_text_that_only_looks_like_a_stop_is_released():
    text, hit, emitted = stream_stops(["STOP"], ["a ST", "OR", "Y of STO"])
    assert (text, hit) == ("a STORY of STO", None)  # the tail is released at the end
    assert emitted[0] == "a " and emitted[1] == "STOR"  # held only as long as it could be a stop


def test_the_earliest_of_several_stops_wins():
    assert stream_stops(["bb", "a"], ["xbbya"])[:2] == ("x", "bb")
    assert stream_stops(["b", "xb"], ["ax", "b"])[:2] == ("a", "xb")
    assert stream_stops([""], ["nothing stops"])[:2] == ("nothing stops", None)  # empty stops ignored


def test_stops_in_random_splits_give_the_same_result():
    rng = random.Random(5)
    whole = "The answer is 42.\n\nQuestion: what next?"
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(whole)), rng.randint(0, 10)))
        pieces = [whole[i:j] for i, j in zip([0, *cuts], [*cuts, len(whole)], strict=True)]
        assert stream_stops(["\n\nQuestion:", "never"], pieces)[:2] == ("The answer is 42.", "\n\nQuestion:")


def test_utf8_sequences_split_across_tokens_are_held_until_complete():
    s = Utf8Stream()
    text = "naïve 日本 🎉!"
    data = text.encode()
    out = [s.feed(data[i : i + 1]) for i in range(len(data))]  # one byte per token, as byte fallback does
    assert "".join(out) + s.flush() == text
    assert all("\ufffd" not in o for o in out)
    # the emoji's 4 bytes: nothing until the last one
    start = len("naïve 日本 ".encode())
    assert out[start : start + 3] == ["", "", ""] and out[start + 3] == "🎉"


def test_invalid_bytes_become_replacement_characters_not_errors():
    s = Utf8Stream()
    out = s.feed(b"ok\xff\xfe") + s.feed(b"x")  # up to 4 bytes are held, in case they complete
    assert out.startswith("ok") and out + s.flush() == "ok\ufffd\ufffdx"
    assert s.feed(b"\xff" * 6) == "\ufffd" * 6  # more than a sequence's length: out at once
    assert s.feed(b"\xe6\x97") == ""  # a valid start, held
    assert s.flush() == "\ufffd"  # never completed: replaced at the end


def test_a_stop_may_begin_before_min_tokens_and_end_after():
    """The first pieces (min_tokens of them) cannot end a stop string, but one they begin and a
    later piece ends is found, and cut; one wholly inside them is text like any other."""
    m = StopMatcher(["END", "x"])
    assert m.feed("a EN", may_stop=False) == ("a ", None)  # "EN" may still become "END": held
    assert m.feed("D more") == ("", "END")  # ends after the boundary: found, nothing after it
    m = StopMatcher(["END"])
    assert m.feed("an END and E", may_stop=False) == ("an END and ", None)  # inside: no stop
    assert m.feed("ND!") == ("", "END")
    m = StopMatcher(["ab", "a"])  # "a" ends inside the protected text, "ab" past it
    assert m.feed("xa", may_stop=False) == ("x", None)
    assert m.feed("b") == ("", "ab")
    m = StopMatcher(["ab", "a"])
    assert m.feed("xa", may_stop=False) == ("x", None)
    assert m.feed("c") == ("ac", None)  # the held "a" was a whole stop, but before the boundary
    assert m.feed("a") == ("", "a")
