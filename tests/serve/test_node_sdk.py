"""OpenAI's Node SDK against the tiny app (skipped where node is missing)."""

from tests.support.serve_fixtures import TINY_MODEL_ID


def test_node_sdk_lists_models(node_sdk, tiny_app):
    listed = node_sdk.run("models.mjs", f"{tiny_app}/v1", TINY_MODEL_ID)
    assert TINY_MODEL_ID in listed["ids"]
