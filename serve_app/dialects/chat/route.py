"""`/v1/chat/completions` as a row of the dialect table: its request model, translation and
output (the handle API's `chat` and `chat_stream` use the same row)."""

from __future__ import annotations

from serve_app.dialects.chat.output import ChunkStreamer, CompletionAccumulator
from serve_app.dialects.chat.request import ChatCompletionRequest
from serve_app.dialects.chat.translate import new_request_id, to_generate_request
from serve_app.output.choice_parser import OutputParsing
from serve_app.schema.dialect import CallContext, Dialect


def output(req: ChatCompletionRequest, request_id: str, context: CallContext,
           stream: bool) -> ChunkStreamer | CompletionAccumulator:
    """The streamer or the accumulator, reading reasoning and tool calls as the served model writes them."""
    parsing = OutputParsing.of(req, context.model)
    if stream:
        return ChunkStreamer(request_id, req, context.server.full_text_enabled, parsing)
    return CompletionAccumulator(request_id, req.model, req.n, parsing)


CHAT = Dialect(path="/v1/chat/completions", request_model=ChatCompletionRequest, new_id=new_request_id,
               translate=to_generate_request, output=output)
