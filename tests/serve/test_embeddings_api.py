"""/v1/embeddings over HTTP with the OpenAI Python SDK on the tiny app: vectors equal to the
model's normalized last-token hidden states (as transformers computes them), base64 and
float encodings, token-id inputs, a batch of 64 equal to the inputs one at a time, beside
a stream that goes on unchanged, usage and /metrics, and the errors."""

from __future__ import annotations

import base64
import concurrent.futures
import struct

import httpx
import openai
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.support.serve_fixtures import TINY_MODEL_ID


def client_for(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)

    def embed(text: str) -> list[float]:
        ids = tokenizer(text, add_special_tokens=True)["input_ids"]
        with torch.no_grad():
            hidden = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0, -1]
        return F.normalize(hidden.float(), dim=-1).tolist()

    return embed, tokenizer


def close(a, b) -> bool:
    return torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-4, rtol=1e-3)


def test_sdk_default_base64_equals_transformers(tiny_app, reference):
    embed, _ = reference
    texts = ["The quick brown fox.", "Embeddings from a causal LM."]
    out = client_for(tiny_app).embeddings.create(model=TINY_MODEL_ID, input=texts)
    assert out.object == "list" and out.model == TINY_MODEL_ID
    assert [d.index for d in out.data] == [0, 1]
    for data, text in zip(out.data, texts):
        assert close(data.embedding, embed(text))
    assert out.usage.prompt_tokens == out.usage.total_tokens > 0


def test_float_encoding_token_ids_and_base64_bytes(tiny_app, reference):
    embed, tokenizer = reference
    text = "Paged attention."
    ids = tokenizer(text, add_special_tokens=True)["input_ids"]
    floats = httpx.post(tiny_app + "/v1/embeddings", json={"model": TINY_MODEL_ID, "input": text,
                                                           "encoding_format": "float"}, timeout=60).json()
    by_ids = httpx.post(tiny_app + "/v1/embeddings", json={"model": TINY_MODEL_ID, "input": [ids, ids[:3]]},
                        timeout=60).json()
    packed = httpx.post(tiny_app + "/v1/embeddings", json={"model": TINY_MODEL_ID, "input": text,
                                                           "encoding_format": "base64"}, timeout=60).json()
    vector = floats["data"][0]["embedding"]
    assert close(vector, embed(text)) and close(by_ids["data"][0]["embedding"], vector)
    assert by_ids["usage"]["prompt_tokens"] == len(ids) + 3 and floats["usage"]["prompt_tokens"] == len(ids)
    raw = base64.b64decode(packed["data"][0]["embedding"])  # little-endian float32s
    assert len(raw) == 4 * len(vector) and close(list(struct.unpack(f"<{len(vector)}f", raw)), vector)


def test_a_batch_equals_one_at_a_time_beside_a_stream(tiny_app):
    client = client_for(tiny_app)
    texts = [f"input number {i} " * (1 + i % 5) for i in range(64)]
    chat = dict(model=TINY_MODEL_ID, messages=[{"role": "user", "content": "Go on."}], max_tokens=40, temperature=0)
    alone_text = client.chat.completions.create(**chat).choices[0].message.content
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        streamed = pool.submit(lambda: client.chat.completions.create(**chat).choices[0].message.content)
        batch = client.embeddings.create(model=TINY_MODEL_ID, input=texts, encoding_format="float")
        assert streamed.result() == alone_text  # float32: the neighbours change nothing
    singles = [client.embeddings.create(model=TINY_MODEL_ID, input=t, encoding_format="float").data[0].embedding
               for t in texts[:8]]
    assert len(batch.data) == 64
    for got, want in zip(batch.data, singles):
        assert close(got.embedding, want)


def test_usage_reaches_metrics(tiny_app):
    client_for(tiny_app).embeddings.create(model=TINY_MODEL_ID, input="count me")
    text = httpx.get(tiny_app + "/metrics", timeout=30).text
    assert f'chatserve_requests_total{{model="{TINY_MODEL_ID}",route="/v1/embeddings",status="200"}}' in text


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"model": "no-such-model", "input": "x"}, 404, "model"),
    ({"input": []}, 400, "input"),
    ({"input": ["a", ""]}, 400, "input"),
    ({"input": [[1, 2], []]}, 400, "input"),
    ({"input": "x", "encoding_format": "hex"}, 400, "encoding_format"),
    ({"input": "x", "dimensions": 8}, 400, "dimensions"),
    ({"input": [[10**6]]}, 400, "input"),
    ({"input": "word " * 400}, 400, "input"),
])
def test_errors_name_the_field(tiny_app, body, status, param):
    resp = httpx.post(tiny_app + "/v1/embeddings", json={"model": TINY_MODEL_ID, **body}, timeout=60)
    error = resp.json()["error"]
    assert (resp.status_code, error["param"]) == (status, param), error
