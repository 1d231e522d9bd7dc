"""tools.bench.idle_serve: its variants (the plain server first, every other with the
environment given) and the lines it prints."""

from __future__ import annotations

import pytest

from tools.bench.idle_serve import ALONE, parse_variants, round_line, slowdown_line


def test_the_plain_server_comes_first_and_each_variant_keeps_its_environment():
    variants = parse_variants([["lean", "RAY_event_stats=0", "A=b=c"], ["quiet"]])
    assert list(variants) == ["serve", "lean", "quiet"]
    assert variants["lean"] == {"RAY_event_stats": "0", "A": "b=c"}
    assert variants["serve"] == {} and variants["quiet"] == {}


@pytest.mark.parametrize("pairs", [[["serve", "A=1"]], [[ALONE]], [["x"], ["x", "B=2"]], [["lean", "RAY_event_stats"]]])
def test_a_taken_name_or_a_bare_word_is_refused(pairs):
    with pytest.raises(SystemExit):
        parse_variants(pairs)


def test_the_slowdown_is_each_median_against_alone():
    runs = {ALONE: [40.0, 41.0, 39.0], "serve": [50.0, 44.0, 48.0], "lean": [42.0, 42.0, 41.0]}
    line = slowdown_line(1, runs)
    assert line.startswith("batch=1 ")
    assert "alone   40.0 ms" in line
    assert "serve   48.0 ms (+20.0%)" in line
    assert "lean   42.0 ms (+5.0%)" in line


def test_a_round_line_shows_the_latest_timing_of_each_condition():
    runs = {ALONE: [40.0, 37.5], "serve": [44.4, 45.9]}
    assert round_line(64, runs) == "batch=64  alone   37.5   serve   45.9"
