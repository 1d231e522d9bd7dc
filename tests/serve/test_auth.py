"""Bearer API keys: loading and checking as unit tests, then a second Serve app with keys
configured (one through the ingress replica's runtime_env, one through a key file)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import httpx
import openai
import pytest

from serve_app.config.app_config import ConfigError, ServerOptions, parse_app_config
from serve_app.http.auth import APIKeyAuth, bearer_token, read_api_keys
from serve_app.http.errors import APIError
from tests.support.paths import REPO_ROOT
from tests.support.serve_fixtures import (
    TINY_MODEL_ID,
    delete_app,
    tiny_app_args,
    wait_ready,
)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

ENV_NAME = "CHATSERVE_TEST_API_KEYS"
ENV_KEY = "sk-env-Zq8wX1c0vB7n"
OTHER_ENV_KEY = "sk-env-second-4Tg9"
FILE_KEY = "sk-file-Jk3LmN5pQr7s"

# ------------------------------------------------------------------------- loading


def test_no_source_means_auth_off():
    assert read_api_keys(ServerOptions(), environ={ENV_NAME: ENV_KEY}) == []
    auth = APIKeyAuth.from_options(ServerOptions(), environ={})
    assert not auth.enabled
    auth.check({})  # passes


def test_keys_from_env_and_file(tmp_path):
    key_file = tmp_path / "keys"
    key_file.write_text(f"# team A\n\n  {FILE_KEY}  \n#{ENV_KEY}\n")
    options = ServerOptions(api_keys_env=ENV_NAME, api_keys_file=str(key_file))
    keys = read_api_keys(options, environ={ENV_NAME: f" {ENV_KEY} ,, {OTHER_ENV_KEY},"})
    assert keys == [ENV_KEY, OTHER_ENV_KEY, FILE_KEY]


def test_a_named_source_without_keys_refuses_to_start(tmp_path):
    with pytest.raises(ConfigError) as info:
        read_api_keys(ServerOptions(api_keys_env=ENV_NAME), environ={})
    assert ENV_NAME in str(info.value)
    empty = tmp_path / "empty"
    empty.write_text("# nothing yet\n\n")
    with pytest.raises(ConfigError):
        read_api_keys(ServerOptions(api_keys_file=str(empty)), environ={})
    # One source with keys is enough.
    assert read_api_keys(ServerOptions(api_keys_env=ENV_NAME, api_keys_file=str(empty)),
                         environ={ENV_NAME: ENV_KEY}) == [ENV_KEY]


def test_unreadable_file_refuses_to_start(tmp_path):
    missing = tmp_path / "missing"
    with pytest.raises(ConfigError) as info:
        read_api_keys(ServerOptions(api_keys_file=str(missing)), environ={ENV_NAME: ENV_KEY})
    assert "api_keys_file" in str(info.value)


def test_keys_that_a_header_cannot_carry_are_refused():
    for bad in ("sk-with blank", "ключ-1", "sk-tab\there"):
        with pytest.raises(ConfigError) as info:
            read_api_keys(ServerOptions(api_keys_env=ENV_NAME), environ={ENV_NAME: bad})
        assert bad not in str(info.value)


def test_config_options():
    args = {"models": [{"id": "m"}], "server": {"api_keys_env": "CHATSERVE_API_KEYS", "api_keys_file": "/k"}}
    server = parse_app_config(args).server
    assert server.api_keys_env == "CHATSERVE_API_KEYS" and server.api_keys_file == "/k"
    # A key pasted where the variable's name belongs is refused, and not echoed.
    with pytest.raises(ConfigError) as info:
        parse_app_config({"models": [{"id": "m"}], "server": {"api_keys_env": ENV_KEY}})
    assert "server.api_keys_env" in str(info.value) and ENV_KEY not in str(info.value)


# ------------------------------------------------------------------------- checking


@pytest.mark.parametrize(
    ("header", "token"),
    [(None, None), ("", None), ("Bearer", None), ("Bearer   ", None), ("Basic abc", None), (f"Bearer {ENV_KEY}", ENV_KEY),
     (f"bearer {ENV_KEY}", ENV_KEY), (f"BEARER   {ENV_KEY}  ", ENV_KEY)],
)
def test_bearer_token(header, token):
    assert bearer_token(header) == token


def _status(auth: APIKeyAuth, header: str | None, x_api_key: str | None = None) -> int:
    headers = {name: value for name, value in (("authorization", header), ("x-api-key", x_api_key)) if value}
    try:
        auth.check(headers)
    except APIError as exc:
        assert exc.status == 401
        assert exc.code == "invalid_api_key" and exc.type == "invalid_request_error"
        assert exc.headers == {"WWW-Authenticate": "Bearer"}
        assert header is None or header.split()[-1] not in exc.message
        return 401
    return 200


@pytest.mark.parametrize(
    ("presented", "status"),
    [
        (ENV_KEY, 200),
        (OTHER_ENV_KEY, 200),
        (ENV_KEY.upper(), 401),  # differs only in case
        (ENV_KEY[:-1], 401),  # a prefix
        (ENV_KEY + "x", 401),  # longer
        ("x" + ENV_KEY, 401),
        (ENV_KEY + OTHER_ENV_KEY, 401),
        ("sk", 401),
    ],
)
def test_check(presented, status):
    auth = APIKeyAuth([ENV_KEY, OTHER_ENV_KEY])
    assert auth.enabled
    assert _status(auth, f"Bearer {presented}") == status


def test_x_api_key_as_anthropic_clients_send_it():
    auth = APIKeyAuth([ENV_KEY])
    assert _status(auth, None, ENV_KEY) == 200
    assert _status(auth, None, ENV_KEY + "x") == 401
    assert _status(auth, f"Bearer {ENV_KEY}x", ENV_KEY) == 401  # a wrong Bearer key is not rescued


def test_missing_header_is_401():
    assert _status(APIKeyAuth([ENV_KEY]), None) == 401
    assert _status(APIKeyAuth([ENV_KEY]), ENV_KEY) == 401  # no scheme


def test_only_digests_are_kept():
    auth = APIKeyAuth([ENV_KEY])
    assert ENV_KEY not in repr(vars(auth))


# ------------------------------------------------------------------- a keyed Serve app


@pytest.fixture(scope="module")
def auth_app(serve_instance, tiny_model_dir, tmp_path_factory):
    """The chatserve app with keys: one from an env var that only the ingress replica's
    runtime_env sets (the driver's environment does not reach a running cluster), one
    from a key file."""
    from ray import serve

    from serve_app.app import build_app

    key_file = tmp_path_factory.mktemp("keys") / "api_keys"
    key_file.write_text(f"# test keys\n{FILE_KEY}\n")
    args = tiny_app_args(tiny_model_dir)
    args["ingress"]["ray_actor_options"]["runtime_env"] = {
        "env_vars": {ENV_NAME: f"{ENV_KEY},{OTHER_ENV_KEY}"}}
    args["server"] = {"api_keys_env": ENV_NAME, "api_keys_file": str(key_file)}
    serve.run(build_app(args), name="auth", route_prefix="/auth", blocking=False)
    url = serve_instance.url("/auth")
    wait_ready(url, headers={"Authorization": f"Bearer {ENV_KEY}"})
    yield url
    delete_app("auth")


BODIES = {
    "/v1/chat/completions": {"model": TINY_MODEL_ID, "messages": [{"role": "user", "content": "hi"}],
                             "max_tokens": 2},
    "/lm/v2/chat/completions": {"model": TINY_MODEL_ID, "messages": [{"role": "user", "content": "hi"}],
                                "max_completion_tokens": 2},
    "/v1/completions": {"model": TINY_MODEL_ID, "prompt": "hi", "max_tokens": 2},
}
ROUTES = [("GET", "/v1/models", None)] + [("POST", path, body) for path, body in BODIES.items()]
ALL_KEYS = (ENV_KEY, OTHER_ENV_KEY, FILE_KEY)
# Routes that generate nothing are behind the keys too.
ROUTES += [("GET", f"/v1/models/{TINY_MODEL_ID}", None),
           ("POST", "/tokenize", {"model": TINY_MODEL_ID, "prompt": "hi"}),
           ("POST", "/detokenize", {"model": TINY_MODEL_ID, "tokens": [1, 2]})]


def call(url: str, method: str, path: str, body, key: str | None = None, header: str | None = None):
    headers = {}
    if header is not None:
        headers["Authorization"] = header
    elif key is not None:
        headers["Authorization"] = f"Bearer {key}"
    return httpx.request(method, url + path, json=body, headers=headers, timeout=60)


def assert_no_key_leaks(resp: httpx.Response, *extra: str) -> None:
    for secret in ALL_KEYS + extra:
        assert secret not in resp.text
        assert all(secret not in value for value in resp.headers.values())


def assert_401(resp: httpx.Response) -> None:
    assert resp.status_code == 401, resp.text
    assert resp.headers["www-authenticate"] == "Bearer"
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["code"] == "invalid_api_key"


def test_health_is_open(auth_app):
    resp = httpx.get(auth_app + "/health")
    assert resp.status_code == 200 and resp.json()["status"] == "ok"


@pytest.mark.parametrize(("method", "path", "body"), ROUTES)
def test_without_a_key_every_route_is_401(auth_app, method, path, body):
    for header in (None, "", "Bearer", "Basic " + ENV_KEY, ENV_KEY):
        resp = call(auth_app, method, path, body, header=header)
        assert_401(resp)
        assert_no_key_leaks(resp)


WRONG_KEYS = [ENV_KEY.upper(), ENV_KEY.lower(), FILE_KEY.swapcase(), ENV_KEY[:-1], ENV_KEY + "0", FILE_KEY[1:],
              f"{ENV_KEY},{OTHER_ENV_KEY}", "sk-totally-wrong"]


@pytest.mark.parametrize(("method", "path", "body"), ROUTES)
def test_wrong_keys_are_401_and_never_echoed(auth_app, method, path, body):
    for wrong in WRONG_KEYS:
        resp = call(auth_app, method, path, body, key=wrong)
        assert_401(resp)
        assert_no_key_leaks(resp, wrong)


@pytest.mark.parametrize(("method", "path", "body"), ROUTES)
@pytest.mark.parametrize("key", ALL_KEYS)
def test_right_keys_pass(auth_app, method, path, body, key):
    resp = call(auth_app, method, path, body, key=key)
    assert resp.status_code == 200, resp.text
    assert_no_key_leaks(resp)


def test_streaming_with_a_key_never_echoes_it(auth_app):
    body = {**BODIES["/lm/v2/chat/completions"], "stream": True}
    resp = call(auth_app, "POST", "/lm/v2/chat/completions", body, key=FILE_KEY)
    assert resp.status_code == 200 and resp.text.rstrip().endswith("data: [DONE]")
    assert_no_key_leaks(resp)


def test_auth_comes_before_validation(auth_app):
    resp = httpx.post(auth_app + "/v1/chat/completions", content=b"{not json",
                      headers={"content-type": "application/json"}, timeout=60)
    assert_401(resp)
    resp = httpx.post(auth_app + "/v1/chat/completions", content=b"{not json", timeout=60,
                      headers={"content-type": "application/json", "Authorization": f"Bearer {ENV_KEY}"})
    assert resp.status_code == 400


def test_every_registered_route_but_health_needs_a_key(auth_app):
    # Read from the source: Serve moves class-based routes into an included router.
    source = (REPO_ROOT / "serve_app" / "ingress.py").read_text()
    routes = [(m.upper(), path) for m, path in re.findall(r'@api\.(get|post|put|patch|delete)\("([^"]+)"', source)]
    assert ("GET", "/health") in routes and len(routes) >= 5
    for method, path in routes:
        resp = httpx.request(method, auth_app + path, json={}, timeout=60)
        if path == "/health":
            assert resp.status_code == 200
        else:
            assert_401(resp)
    for path in ("/docs", "/openapi.json", "/redoc"):  # not served at all
        assert httpx.get(auth_app + path, timeout=60).status_code == 404


def test_openai_client(auth_app):
    good = openai.OpenAI(base_url=auth_app + "/v1", api_key=ENV_KEY, max_retries=0)
    assert [m.id for m in good.models.list().data] == [TINY_MODEL_ID]
    out = good.completions.create(model=TINY_MODEL_ID, prompt="hi", max_tokens=2)
    assert out.usage.completion_tokens <= 2
    bad = openai.OpenAI(base_url=auth_app + "/v1", api_key=ENV_KEY.upper(), max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        bad.chat.completions.create(model=TINY_MODEL_ID, messages=[{"role": "user", "content": "hi"}])
    assert ENV_KEY.upper() not in str(info.value) and ENV_KEY not in str(info.value)


def test_the_keyless_app_stays_open(tiny_app):
    assert httpx.get(tiny_app + "/v1/models", timeout=60).status_code == 200
    resp = httpx.post(tiny_app + "/v1/completions", timeout=60, headers={"Authorization": "Bearer anything"},
                      json={"model": TINY_MODEL_ID, "prompt": "hi", "max_tokens": 1})
    assert resp.status_code == 200
    assert json.loads(resp.text)["object"] == "text_completion"


def test_keys_never_reach_the_logs(auth_app):
    """Requests with right, wrong and malformed keys, then every Serve log file (the
    ingress's request lines and errors, the replicas' and the proxy's logs) is read."""
    import ray

    wrong = ENV_KEY.swapcase()
    call(auth_app, "POST", "/v1/chat/completions", BODIES["/v1/chat/completions"], key=FILE_KEY)
    call(auth_app, "POST", "/v1/chat/completions", {"model": "nope"}, key=ENV_KEY)  # a 404 after auth
    call(auth_app, "POST", "/v1/chat/completions", BODIES["/v1/chat/completions"], key=wrong)
    call(auth_app, "GET", "/v1/models", None, header=f"Basic {OTHER_ENV_KEY}")
    time.sleep(2)  # log lines are flushed asynchronously
    serve_logs = Path(ray._private.worker._global_node.get_logs_dir_path()) / "serve"
    files = [p for p in serve_logs.rglob("*") if p.is_file()]
    texts = {path.name: path.read_text(errors="replace") for path in files}
    assert any("ChatIngress" in name and "/v1/chat/completions" in text for name, text in texts.items())
    for name, text in texts.items():
        for secret in (*ALL_KEYS, wrong):
            assert secret not in text, f"a key in {name}"
