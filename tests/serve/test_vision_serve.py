"""Images through Ray Serve: the tiny random LLaVA answers image requests given as a
data: URI, a file under the media directory and an allowlisted URL, exactly as
transformers' own `generate` does; a text request batched beside image requests is
unchanged; seed 001's multimodal sample is answered; refusals are 400s naming the part."""

from __future__ import annotations

import base64
import copy
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor

from tests.serve.test_conformance_seeds import (
    SEED_001_MULTIMODAL,
    check_chat_completion,
)
from tests.support.serve_fixtures import TINY_MODEL_ID, tiny_app_args, wait_ready
from tests.support.tiny_models import write_tiny_model_dir
from tests.support.tiny_vlm import png_bytes, png_declaring, write_tiny_vlm_dir
from workers.contract.requests import GenerateRequest, ImageData
from workers.contract.sampling_params import SamplingParams
from workers.text.detokenizer import IncrementalDetokenizer
from workers.text.vision_prompts import VisionPromptBuilder

VLM_ID = "tiny-vlm"
PNG = png_bytes((220, 30, 30))
OTHER_PNG = png_bytes((20, 40, 230))
PARAM = "messages.0.content.1.image_url"


class _ImageHandler(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(PNG)))
        self.end_headers()
        self.wfile.write(PNG)


@pytest.fixture(scope="module")
def image_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _ImageHandler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return write_tiny_vlm_dir(tmp_path_factory.mktemp("serve_vlm"))


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    (root / "test.png").write_bytes(PNG)
    (root / "notes.png").write_bytes(b"plain text, not an image")
    (root.parent / "outside.png").write_bytes(PNG)
    return root


@pytest.fixture(scope="module")
def vision_app(serve_instance, vlm_dir, media_dir, tmp_path_factory):
    from ray import serve

    from serve_app.app import build_app

    args = tiny_app_args(write_tiny_model_dir(tmp_path_factory.mktemp("text_model")))
    args["models"].append(dict(copy.deepcopy(args["models"][0]), id=VLM_ID, source=str(vlm_dir)))
    args["server"] = {"media": {"directory": str(media_dir), "allow_remote": True, "allowed_hosts": ["127.0.0.0/8"]}}
    serve.run(build_app(args), name="vision", route_prefix="/vision", blocking=False)
    url = serve_instance.url("/vision")
    wait_ready(url, timeout=180)
    return url


@pytest.fixture(scope="module")
def expected_text(vlm_dir):
    """transformers' own greedy answer for a request, decoded as the server decodes it
    (incrementally: a trailing incomplete UTF-8 sequence is never sent)."""
    processor = AutoProcessor.from_pretrained(vlm_dir)
    model = AutoModelForImageTextToText.from_pretrained(vlm_dir, dtype=torch.float32).eval()
    prompts = VisionPromptBuilder(processor, model.config.image_token_id, 10**7)

    def expected(text: str, image: bytes | None, n: int) -> str:
        content = [{"type": "text", "text": text}] + ([{"type": "image", "image_index": 0}] if image else [])
        request = GenerateRequest("r", SamplingParams(), messages=[{"role": "user", "content": content}],
                                  images=(ImageData(image, PARAM),) if image else ())
        prompt = prompts.build(request)
        ids, images = prompt.token_ids, prompt.images
        x = torch.tensor([ids])
        pixels = dict(images.pixel_inputs) if images else {}
        out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n,
                             eos_token_id=None, pad_token_id=0, **pixels)
        detok = IncrementalDetokenizer(processor.tokenizer, ids, skip_special_tokens=True)
        return "".join(detok.push(t) for t in out[0, len(ids):].tolist())

    return expected


def data_uri(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def chat(url: str, image_url, model: str = VLM_ID, text: str = "Describe", n: int = 8, **extra) -> httpx.Response:
    content = [{"type": "text", "text": text}, {"type": "image_url", "image_url": image_url}]
    body = {"model": model, "messages": [{"role": "user", "content": content}], "temperature": 0,
            "max_tokens": n, "ignore_eos": True, **extra}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=120)


def answer(resp: httpx.Response) -> str:
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["message"]["content"]


def test_data_uri_image_is_answered_as_transformers_does(vision_app, expected_text):
    want = expected_text("Describe", PNG, 8)
    assert want != expected_text("Describe", OTHER_PNG, 8)  # the image matters
    assert answer(chat(vision_app, {"url": data_uri(PNG)})) == want
    assert answer(chat(vision_app, {"url": data_uri(OTHER_PNG)})) == expected_text("Describe", OTHER_PNG, 8)


def test_file_in_the_media_dir_and_allowlisted_url_give_the_same_answer(vision_app, media_dir, image_server,
                                                                          expected_text):
    want = expected_text("Describe", PNG, 8)
    assert answer(chat(vision_app, str(media_dir / "test.png"))) == want  # bare string, absolute (seed 001)
    assert answer(chat(vision_app, "test.png")) == want  # relative to the media dir
    assert answer(chat(vision_app, {"url": image_server + "/test.png"})) == want


