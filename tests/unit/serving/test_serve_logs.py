"""workers/contract/serve_logs.py: INFO lines of chatserve's own loggers reach the handlers Ray
Serve sets on `ray.serve` in a replica, once, and configured loggers are left alone."""

from __future__ import annotations

import logging

import pytest

from workers.contract.serve_logs import route_to_serve_log


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.name}: {record.getMessage()}")


@pytest.fixture
def serve_handler():
    serve_logger = logging.getLogger("ray.serve")
    saved = serve_logger.handlers[:]
    collect = _Collect()
    serve_logger.handlers = [collect]
    yield collect
    serve_logger.handlers = saved


def _fresh(name: str) -> logging.Logger:
    logger = logging.getLogger(name)
    logger.handlers.clear()
    logger.setLevel(logging.NOTSET)
    logger.propagate = True
    return logger


def test_a_packages_info_lines_go_to_the_serve_log_once(serve_handler):
    parent = _fresh("chatserve_test_pkg")
    assert route_to_serve_log(parent)
    logging.getLogger("chatserve_test_pkg.loader").info("packed %d linear layers", 121)
    logging.getLogger("chatserve_test_pkg.loader").debug("not at INFO")
    assert serve_handler.lines == ["chatserve_test_pkg.loader: packed 121 linear layers"]
    assert not route_to_serve_log(parent)  # a second replica start on the process: no second handler
    logging.getLogger("chatserve_test_pkg").warning("once")
    assert serve_handler.lines[-1] == "chatserve_test_pkg: once" and len(serve_handler.lines) == 2


def test_a_configured_logger_or_no_serve_logging_is_left_alone(serve_handler):
    configured = _fresh("chatserve_test_configured")
    configured.setLevel(logging.WARNING)
    assert not route_to_serve_log(configured) and not configured.handlers
    logging.getLogger("ray.serve").handlers = []
    outside = _fresh("chatserve_test_outside")
    assert not route_to_serve_log(outside) and outside.propagate
