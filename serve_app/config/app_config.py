"""The application config: the `args` of the Serve YAML, typed and validated at start."""

from __future__ import annotations

import ipaddress
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from workers.contract.model_config import DeploymentConfig, ModelConfig
from workers.contract.tracing import TracingConfig


class ConfigError(ValueError):
    """A bad config; the message names every bad key."""


class MediaOptions(BaseModel):
    """Where images in chat messages may come from (applied by the ingress, serve_app/media/images.py).

    Local paths are read only under `directory`; remote http(s) URLs are fetched only when
    `allow_remote` is on, and never from an address that is not globally routable
    (loopback, private, link-local, ...) or is multicast, unless `allowed_hosts` names it
    (for tests or a private image registry). `data:` URIs are always accepted. Every source is capped at `max_image_bytes`.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    directory: str | None = Field(None, min_length=1, description="local image paths must resolve inside it; unset: no paths")
    allow_remote: bool = Field(False, description="fetch http(s) image URLs")
    allowed_hosts: tuple[str, ...] = Field(
        (), description="hostnames or CIDRs exempt from the private-address refusal (tests, private registries)"
    )
    max_image_bytes: int = Field(10 * 1024 * 1024, ge=1, description="cap on one image's encoded bytes")
    fetch_timeout_s: float = Field(10.0, gt=0, description="cap on one remote fetch, DNS lookup to last byte")
    max_images_per_request: int = Field(8, ge=1, description="image parts one request may hold; more is a 400")

    @field_validator("allowed_hosts")
    @classmethod
    def _valid_hosts(cls, hosts: tuple[str, ...]) -> tuple[str, ...]:
        for host in hosts:
            if not host or "/" in host and not _is_network(host):
                raise ValueError(f"allowed_hosts entry {host!r} is neither a hostname nor a CIDR")
        return hosts


def _is_network(text: str) -> bool:
    try:
        ipaddress.ip_network(text, strict=False)
    except ValueError:
        return False
    return True


class ResponsesOptions(BaseModel):
    """`/v1/responses`: how many stored responses (`store: true`) each ingress replica keeps
    for `previous_response_id` and `GET /v1/responses/{id}` (serve_app/dialects/responses/store.py)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    store_max_entries: int = Field(
        1000, ge=0, description="stored responses kept per ingress replica, least recently used dropped first; "
        "0: none (previous_response_id is then always a 404)")
    store_max_bytes: int = Field(
        64 * 1024 * 1024, ge=0, description="cap on the stored responses' JSON (with their conversations) per "
        "ingress replica, least recently used dropped first")


class ServerOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    full_text_enabled: bool = Field(
        False, description="MindIE fullTextEnabled, /v1/chat/completions streams: each delta carries the whole "
        "text so far, and the last chunk adds full_text and usage")
    max_request_bytes: int = Field(
        4 * 1024 * 1024, ge=1024, description="cap on a request body; a larger one is a 413 (checked from "
        "Content-Length, or while a chunked body streams in)")
    # API keys (serve_app/http/auth.py). Neither set: no auth. Either set: every route but
    # GET /health needs `Authorization: Bearer <key>`, and the ingress refuses to start
    # if they yield no key. Both are read in the ingress replica, not where `serve run` runs.
    api_keys_env: str | None = Field(
        None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="name of an environment variable holding comma-separated API keys, e.g. CHATSERVE_API_KEYS",
    )
    api_keys_file: str | None = Field(
        None, min_length=1, description="path of a file with one API key per line; lines starting with '#' are comments"
    )
    media: MediaOptions = Field(MediaOptions(), description="where images in chat messages may come from")
    responses: ResponsesOptions = Field(ResponsesOptions(), description="the /v1/responses store of each ingress replica")
    tracing: TracingConfig = Field(
        TracingConfig(), description="OpenTelemetry spans of each request (ingress and worker), exported over OTLP/HTTP; "
        "off while otlp_traces_endpoint is unset")


class AppConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    models: list[ModelConfig] = Field(
        min_length=1, description="the served models, one worker deployment each; ids and served names must be unique")
    ingress: DeploymentConfig = Field(
        DeploymentConfig(max_ongoing_requests=1024), description="Ray Serve options of the ingress deployment")
    server: ServerOptions = Field(ServerOptions(), description="HTTP-side options: body size, API keys, images")

    @field_validator("models")
    @classmethod
    def _unique_ids(cls, models: list[ModelConfig]) -> list[ModelConfig]:
        ids = [m.id for m in models]  # each names a worker deployment
        if dupes := sorted({i for i in ids if ids.count(i) > 1}):
            raise ValueError(f"model ids must be unique; repeated: {dupes}")
        # Clients name a model or a LoRA adapter the same way (`model`): one namespace.
        names = [n for m in models for n in m.names] + [name for m in models if m.lora for name in m.lora.adapters]
        if dupes := sorted({n for n in names if names.count(n) > 1}):
            raise ValueError(f"served model names and LoRA adapter names must be unique; repeated: {dupes}")
        return models

    def model(self, model_id: str) -> ModelConfig | None:
        return next((m for m in self.models if m.id == model_id), None)

    def served(self, name: str) -> ModelConfig | None:
        """The model a client's `model` names (one of its served_model_name), if any."""
        return next((m for m in self.models if name in m.names), None)

    def served_names(self) -> list[str]:
        return [n for m in self.models for n in m.names]


def parse_app_config(args: dict[str, Any]) -> AppConfig:
    try:
        return AppConfig.model_validate(args)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '(top level)'}: {err['msg']}" for err in exc.errors()
        )
        raise ConfigError(f"invalid chatserve config: {problems}") from None
