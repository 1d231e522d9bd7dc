"""Images in chat messages: where their bytes may come from, and how many.

The ingress resolves every `{"type": "image_url", "image_url": STR or {"url": STR}}`
part before the worker call, so the worker only ever sees bytes (never a path or URL)
and the rules live here, in one place:
- `data:` URIs (base64) are decoded, capped at `max_image_bytes`;
- a value without a scheme is a local path, read only if its real path (symlinks and
  `..` resolved) lies inside `media.directory`;
- `http(s)` URLs are fetched only with `media.allow_remote`, from public addresses only
  (the host is resolved here and the connection goes to the vetted address, so DNS
  cannot swap in another one), redirects not followed, body and time capped;
- anything else (`file:`, `ftp:`, ...) is refused.
Every refusal is a 400 naming `messages.N.content.M.image_url`. Whether the bytes are
an image, and how many pixels it has, is the worker's check (it decodes them).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import ipaddress
import os
import socket
import stat
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx

from serve_app.config.app_config import MediaOptions
from serve_app.http.errors import APIError
from workers.contract.requests import ImageData

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
# host, port -> the addresses it resolves to; injectable so tests need no DNS.
HostResolver = Callable[[str, int], Awaitable[list[str]]]


def image_error(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param, code="invalid_image")


def _image_parts(messages: list[dict[str, Any]]):
    for i, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                if part.get("type") == "image_url":
                    yield f"messages.{i}.content.{j}.image_url", part


def first_image_param(messages: list[dict[str, Any]]) -> str | None:
    return next((param for param, _ in _image_parts(messages)), None)


async def system_resolver(host: str, port: int) -> list[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [info[4][0] for info in infos]


class MediaResolver:
    def __init__(self, options: MediaOptions, resolve_host: HostResolver = system_resolver) -> None:
        self.options = options
        self.resolve_host = resolve_host
        self._root = os.path.realpath(options.directory) if options.directory else None
        self._allowed_names = {h.lower() for h in options.allowed_hosts if "/" not in h}
        self._allowed_nets = [ipaddress.ip_network(h, strict=False) for h in options.allowed_hosts if "/" in h]

    async def resolve(self, messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], tuple[ImageData, ...]]:
        """Messages with each image part replaced by `{"type": "image", "image_index": k}`,
        and the k-th image's bytes (in message order)."""
        parts = list(_image_parts(messages))
        if len(parts) > self.options.max_images_per_request:
            raise image_error(parts[self.options.max_images_per_request][0],
                              f"at most {self.options.max_images_per_request} images are allowed in one request")
        # Concurrently: a request's fetches share one wait, not one per image. The first
        # refusal cancels the rest.
        tasks = [asyncio.ensure_future(self.load(_url_of(part), param)) for param, part in parts]
        try:
            blobs = await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
        images = [ImageData(data, param) for data, (param, _) in zip(blobs, parts)]
        index = iter(range(len(parts)))
        out = []
        for message in messages:
            content = message.get("content")
            if isinstance(content, list):
                content = [{"type": "image", "image_index": next(index)} if p.get("type") == "image_url" else p
                           for p in content]
                message = dict(message, content=content)
            out.append(message)
        return out, tuple(images)

    async def load(self, url: str, param: str) -> bytes:
        scheme = urlsplit(url).scheme.lower() if ":" in url else ""
        if scheme == "data":
            return self._data_uri(url, param)
        if scheme in ("http", "https"):
            return await self._remote(url, param)
        if scheme:
            raise image_error(param, f"the URL scheme {scheme!r} is not supported; use http(s), data: or a path "
                                     "under the server's media directory")
        return await asyncio.to_thread(self._local, url, param)

    # --- data: -----------------------------------------------------------------

    def _data_uri(self, url: str, param: str) -> bytes:
        header, sep, payload = url[len("data:"):].partition(",")
        fields = header.split(";")
        if not sep or fields[-1].lower() != "base64":
            raise image_error(param, "a data: URI must be base64 encoded (data:image/png;base64,...)")
        media_type = fields[0].lower()
        if media_type and not media_type.startswith("image/"):
            raise image_error(param, f"the data: URI has media type {media_type!r}, not an image")
        payload = "".join(payload.split())
        cap = self.options.max_image_bytes
        if len(payload) // 4 * 3 > cap + 2:  # checked before decoding anything
            raise image_error(param, f"the image is larger than the limit of {cap} bytes")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise image_error(param, "the data: URI is not valid base64") from None
        if len(data) > cap:
            raise image_error(param, f"the image is larger than the limit of {cap} bytes")
        if not data:
            raise image_error(param, "the data: URI is empty")
        return data

    # --- local paths -----------------------------------------------------------------

    def _local(self, value: str, param: str) -> bytes:
        if self._root is None:
            raise image_error(param, "local image paths are not enabled on this server (server.media.directory)")
        try:
            path = os.path.realpath(os.path.join(self._root, value))
        except ValueError:  # an embedded NUL byte
            raise image_error(param, "the path is not valid") from None
        if os.path.commonpath([self._root, path]) != self._root:
            raise image_error(param, "the path is outside the server's media directory")
        try:
            # O_NOFOLLOW: the last component cannot have become a symlink since realpath;
            # O_NONBLOCK: opening a FIFO must not hang the ingress.
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:
            raise image_error(param, "no such file in the server's media directory") from None
        except OSError as exc:
            raise image_error(param, f"the file cannot be read ({exc.strerror})") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise image_error(param, "the path is not a regular file")
        with os.fdopen(fd, "rb") as f:
            data = f.read(self.options.max_image_bytes + 1)
        if len(data) > self.options.max_image_bytes:
            raise image_error(param, f"the image is larger than the limit of {self.options.max_image_bytes} bytes")
        return data

    # --- http(s) -----------------------------------------------------------------------

    async def _remote(self, url: str, param: str) -> bytes:
        if not self.options.allow_remote:
            raise image_error(param, "remote image URLs are not enabled on this server (server.media.allow_remote)")
        parts = urlsplit(url)
        try:
            host, port = parts.hostname, parts.port or (443 if parts.scheme.lower() == "https" else 80)
        except ValueError:
            raise image_error(param, "the URL's port is not valid") from None
        if not host:
            raise image_error(param, "the URL has no host")
        if parts.username is not None:
            raise image_error(param, "credentials in image URLs are not accepted")
        try:
            async with asyncio.timeout(self.options.fetch_timeout_s):
                address = await self._vetted_address(host, port, param)
                return await self._fetch(parts, host, address, port, param)
        except TimeoutError:
            raise image_error(param, f"fetching the image took longer than {self.options.fetch_timeout_s} s") from None
        except httpx.HTTPError as exc:
            raise image_error(param, f"fetching the image failed ({type(exc).__name__})") from None

    async def _vetted_address(self, host: str, port: int, param: str) -> IPAddress:
        try:
            found = await self.resolve_host(host, port)
        except OSError:
            raise image_error(param, f"the host {host!r} cannot be resolved") from None
        addresses = [ipaddress.ip_address(a.split("%", 1)[0]) for a in found]
        if not addresses:
            raise image_error(param, f"the host {host!r} cannot be resolved")
        for address in addresses:  # every one: a host must not be public on one record only
            if not self._may_fetch(host, address):
                raise image_error(param, f"the host {host!r} resolves to a non-public address; refused")
        return addresses[0]

    def _may_fetch(self, host: str, address: IPAddress) -> bool:
        if host.lower() in self._allowed_names or any(address in net for net in self._allowed_nets):
            return True
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        # is_global is false for loopback, private, link-local, unspecified, reserved,
        # shared (CGNAT) and documentation ranges; some multicast ranges count as global.
        return address.is_global and not address.is_multicast

    async def _fetch(self, parts, host: str, address: IPAddress, port: int, param: str) -> bytes:
        netloc = f"[{address}]:{port}" if address.version == 6 else f"{address}:{port}"
        target = urlunsplit((parts.scheme, netloc, parts.path or "/", parts.query, ""))
        extensions = {"sni_hostname": host} if parts.scheme.lower() == "https" else {}
        cap = self.options.max_image_bytes
        # trust_env=False: no proxy from the environment; the vetted address is what we dial.
        async with httpx.AsyncClient(follow_redirects=False, trust_env=False, timeout=None) as client:
            async with client.stream("GET", target, headers={"Host": parts.netloc}, extensions=extensions) as resp:
                if resp.is_redirect:
                    raise image_error(param, f"the image URL redirects (HTTP {resp.status_code}); redirects are not followed")
                if resp.status_code != 200:
                    raise image_error(param, f"fetching the image returned HTTP {resp.status_code}")
                declared = resp.headers.get("content-length", "")
                if declared.isdigit() and int(declared) > cap:
                    raise image_error(param, f"the image is larger than the limit of {cap} bytes")
                body = bytearray()
                async for piece in resp.aiter_bytes():
                    body += piece
                    if len(body) > cap:
                        raise image_error(param, f"the image is larger than the limit of {cap} bytes")
        return bytes(body)


def _url_of(part: dict[str, Any]) -> str:
    value = part.get("image_url")
    return value.get("url", "") if isinstance(value, dict) else str(value)
