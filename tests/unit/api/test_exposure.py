"""A server listening beyond loopback with no API key warns at start (serve_app/http/exposure.py),
decided from a tiny Serve config's http_options.host and its server.api_keys_*; no Ray."""

from __future__ import annotations

import logging

import pytest

from serve_app.config.app_config import parse_app_config
from serve_app.http.auth import APIKeyAuth
from serve_app.http.exposure import (
    is_loopback_host,
    serve_http_address,
    warn_if_open_without_key,
)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Ray's pydantic v1-style fields

KEYS_ENV = "CHATSERVE_EXPOSURE_TEST_KEYS"


def tiny_config(host: str, server: dict | None = None) -> dict:
    """A `serve run` config as configs/*.yaml write it, cut to what the check reads."""
    args = {"models": [{"id": "tiny", "source": "/models/tiny"}], "server": server or {}}
    return {"http_options": {"host": host, "port": 8000},
            "applications": [{"name": "chatserve", "import_path": "serve_app.app:build_app", "args": args}]}


def start_warnings(config: dict, environ: dict[str, str], caplog) -> list[str]:
    """What the ingress logs at WARNING when it starts under `config`."""
    app = parse_app_config(config["applications"][0]["args"])
    auth = APIKeyAuth.from_options(app.server, environ=environ)
    http = config["http_options"]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="chatserve.auth"):
        warn_if_open_without_key(http["host"], http["port"], auth.enabled)
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_all_interfaces_without_a_key_warns(caplog):
    (message,) = start_warnings(tiny_config("0.0.0.0"), {}, caplog)
    assert "0.0.0.0:8000" in message and "no API key" in message
    assert "server.api_keys_env" in message and "127.0.0.1" in message


@pytest.mark.parametrize("host", ["::", "10.1.2.3", "chatserve.example.com"])
def test_other_hosts_beyond_loopback_without_a_key_warn(host, caplog):
    assert len(start_warnings(tiny_config(host), {}, caplog)) == 1


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1", "[::1]", "127.0.0.2"])
def test_loopback_without_a_key_does_not_warn(host, caplog):
    assert start_warnings(tiny_config(host), {}, caplog) == []


def test_all_interfaces_with_a_key_does_not_warn(caplog, tmp_path):
    with_env = tiny_config("0.0.0.0", {"api_keys_env": KEYS_ENV})
    assert start_warnings(with_env, {KEYS_ENV: "sk-exposure-1"}, caplog) == []
    key_file = tmp_path / "keys"
    key_file.write_text("sk-exposure-2\n")
    with_file = tiny_config("0.0.0.0", {"api_keys_file": str(key_file)})
    assert start_warnings(with_file, {}, caplog) == []


def test_no_host_means_no_http_and_no_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="chatserve.auth"):
        assert warn_if_open_without_key(None, None, False) is False
    assert caplog.records == []


def test_loopback_hosts():
    assert is_loopback_host("127.0.0.1") and is_loopback_host("LOCALHOST") and is_loopback_host("::1")
    assert not is_loopback_host("0.0.0.0") and not is_loopback_host("::") and not is_loopback_host("192.168.0.1")


def test_serve_http_address_reads_the_serve_clients_http_options(monkeypatch):
    import ray
    import ray.serve.context
    from ray.serve.config import HTTPOptions

    class Client:
        http_config = HTTPOptions(host="0.0.0.0", port=8123)

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray.serve.context, "_get_global_client", lambda raise_if_no_controller_running: Client())
    assert serve_http_address() == ("0.0.0.0", 8123)
    monkeypatch.setattr(ray.serve.context, "_get_global_client", lambda raise_if_no_controller_running: None)
    assert serve_http_address() == (None, None)


def test_serve_http_address_starts_no_ray(monkeypatch):
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    assert serve_http_address() == (None, None)
