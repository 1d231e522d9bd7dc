"""The chat stream's template events (PlainEvents) are byte for byte what the response models
dump, for any text, finish and stop reason; a whole stream reads the same either way."""

from __future__ import annotations

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

from serve_app.dialects.chat.output import ChunkStreamer, PlainEvents
from serve_app.dialects.chat.request import ChatCompletionRequest
from workers.contract.chunks import GenerationChunk, TokenLogprob

REQUEST = {"model": "m/o\"del ü", "messages": [{"role": "user", "content": "hi"}], "stream": True}

texts = st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=40)  # no lone surrogates
finishes = st.sampled_from([None, "stop", "length", "abort"])
stop_reasons = st.one_of(st.none(), st.integers(0, 10**6), texts)


def streamer(**fields) -> ChunkStreamer:
    stream = ChunkStreamer('chatcmpl-"x"', ChatCompletionRequest.model_validate({**REQUEST, **fields}), False)
    stream.created = 1795500000
    return stream


@settings(max_examples=300, deadline=None)
@given(text=texts, finish=finishes, stop_reason=stop_reasons, index=st.integers(0, 3), first=st.booleans())
def test_a_template_event_is_what_the_models_dump(text, finish, stop_reason, index, first):
    chunk = GenerationChunk(index=index, text=text or ("" if finish else "x"), finish_reason=finish,
                            stop_reason=stop_reason, token_ids=[1], completion_tokens=1)
    via_models = streamer(n=4)
    via_models.states[index].role_sent = not first  # the role goes in a choice's first delta only
    (event,) = via_models._chunk_events(chunk)
    template = PlainEvents(via_models.request_id, via_models.created, via_models.model)
    assert template.content(chunk, role=first) == event.dump_json()


def collect(stream: ChunkStreamer, chunks: list[GenerationChunk], plain: bool) -> list[str]:
    async def rest():
        for chunk in chunks[1:]:
            yield chunk

    if not plain:
        stream._plain_stream = lambda: False
    return asyncio.run(_all(stream.events(chunks[0], rest())))


async def _all(items):
    return [item async for item in items]


def test_a_stream_reads_the_same_through_the_template_and_through_the_models():
    logprob = TokenLogprob(" b", 7, -0.25, [])
    chunks = [GenerationChunk(text="a", token_ids=[1], completion_tokens=1, prompt_tokens=2),
              GenerationChunk(text="", token_ids=[2], completion_tokens=2, prompt_tokens=2),  # held back: no event
              GenerationChunk(text=" b", token_ids=[7], completion_tokens=3, prompt_tokens=2, logprobs=[logprob]),
              GenerationChunk(text="\u2028c\n", token_ids=[3], completion_tokens=4, prompt_tokens=2,
                              finish_reason="stop", stop_reason=2)]
    options = {"stream_options": {"include_usage": True}}
    fast = collect(streamer(**options), chunks, plain=True)
    slow = collect(streamer(**options), chunks, plain=False)
    assert fast == slow and len(fast) == 5  # a, b (with logprobs, via the models), c, usage, [DONE]
