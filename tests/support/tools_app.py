"""The `tools_app` session fixture: two tiny random models served with a window that fits
chatserve's tool section, one plain (hermes tool calls), one 'thinking' model whose
template opens <think> (deepseek_r1). Shared by the tool-calling tests over HTTP and the
Node SDK's, so the app starts once per session."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from tests.support.serve_fixtures import tiny_app_args, wait_ready
from tests.support.tiny_models import write_tiny_model_dir
from tests.unit.text.test_tool_prompts import THINK_TEMPLATE

TOOLS_MODEL, THINKER = "tiny-tools", "tiny-thinker"


@pytest.fixture(scope="session")
def tools_app(serve_instance, tmp_path_factory):
    from ray import serve

    from serve_app.app import build_app

    plain = write_tiny_model_dir(tmp_path_factory.mktemp("tools_model"), max_position_embeddings=2048)
    thinker = write_tiny_model_dir(tmp_path_factory.mktemp("thinker_model"))
    tokenizer = AutoTokenizer.from_pretrained(thinker)
    tokenizer.chat_template = THINK_TEMPLATE
    tokenizer.save_pretrained(thinker)
    args = tiny_app_args(plain, max_model_len=2048, kv_cache_memory_gib=0.01)
    base = args["models"][0]
    args["models"] = [dict(base, id=TOOLS_MODEL),
                      dict(base, id=THINKER, source=str(thinker), reasoning_parser="deepseek_r1",
                           engine=dict(base["engine"], max_model_len=256))]
    serve.run(build_app(args), name="tools", route_prefix="/tools", blocking=False)
    url = serve_instance.url("/tools")
    wait_ready(url, timeout=180)
    return url
