"""Log lines of chatserve's own modules in a Serve replica's log file.

Ray Serve configures only its `ray.serve` logger in a replica (file handler, replica
tags); a Ray worker's root logger is at WARNING with no handler, so an INFO line from any
other logger goes nowhere: the worker's "model ready" line (dtype, packing, fusion) and
the loader's packing probe among them.
"""

from __future__ import annotations

import logging


def route_to_serve_log(logger: logging.Logger) -> bool:
    """Send `logger`'s records, INFO and up, through the `ray.serve` handlers. Left alone
    (False) when it was configured already (a level or a handler of its own) or when no
    Serve logging is set up (not in a replica)."""
    if logger.handlers or logger.level != logging.NOTSET:
        return False
    handlers = logging.getLogger("ray.serve").handlers
    if not handlers:
        return False
    for handler in handlers:
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False  # the Serve handlers already write it once
    return True
