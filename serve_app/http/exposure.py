"""A server that listens beyond loopback with no API key logs a WARNING when its ingress starts.

"Listens beyond loopback" is read from the host Ray Serve's HTTP servers bind: the Serve
config's `http_options.host` (Serve's proxies, HAProxy's frontend and, with direct ingress
or HAProxy, each ingress replica's own port all bind it). 0.0.0.0, ::, a non-loopback
address or a hostname other than localhost count as beyond loopback; no host means Serve
serves no HTTP.
"""

from __future__ import annotations

import ipaddress
import logging

logger = logging.getLogger("chatserve.auth")


def is_loopback_host(host: str) -> bool:
    """127.0.0.0/8, ::1 or localhost: only this machine can connect."""
    host = host.strip().strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # another hostname: it may resolve to any interface


def warn_if_open_without_key(host: str | None, port: int | None, api_keys_on: bool) -> bool:
    """Log a WARNING (and return True) when `host` is beyond loopback and no API key is set."""
    if host is None or api_keys_on or is_loopback_host(host):
        return False
    where = f"{host}:{port}" if port is not None else host
    logger.warning(
        "chatserve listens on %s, beyond loopback, with no API key: anyone who can reach it can use "
        "the models. Set server.api_keys_env or server.api_keys_file, or bind http_options.host: 127.0.0.1.",
        where)
    return True


def serve_http_address() -> tuple[str | None, int | None]:
    """(host, port) of the running Serve instance's HTTP options; (None, None) when there is
    none to ask (not in Ray, no Serve controller). Ray Serve's client of the controller
    (ray.serve.context) reads them once per process and keeps them; a replica's handles
    create and use that same client."""
    import ray

    if not ray.is_initialized():
        return None, None
    from ray.serve.context import _get_global_client

    try:
        client = _get_global_client(raise_if_no_controller_running=False)
    except Exception:  # noqa: BLE001 - a warning's input: never fail the replica for it
        logger.debug("cannot read Serve's HTTP options", exc_info=True)
        return None, None
    if client is None:
        return None, None
    options = client.http_config
    return options.host, options.port
