"""OpenAI's Node SDK `client.models.retrieve` against the tiny app (skipped where node is missing)."""

from tests.support.serve_fixtures import TINY_MODEL_ID


def test_node_sdk_retrieves_a_model_card(node_sdk, tiny_app):
    out = node_sdk.run("models_retrieve.mjs", f"{tiny_app}/v1", TINY_MODEL_ID)
    card = out["card"]
    assert (card["id"], card["object"], card["owned_by"], card["max_model_len"]) == (
        TINY_MODEL_ID, "model", "chatserve", 256)
    assert (out["missing"]["status"], out["missing"]["code"]) == (404, "model_not_found")
    assert "org/not-served" in out["missing"]["message"]
