"""`POST /v1/embeddings` (OpenAI's shape): the request model, the worker message it becomes
(workers/contract/embeddings.py) and the answer.

- `input`: a string, a list of strings, a list of token ids, or a list of such lists (at
  most 2048 inputs, none empty);
- `encoding_format`: `float` (lists of numbers) or `base64` (each vector's little-endian
  float32 bytes, which the OpenAI SDKs ask for by default and decode);
- `dimensions`: the first values of each vector, only for a model whose `pooler_config`
  says `is_matryoshka` (a 400 otherwise);
- `user`: accepted (it keys sessions, as on the other routes).
"""

from __future__ import annotations

import base64
import struct
import uuid
from typing import Annotated, Literal

from pydantic import Field, field_validator

from serve_app.schema.common import RequestModel, ResponseModel
from workers.contract.embeddings import EmbedRequest, EmbedResult

MAX_INPUTS = 2048  # OpenAI's limit on inputs a request

TokenIds = list[Annotated[int, Field(ge=0)]]


class EmbeddingsRequest(RequestModel):
    model: str
    input: str | list[str] | TokenIds | list[TokenIds]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None

    @field_validator("input")
    @classmethod
    def _inputs(cls, value):
        inputs = [value] if isinstance(value, str) else value
        if not inputs:
            raise ValueError("give at least one input")
        if len(inputs) > MAX_INPUTS and not all(isinstance(i, int) for i in inputs):
            raise ValueError(f"at most {MAX_INPUTS} inputs a request, got {len(inputs)}")
        if any(isinstance(i, (str, list)) and not i for i in inputs):
            raise ValueError("inputs must not be empty")
        return value


class EmbeddingData(ResponseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingsUsage(ResponseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingsResponse(ResponseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingsUsage

    def dump_json(self) -> str:
        return self.model_dump_json()


def to_embed_request(req: EmbeddingsRequest) -> EmbedRequest:
    request_id = f"embd-{uuid.uuid4().hex}"
    value = req.input
    if isinstance(value, str):
        return EmbedRequest(request_id, texts=(value,), dimensions=req.dimensions)
    if all(isinstance(i, int) for i in value):  # one prompt of token ids
        return EmbedRequest(request_id, token_ids=(tuple(value),), dimensions=req.dimensions)
    if all(isinstance(i, str) for i in value):
        return EmbedRequest(request_id, texts=tuple(value), dimensions=req.dimensions)
    return EmbedRequest(request_id, token_ids=tuple(tuple(ids) for ids in value), dimensions=req.dimensions)


def embeddings_response(req: EmbeddingsRequest, result: EmbedResult) -> EmbeddingsResponse:
    encode = _base64 if req.encoding_format == "base64" else list
    data = [EmbeddingData(index=i, embedding=encode(vector)) for i, vector in enumerate(result.embeddings)]
    usage = EmbeddingsUsage(prompt_tokens=result.prompt_tokens, total_tokens=result.prompt_tokens)
    return EmbeddingsResponse(data=data, model=req.model, usage=usage)


def _base64(vector: list[float]) -> str:
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
