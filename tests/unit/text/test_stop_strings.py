"""Stop strings over streamed text with hold-back."""

from __future__ import annotations

import random

import pytest

from workers.text.stop_strings import StopStringMatcher


def feed(matcher: StopStringMatcher, pieces: list[str]) -> list[str]:
    return [matcher.push(p) for p in pieces]


def test_stop_spanning_several_pushes_is_found():
    m = StopStringMatcher(("STOP",))
    out = feed(m, ["Hello S", "T", "O", "P and more", " even more"])
    assert m.matched == "STOP"
    assert "".join(out) == "Hello "
    assert m.flush() == ""
    assert m.text == "Hello "


def test_nothing_after_the_stop_is_ever_returned():
    text = "alpha beta <end> gamma delta"
    rng = random.Random(0)
    for _ in range(50):
        # Random split points, including empty pieces.
        cuts = sorted(rng.randint(0, len(text)) for _ in range(rng.randint(1, 12)))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        m = StopStringMatcher(("<end>",))
        returned = ""
        for piece in pieces:
            returned += m.push(piece)
            assert "<end>" not in returned
            assert "gamma" not in returned
            # Everything returned is final: a prefix of the text before the stop.
            assert "alpha beta ".startswith(returned)
        returned += m.flush()
        assert returned == "alpha beta "
        assert m.matched == "<end>"


def test_include_stop_mode_includes_it():
    m = StopStringMatcher(("<end>",), include_stop=True)
    out = feed(m, ["abc <e", "nd", "> tail"])
    assert "".join(out) + m.flush() == "abc <end>"
    assert m.matched == "<end>"


def test_held_back_text_is_released_by_flush():
    m = StopStringMatcher(("</answer>",))
    out = feed(m, ["the answer is 42 </ans"])
    sent = "".join(out)
    # The tail that could start the stop string is held back...
    assert not sent.endswith("</ans")
    assert "the answer is 42 </ans".startswith(sent)
    # ...and released when the request ends without a match.
    rest = m.flush()
    assert sent + rest == "the answer is 42 </ans"
    assert m.matched is None
    assert m.flush() == ""


def test_hold_back_is_bounded_by_longest_stop():
    m = StopStringMatcher(("xyz", "a much longer stop"))
    text = "some streamed text that never stops at all"
    sent = "".join(feed(m, list(text)))
    held = len(text) - len(sent)
    assert held == len("a much longer stop") - 1
    assert sent + m.flush() == text


def test_no_stops_sends_everything_at_once():
    m = StopStringMatcher(())
    assert m.push("abc") == "abc"
    assert m.push("def") == "def"
    m2 = StopStringMatcher(("",))  # empty stop strings are ignored
    assert m2.push("abc") == "abc" and m2.matched is None


@pytest.mark.parametrize(
    "stops,pieces,expected_text,expected_stop",
    [
        (("world", "lo w"), ["hel", "lo wor", "ld"], "hel", "lo w"),
        (("lo w", "world"), ["hello world"], "hel", "lo w"),
        # "abc" starts at 1, before "b" at 2, although "b" completes first.
        (("b", "abc"), ["xa", "bc"], "x", "abc"),
        (("abc", "b"), ["xa", "bc"], "x", "abc"),
        (("b", "abc"), ["xa", "bx"], "xa", "b"),
        (("cd", "bcd"), ["ab", "c", "d"], "a", "bcd"),
    ],
)
def test_earliest_of_several_stops_wins(stops, pieces, expected_text, expected_stop):
    m = StopStringMatcher(stops)
    out = "".join(feed(m, pieces)) + m.flush()
    assert out == expected_text
    assert m.matched == expected_stop


def test_pushes_after_a_match_return_nothing():
    m = StopStringMatcher(("!",))
    assert m.push("hi! there") == "hi"
    assert m.push("more!") == ""
    assert m.flush() == ""


def test_multibyte_stop_string():
    m = StopStringMatcher(("你好",))
    out = feed(m, ["café ", "你", "好 😀"])
    assert "".join(out) + m.flush() == "café "
    assert m.matched == "你好"
