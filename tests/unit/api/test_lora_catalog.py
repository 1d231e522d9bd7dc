"""Which model a request's `model` names at the ingress (a served model, a configured
adapter, an adapter loaded at run time), and the load and unload routes' refusals."""

from __future__ import annotations

import asyncio

import pytest

from serve_app.config.app_config import AppConfig, ConfigError, parse_app_config
from serve_app.http.errors import APIError
from serve_app.lora.adapters import (
    AdapterCatalog,
    LoadLoraAdapterRequest,
    LoraRegistry,
    Target,
    UnloadLoraAdapterRequest,
)
from workers.contract.lora import LoraRequest

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Ray's pydantic models


class _Remote:
    def __init__(self, fn) -> None:
        self.fn = fn

    async def remote(self, *args):
        return self.fn(*args)


class FakeRegistry:
    """The registry deployment's class, called as a handle would call it."""

    def __init__(self) -> None:
        registry = LoraRegistry.func_or_class()
        for name in ("register", "unregister", "get", "all"):
            setattr(self, name, _Remote(getattr(registry, name)))


@pytest.fixture
def adapter_dir(tmp_path):
    for name in ("sql", "chat"):
        (tmp_path / "adapters" / name).mkdir(parents=True)
    return tmp_path / "adapters"


def _catalog(adapter_dir, registry=True, **lora):
    config = AppConfig.model_validate({"models": [
        {"id": "base", "lora": {"adapters": {"fixed": "/srv/fixed"}, "adapter_dir": str(adapter_dir), **lora}},
        {"id": "other"},
    ]})
    return AdapterCatalog(config, FakeRegistry() if registry else None)


def run(coro):
    return asyncio.run(coro)


def test_models_and_configured_adapters_resolve_without_the_registry(adapter_dir):
    catalog = _catalog(adapter_dir, registry=False)
    assert run(catalog.resolve("other")) == Target("other")
    assert run(catalog.resolve("fixed")) == Target("base", LoraRequest.of("fixed", "/srv/fixed"))
    with pytest.raises(APIError) as info:
        run(catalog.resolve("nope"))
    assert (info.value.status, info.value.param, info.value.code) == (404, "model", "model_not_found")
    assert "['base', 'other', 'fixed']" in info.value.message


def test_served_model_names_resolve_to_their_models_id(adapter_dir):
    config = AppConfig.model_validate({"models": [
        {"id": "base", "served_model_name": ["org/base", "b"], "lora": {"adapter_dir": str(adapter_dir)}},
        {"id": "other"},
    ]})
    catalog = AdapterCatalog(config, FakeRegistry())
    assert run(catalog.resolve("org/base")) == run(catalog.resolve("b")) == Target("base")
    with pytest.raises(APIError, match=r"\['org/base', 'b', 'other'\]"):
        run(catalog.resolve("base"))  # the id, not a served name
    # A load names its base model by a served name; an adapter cannot take one.
    assert catalog.load_target(LoadLoraAdapterRequest(lora_name="sql", lora_path="sql", base_model="b"))[0] == "base"
    with pytest.raises(APIError, match="already a served model"):
        catalog.load_target(LoadLoraAdapterRequest(lora_name="org/base", lora_path="sql"))


def test_load_resolve_list_unload(adapter_dir):
    catalog = _catalog(adapter_dir)
    base, path = catalog.load_target(LoadLoraAdapterRequest(lora_name="sql", lora_path="sql"))
    assert (base, path) == ("base", str((adapter_dir / "sql").resolve()))
    run(catalog.register("sql", base, path))
    target = run(catalog.resolve("sql"))
    assert target.base_model == "base" and target.lora.path == path
    assert [a.request.name for a in run(catalog.registered())] == ["fixed", "sql"]
    with pytest.raises(APIError, match="'sql' is already loaded"):
        run(catalog.register("sql", base, path))
    run(catalog.unregister(UnloadLoraAdapterRequest(lora_name="sql")))
    with pytest.raises(APIError) as info:
        run(catalog.resolve("sql"))
    assert info.value.status == 404
    # Loaded again under the same name: a new key, so no replica serves the old weights.
    run(catalog.register("sql", base, path))
    assert run(catalog.resolve("sql")).lora.key != target.lora.key


@pytest.mark.parametrize("body, status, param, message", [
    ({"lora_name": "bad name", "lora_path": "sql"}, 400, "lora_name", "must be 1-128 characters"),
    ({"lora_name": "base", "lora_path": "sql"}, 400, "lora_name", "already a served model"),
    ({"lora_name": "fixed", "lora_path": "sql"}, 400, "lora_name", "already a served model"),
    ({"lora_name": "x", "lora_path": "../sql"}, 400, "lora_path", "outside the adapter directory"),
    ({"lora_name": "x", "lora_path": "/etc"}, 400, "lora_path", "outside the adapter directory"),
    ({"lora_name": "x", "lora_path": "missing"}, 400, "lora_path", "not a directory"),
    ({"lora_name": "x", "lora_path": "sql", "base_model": "other"}, 400, "base_model", "serves no LoRA"),
    ({"lora_name": "x", "lora_path": "sql", "base_model": "ghost"}, 404, "model", "does not exist"),
])
def test_load_refusals(adapter_dir, body, status, param, message):
    with pytest.raises(APIError, match=message) as info:
        _catalog(adapter_dir).load_target(LoadLoraAdapterRequest(**body))
    assert (info.value.status, info.value.param) == (status, param)


def test_unload_refusals(adapter_dir):
    catalog = _catalog(adapter_dir)
    with pytest.raises(APIError, match="comes from the config") as info:
        run(catalog.unregister(UnloadLoraAdapterRequest(lora_name="fixed")))
    assert info.value.status == 400
    with pytest.raises(APIError, match="cannot be found") as info:
        run(catalog.unregister(UnloadLoraAdapterRequest(lora_name="never")))
    assert (info.value.status, info.value.code) == (404, "lora_adapter_not_found")


def test_several_lora_models_need_a_base_model(adapter_dir):
    config = AppConfig.model_validate({"models": [
        {"id": "a", "lora": {"adapter_dir": str(adapter_dir)}}, {"id": "b", "lora": {"adapter_dir": str(adapter_dir)}}]})
    catalog = AdapterCatalog(config, FakeRegistry())
    with pytest.raises(APIError, match="base_model is required"):
        catalog.load_target(LoadLoraAdapterRequest(lora_name="x", lora_path="sql"))
    assert catalog.load_target(LoadLoraAdapterRequest(lora_name="x", lora_path="sql", base_model="b"))[0] == "b"


def test_adapter_names_share_the_model_namespace():
    with pytest.raises(ConfigError, match=r"unique; repeated: \['other'\]"):
        parse_app_config({"models": [{"id": "base", "lora": {"adapters": {"other": "/a"}}}, {"id": "other"}]})
