"""API keys: every route but `GET /health` needs `Authorization: Bearer <key>` or, as
Anthropic's clients send it, `x-api-key: <key>`.

Where keys come from (`server` options, see serve_app/config/app_config.py):
- `api_keys_env`: the *name* of an environment variable holding comma-separated keys;
- `api_keys_file`: a file with one key per line; blank lines and lines starting with
  `#` are skipped.
Both may be set; the keys of both are accepted. Neither set: auth is off.

They are read once, in the ingress replica's constructor, so the variable must be set
where that replica runs: in the deployment's `ray_actor_options.runtime_env.env_vars`
(`ingress.ray_actor_options` in the app config), or in the environment of the Ray
cluster's processes. `serve run` without a running cluster starts one from the shell,
so a variable exported in that shell reaches the replica; a variable exported after the
cluster started (`ray start`, KubeRay) does not. The file must exist on the node that
runs the replica. If a source is named but yields no key (variable unset or empty, file
empty), or the file cannot be read, the replica refuses to start: a missing secret
never leaves the server open.

Checking a key: only SHA-256 digests of the configured keys are kept. The presented key
is hashed too (so both sides have the same length) and compared with *every* configured
digest by `hmac.compare_digest`, with no early exit, so the time taken does not depend
on which key matched, on how much of one matched, or on the key's length. A missing or
wrong key gets a 401 in OpenAI's error shape (`code: invalid_api_key`) with
`WWW-Authenticate: Bearer`. Keys never appear in logs, error messages or responses.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from serve_app.config.app_config import ConfigError, ServerOptions
from serve_app.http.errors import unauthorized

logger = logging.getLogger("chatserve.auth")

# Printable ASCII without spaces: what an HTTP header can carry unchanged.
_KEY_CHARS = frozenset(chr(c) for c in range(0x21, 0x7F))


def read_api_keys(options: ServerOptions, environ: Mapping[str, str] | None = None) -> list[str]:
    """The configured keys; [] when no source is named. Raises ConfigError (never naming a key)."""
    environ = os.environ if environ is None else environ
    keys: list[str] = []
    if options.api_keys_env:
        raw = environ.get(options.api_keys_env, "")
        keys += [k.strip() for k in raw.split(",") if k.strip()]
    if options.api_keys_file:
        try:
            text = Path(options.api_keys_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            reason = getattr(exc, "strerror", None) or type(exc).__name__
            raise ConfigError(f"server.api_keys_file: cannot read {options.api_keys_file}: {reason}") from None
        for line in text.splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                keys.append(line)
    if (options.api_keys_env or options.api_keys_file) and not keys:
        sources = []
        if options.api_keys_env:
            sources.append(f"environment variable {options.api_keys_env} (unset or empty in the ingress replica)")
        if options.api_keys_file:
            sources.append(f"file {options.api_keys_file} (no key lines)")
        raise ConfigError("API keys are configured but none was found: " + "; ".join(sources))
    for number, key in enumerate(keys, 1):
        if not set(key) <= _KEY_CHARS:
            raise ConfigError(f"API key #{number} has spaces, control or non-ASCII characters; keys must be "
                              "printable ASCII")
    return keys


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def bearer_token(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header (scheme case-insensitive), if any."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return token


class APIKeyAuth:
    """Checks the key a request presents against the configured keys."""

    def __init__(self, keys: Iterable[str] = ()) -> None:
        self._digests: tuple[bytes, ...] = tuple(dict.fromkeys(_digest(k) for k in keys))

    @classmethod
    def from_options(cls, options: ServerOptions, environ: Mapping[str, str] | None = None) -> "APIKeyAuth":
        auth = cls(read_api_keys(options, environ))
        if auth.enabled:
            logger.info("API key auth on: %d key(s)", len(auth._digests))
        else:
            logger.info("API key auth off: no server.api_keys_env or server.api_keys_file configured")
        return auth

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def matches(self, key: str) -> bool:
        presented = _digest(key)
        found = False
        for digest in self._digests:  # every digest, no early exit
            found |= hmac.compare_digest(digest, presented)
        return found

    def check(self, headers: Mapping[str, str]) -> None:
        """Return if the request may pass; raise a 401 APIError otherwise. The key comes in
        `Authorization: Bearer <key>` (OpenAI's clients) or `x-api-key` (Anthropic's)."""
        if not self._digests:
            return
        token = bearer_token(headers.get("authorization")) or headers.get("x-api-key") or None
        if token is None:
            raise unauthorized("Missing API key: send the header `Authorization: Bearer <your API key>` "
                               "(or `x-api-key: <your API key>`).")
        if not self.matches(token):
            raise unauthorized("Incorrect API key provided.")
