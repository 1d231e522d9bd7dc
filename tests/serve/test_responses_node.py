"""/v1/responses with OpenAI's Node SDK against the tiny app (skipped where node is missing)."""

from tests.support.serve_fixtures import TINY_MODEL_ID


def test_node_sdk_creates_and_streams_a_response(node_sdk, tiny_app):
    out = node_sdk.run("responses.mjs", f"{tiny_app}/v1", TINY_MODEL_ID)
    created, streamed = out["created"], out["streamed"]
    assert created["id"].startswith("resp_") and created["items"] == ["message"] and created["text"]
    assert out["events"][:2] == ["response.created", "response.in_progress"]
    assert out["events"][-1] == "response." + streamed["status"]
    # Greedy: the stream's deltas, its final response and the plain one say the same.
    assert out["deltas"] == streamed["text"] == created["text"]
    tokens = ("input_tokens", "output_tokens", "total_tokens")  # cached_tokens differ: the prefix cache
    assert [streamed["usage"][k] for k in tokens] == [created["usage"][k] for k in tokens]
    assert streamed["status"] == created["status"]
