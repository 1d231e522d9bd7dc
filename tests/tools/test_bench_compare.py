"""tools.bench.compare starts the Serve path the way `make serve` does."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from tools.bench.compare import (
    DEFAULT_EDGE,
    EDGES,
    SERVE_ENV,
    SERVE_PORT,
    serve_environment,
)

MAKEFILE = Path(__file__).resolve().parents[2] / "Makefile"


def makefile_serve_env() -> dict[str, str]:
    text = MAKEFILE.read_text().replace("\\\n", " ")
    words = shlex.split(re.search(r"^SERVE_ENV := (.*)$", text, re.M).group(1))
    return dict(word.split("=", 1) for word in words)


def test_the_benchmark_starts_serve_with_make_serves_environment():
    edge_env, _ = EDGES[DEFAULT_EDGE]
    assert makefile_serve_env() == {**SERVE_ENV, **edge_env}


def test_make_serve_uses_that_environment():
    assert re.search(r"^serve: .*\n\t\$\(SERVE_ENV\) \$\(BIN\)/serve run", MAKEFILE.read_text(), re.M)


def test_make_serves_start_and_the_plain_one():
    env, port = serve_environment(DEFAULT_EDGE)
    assert env == makefile_serve_env() and port == SERVE_PORT
    assert serve_environment(DEFAULT_EDGE, plain=True) == ({}, SERVE_PORT)  # as typed by hand: Serve's proxy
