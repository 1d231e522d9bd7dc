"""The ingress's image source rules (serve_app/media/images.py), no Ray: local paths under the
media directory only, data: URIs, and remote fetches from public addresses only, with
byte and time caps, against a loopback HTTP server started here."""

from __future__ import annotations

import asyncio
import base64
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pydantic
import pytest

from serve_app.config.app_config import MediaOptions
from serve_app.http.errors import APIError
from serve_app.media.images import MediaResolver
from tests.support.tiny_vlm import png_bytes

PNG = png_bytes((10, 200, 10))
PARAM = "messages.0.content.1.image_url"


def load(resolver: MediaResolver, url: str) -> bytes:
    return asyncio.run(resolver.load(url, PARAM))


def refused(resolver: MediaResolver, url: str) -> str:
    with pytest.raises(APIError) as err:
        load(resolver, url)
    assert err.value.status == 400 and err.value.param == PARAM
    return err.value.message


# --- local paths --------------------------------------------------------------------


@pytest.fixture
def media(tmp_path):
    root = tmp_path / "media"
    (root / "sub").mkdir(parents=True)
    (root / "ok.png").write_bytes(PNG)
    (root / "sub" / "deep.png").write_bytes(PNG)
    (tmp_path / "secret.png").write_bytes(b"outside")
    os.symlink(tmp_path / "secret.png", root / "escape.png")
    os.symlink(root / "ok.png", root / "alias.png")
    return root


def test_paths_inside_the_media_directory_are_read(media):
    resolver = MediaResolver(MediaOptions(directory=str(media)))
    assert load(resolver, "ok.png") == PNG
    assert load(resolver, "sub/deep.png") == PNG
    assert load(resolver, str(media / "ok.png")) == PNG  # absolute, as seed 001 sends it
    assert load(resolver, "sub/../ok.png") == PNG  # `..` that stays inside
    assert load(resolver, "alias.png") == PNG  # a symlink that stays inside


@pytest.mark.parametrize("value, why", [
    ("../secret.png", "outside"),
    ("sub/../../secret.png", "outside"),
    ("escape.png", "outside"),  # a symlink out of the directory
    ("/etc/passwd", "outside"),
    ("missing.png", "no such file"),
    ("sub", "not a regular file"),
    ("bad\x00name.png", "not valid"),
])
def test_paths_outside_or_unreadable_are_refused(media, value, why):
    assert why in refused(MediaResolver(MediaOptions(directory=str(media))), value)


def test_the_absolute_path_of_a_file_outside_is_refused(media):
    message = refused(MediaResolver(MediaOptions(directory=str(media))), str(media.parent / "secret.png"))
    assert "outside" in message


def test_paths_are_refused_without_a_media_directory(media):
    assert "server.media.directory" in refused(MediaResolver(MediaOptions()), str(media / "ok.png"))


def test_a_file_over_the_byte_cap_is_refused(media):
    resolver = MediaResolver(MediaOptions(directory=str(media), max_image_bytes=len(PNG) - 1))
    assert "larger than the limit" in refused(resolver, "ok.png")


# --- data: URIs and schemes -------------------------------------------------------------


