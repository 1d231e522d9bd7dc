"""LangChain's clients against the tiny app, unchanged but for where they point:
`ChatAnthropic` (invoke and stream over /v1/messages) and `OpenAIEmbeddings` (documents and
a query over /v1/embeddings; `check_embedding_ctx_length=False`, the setting for servers
other than OpenAI's, since the default sends OpenAI's tiktoken ids, not text)."""

from __future__ import annotations

from tests.support.serve_fixtures import TINY_MODEL_ID


def test_chat_anthropic_invoke_and_stream(tiny_app):
    from langchain_anthropic import ChatAnthropic

    chat = ChatAnthropic(model=TINY_MODEL_ID, base_url=tiny_app, api_key="unused", max_tokens=8, temperature=0,
                         max_retries=0)
    reply = chat.invoke([("system", "Be brief."), ("human", "Say hi.")])
    assert isinstance(reply.content, str) and reply.content
    assert reply.usage_metadata["output_tokens"] == 8 and reply.response_metadata["stop_reason"] == "max_tokens"
    pieces = list(chat.stream([("system", "Be brief."), ("human", "Say hi.")]))
    assert "".join(p.text for p in pieces) == reply.content


def test_openai_embeddings_documents_and_query(tiny_app):
    from langchain_openai import OpenAIEmbeddings

    embeddings = OpenAIEmbeddings(model=TINY_MODEL_ID, base_url=tiny_app + "/v1", api_key="unused",
                                  check_embedding_ctx_length=False, max_retries=0)
    documents = embeddings.embed_documents(["Ray Serve scales.", "Paged attention saves memory."])
    query = embeddings.embed_query("Ray Serve scales.")
    assert len(documents) == 2 and len(documents[0]) == len(query) > 0
    assert max(abs(a - b) for a, b in zip(documents[0], query)) < 1e-4
    assert abs(sum(x * x for x in query) - 1.0) < 1e-4  # normalized