def test_image_request_streams(vision_app, expected_text):
    body = {"model": VLM_ID, "stream": True, "temperature": 0, "max_tokens": 6, "ignore_eos": True,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Describe"},
                                                      {"type": "image_url", "image_url": {"url": data_uri(PNG)}}]}]}
    with httpx.stream("POST", vision_app + "/v1/chat/completions", json=body, timeout=120) as resp:
        assert resp.status_code == 200
        lines = [line for line in resp.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    text = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content") or "" for line in lines[:-1])
    assert text == expected_text("Describe", PNG, 6)


def test_text_request_beside_image_requests_is_unchanged(vision_app, expected_text):
    text_body = {"model": VLM_ID, "messages": [{"role": "user", "content": "Paris is the capital of"}],
                 "temperature": 0, "max_tokens": 24, "ignore_eos": True}
    alone = answer(httpx.post(vision_app + "/v1/chat/completions", json=text_body, timeout=120))
    assert alone == expected_text("Paris is the capital of", None, 24)
    with ThreadPoolExecutor(4) as pool:
        images = [pool.submit(chat, vision_app, {"url": data_uri(c)}, n=24) for c in (PNG, OTHER_PNG, PNG)]
        text = pool.submit(httpx.post, vision_app + "/v1/chat/completions", json=text_body, timeout=120)
        assert answer(text.result()) == alone
        got = [answer(f.result()) for f in images]
    assert got[0] == got[2] == expected_text("Describe", PNG, 24)
    assert got[1] == expected_text("Describe", OTHER_PNG, 24)


def test_seed_001_multimodal_sample_is_answered(vision_app, media_dir):
    sample = copy.deepcopy(SEED_001_MULTIMODAL)
    sample["model"] = VLM_ID
    sample["messages"][0]["content"][1]["image_url"] = str(media_dir / "test.png")  # was /xxxx/test.png
    resp = httpx.post(vision_app + "/v1/chat/completions", json=sample, timeout=120)
    assert resp.status_code == 200, resp.text
    check_chat_completion(resp.json(), VLM_ID, 20)


# (image_url, words the message must contain); the media dir holds test.png and notes.png,
# and outside.png lies beside it. tools/reliability/hostile_table.py prints these answers too.
BAD_IMAGES = [
    ("notes.png", "not a readable image"),  # the worker decodes it
    ("../outside.png", "outside"),
    ("/xxxx/test.png", "outside"),  # seed 001's own placeholder path
    ("missing.png", "no such file"),
    ({"url": "file:///etc/passwd"}, "scheme"),
    ({"url": "http://169.254.169.254/latest/meta-data/"}, "non-public"),  # link-local (cloud metadata)
    ({"url": "http://[::1]:8000/a.png"}, "non-public"),  # loopback outside the 127.0.0.0/8 allowlist
    ({"url": "http://[fe80::1]/a.png"}, "non-public"),
    ({"url": "http://10.1.2.3/a.png"}, "non-public"),
    ({"url": "data:image/png;base64," + base64.b64encode(png_declaring(100_000, 100_000)).decode()}, "pixels"),
    ({"url": "data:image/png;base64,%%%"}, "base64"),
]


@pytest.mark.parametrize("image_url, why", BAD_IMAGES)
def test_bad_images_are_400s_naming_the_part(vision_app, image_url, why):
    resp = chat(vision_app, image_url)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert (error["param"], error["code"]) == (PARAM, "invalid_image") and why in error["message"]


def test_text_only_model_refuses_an_image(vision_app):
    resp = chat(vision_app, {"url": data_uri(PNG)}, model=TINY_MODEL_ID)
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["param"] == PARAM and "text-only" in error["message"]


def test_handle_api_resolves_images_too(vision_app):
    from ray import serve

    chat_handle = serve.get_app_handle("vision")
    request = {"model": VLM_ID, "temperature": 0, "max_tokens": 4, "ignore_eos": True,
               "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_uri(PNG)}}]}]}
    reply = chat_handle.chat.remote(request).result()
    assert reply.usage.completion_tokens == 4


def test_an_image_in_a_messages_tool_result_is_seen_by_the_model(vision_app):
    """/v1/messages: the image a tool returned reaches the model, as the chat request the
    translation makes (the tool message's text, then the image in the user message) does."""
    tool = {"name": "snapshot", "description": "Takes a picture.", "input_schema": {"type": "object"}}

    def via_messages(image: bytes) -> str:
        source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(image).decode()}
        body = {"model": VLM_ID, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "tools": [tool], "messages": [
            {"role": "user", "content": "Describe"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "snapshot", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                          "content": [{"type": "image", "source": source}]}]}]}
        resp = httpx.post(vision_app + "/v1/messages", json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        return "".join(block["text"] for block in resp.json()["content"] if block["type"] == "text")

    def via_chat(image: bytes) -> str:
        body = {"model": VLM_ID, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                "tools": [{"type": "function", "function": {"name": "snapshot", "description": "Takes a picture.",
                                                            "parameters": {"type": "object"}}}],
                "messages": [
                    {"role": "user", "content": "Describe"},
                    {"role": "assistant", "content": None, "tool_calls": [
                        {"id": "toolu_1", "type": "function", "function": {"name": "snapshot", "arguments": "{}"}}]},
                    {"role": "tool", "tool_call_id": "toolu_1", "content": ""},
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_uri(image)}}]}]}
        return answer(httpx.post(vision_app + "/v1/chat/completions", json=body, timeout=120))

    assert via_messages(PNG) == via_chat(PNG)
    assert via_messages(PNG) != via_messages(OTHER_PNG)  # the image matters