def data_uri(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def test_data_uris_are_decoded():
    assert load(MediaResolver(MediaOptions()), data_uri(PNG)) == PNG
    assert load(MediaResolver(MediaOptions()), data_uri(PNG, media_type="")) == PNG


@pytest.mark.parametrize("url, why", [
    (data_uri(PNG)[:-7] + "!!!", "not valid base64"),
    ("data:image/png," + "abc", "base64 encoded"),
    ("data:image/png;base64", "base64 encoded"),  # no comma, no payload
    (data_uri(b"hello", media_type="text/plain"), "not an image"),
    ("data:image/png;base64,", "empty"),
])
def test_malformed_data_uris_are_refused(url, why):
    assert why in refused(MediaResolver(MediaOptions()), url)


def test_a_data_uri_over_the_byte_cap_is_refused():
    assert "larger than the limit" in refused(MediaResolver(MediaOptions(max_image_bytes=100)), data_uri(b"x" * 101))
    assert load(MediaResolver(MediaOptions(max_image_bytes=100)), data_uri(b"x" * 100)) == b"x" * 100


@pytest.mark.parametrize("url", ["file:///etc/passwd", "FILE:///etc/passwd", "ftp://example.com/a.png",
                                 "gopher://example.com/", "javascript:alert(1)"])
def test_other_schemes_are_refused(url):
    assert "scheme" in refused(MediaResolver(MediaOptions(allow_remote=True)), url)


def test_remote_urls_are_off_by_default():
    assert "server.media.allow_remote" in refused(MediaResolver(MediaOptions()), "https://example.com/cat.png")


# --- remote fetches ------------------------------------------------------------------


class _Handler(BaseHTTPRequestHandler):
    hosts: list[str] = []

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        _Handler.hosts.append(self.headers.get("Host", ""))
        route = getattr(self, "route_" + self.path.strip("/").replace("-", "_"), None)
        if route is None:
            self.send_error(404)
        else:
            route()

    def route_img(self) -> None:
        self._send(PNG)

    def route_big(self) -> None:
        self._send(b"x" * 5000)

    def route_big_undeclared(self) -> None:
        # No Content-Length: the body runs until the connection closes; the cap is on bytes read.
        self.send_response(200)
        self.send_header("Connection", "close")
        self.end_headers()
        for _ in range(50):
            self.wfile.write(b"x" * 1000)

    def route_slow(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "100")
        self.end_headers()
        deadline = time.time() + 5
        try:
            while time.time() < deadline:  # one byte every 0.1 s: never finishes within the cap
                self.wfile.write(b"x")
                self.wfile.flush()
                time.sleep(0.1)
        except OSError:
            pass

    def route_redirect(self) -> None:
        self.send_response(302)
        self.send_header("Location", "http://169.254.169.254/latest/meta-data/")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _send(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture(scope="module")
def http_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def allowlisted(**options) -> MediaResolver:
    return MediaResolver(MediaOptions(allow_remote=True, allowed_hosts=("127.0.0.0/8",), **options))


def test_an_allowlisted_loopback_server_is_fetched(http_server):
    assert load(allowlisted(), http_server + "/img") == PNG


def test_a_hostname_is_dialled_at_its_vetted_address_with_its_own_host_header(http_server):
    port = http_server.rsplit(":", 1)[1]

    async def registry_dns(host: str, _port: int) -> list[str]:
        assert host == "registry.internal"
        return ["127.0.0.1"]

    resolver = MediaResolver(MediaOptions(allow_remote=True, allowed_hosts=("registry.internal",)), registry_dns)
    _Handler.hosts.clear()
    assert load(resolver, f"http://registry.internal:{port}/img") == PNG
    assert _Handler.hosts == [f"registry.internal:{port}"]


def test_the_loopback_server_is_refused_without_the_allowlist(http_server):
    message = refused(MediaResolver(MediaOptions(allow_remote=True)), http_server + "/img")
    assert "non-public address" in message


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "[::1]", "0.0.0.0", "169.254.169.254", "10.0.0.7",
                                  "172.16.5.4", "192.168.1.1", "224.0.0.1", "[fe80::1]", "[::ffff:127.0.0.1]",
                                  "[fc00::1]", "100.64.0.1", "233.252.0.1", "[ff0e::1]"])
def test_non_public_hosts_are_refused_by_default(host):
    assert "non-public address" in refused(MediaResolver(MediaOptions(allow_remote=True)), f"http://{host}/a.png")


def test_a_name_resolving_to_a_private_address_is_refused():
    async def dns(host: str, port: int) -> list[str]:
        return ["93.184.216.34", "10.1.2.3"]  # one public record is not enough

    resolver = MediaResolver(MediaOptions(allow_remote=True), dns)
    assert "non-public address" in refused(resolver, "https://images.example.com/cat.png")


def test_public_addresses_pass_the_address_check():
    import ipaddress

    resolver = MediaResolver(MediaOptions(allow_remote=True))
    assert resolver._may_fetch("example.com", ipaddress.ip_address("93.184.216.34"))
    assert resolver._may_fetch("example.com", ipaddress.ip_address("2606:2800:220:1:248:1893:25c8:1946"))


def test_redirects_are_not_followed(http_server):
    assert "redirects are not followed" in refused(allowlisted(), http_server + "/redirect")


def test_http_errors_are_reported(http_server):
    assert "HTTP 404" in refused(allowlisted(), http_server + "/nothing-here")


@pytest.mark.parametrize("route", ["/big", "/big-undeclared"])
def test_a_body_over_the_byte_cap_is_refused(http_server, route):
    assert "larger than the limit" in refused(allowlisted(max_image_bytes=1000), http_server + route)


def test_a_slow_server_hits_the_time_cap(http_server):
    started = time.monotonic()
    assert "longer than 0.5 s" in refused(allowlisted(fetch_timeout_s=0.5), http_server + "/slow")
    assert time.monotonic() - started < 3


def test_credentials_in_urls_are_refused(http_server):
    assert "credentials" in refused(allowlisted(), http_server.replace("http://", "http://user:pw@") + "/img")


# --- whole messages --------------------------------------------------------------------


def test_resolve_replaces_parts_in_order_and_keeps_the_rest(media):
    resolver = MediaResolver(MediaOptions(directory=str(media)))
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "image_url", "image_url": "ok.png"},
                                     {"type": "text", "text": "and"},
                                     {"type": "image_url", "image_url": {"url": data_uri(b"second")}}]},
    ]
    out, images = asyncio.run(resolver.resolve(messages))
    assert out[0] == messages[0]
    assert out[1]["content"] == [{"type": "image", "image_index": 0}, {"type": "text", "text": "and"},
                                 {"type": "image", "image_index": 1}]
    assert [i.data for i in images] == [PNG, b"second"]
    assert [i.param for i in images] == ["messages.1.content.0.image_url", "messages.1.content.2.image_url"]


def test_images_are_fetched_concurrently(http_server):
    """Two slow images under a 1 s cap each: the refusal comes after 1 s, not 2 s."""
    resolver = allowlisted(fetch_timeout_s=1.0)
    parts = [{"type": "image_url", "image_url": {"url": http_server + "/slow"}}] * 2
    started = time.monotonic()
    with pytest.raises(APIError) as err:
        asyncio.run(resolver.resolve([{"role": "user", "content": parts}]))
    assert "longer than 1.0 s" in err.value.message
    assert time.monotonic() - started < 1.8


def test_too_many_images_are_refused():
    resolver = MediaResolver(MediaOptions(max_images_per_request=2))
    parts = [{"type": "image_url", "image_url": {"url": data_uri(PNG)}}] * 3
    with pytest.raises(APIError) as err:
        asyncio.run(resolver.resolve([{"role": "user", "content": parts}]))
    assert err.value.param == "messages.0.content.2.image_url"


def test_media_options_are_strict():
    with pytest.raises(pydantic.ValidationError):
        MediaOptions(directroy="/srv/media")
    with pytest.raises(pydantic.ValidationError):
        MediaOptions(allowed_hosts=("10.0.0.0/33",))


def test_a_misspelt_media_key_fails_the_config_with_its_path():
    from serve_app.config.app_config import ConfigError, parse_app_config

    with pytest.raises(ConfigError, match=r"server\.media\.directroy"):
        parse_app_config({"models": [{"id": "m"}], "server": {"media": {"directroy": "/srv/media"}}})
    config = parse_app_config({"models": [{"id": "m", "max_image_pixels": 1000}],
                               "server": {"media": {"directory": "/srv/media", "allowed_hosts": ["10.0.0.0/8"]}}})
    assert config.server.media.directory == "/srv/media" and config.models[0].max_image_pixels == 1000
