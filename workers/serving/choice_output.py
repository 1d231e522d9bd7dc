"""One choice of a request on its way out: its tokens become text (detokenized, cut at a
stop string), timings and logprobs, one `GenerationChunk` per batch of its events. Every
generated token has one logprob entry, as usage counts it (vLLM's rule): an entry goes out
with its token's text, and when the choice ends, the entries of tokens the text does not
show (the EOS or stop token that ends it, tokens cut off with a stop string) go out too. A
resumed choice first replays the ids its client already has, so its text goes on exactly."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from workers.contract.chunks import GenerationChunk, TokenLogprob, TopLogprob
from workers.contract.sampling_params import SamplingParams
from workers.core.events import TokenEvent
from workers.core.sequence import FinishReason
from workers.engine.resume import ContinuationError
from workers.text.detokenizer import IncrementalDetokenizer
from workers.text.held_logprobs import HeldLogprobs
from workers.text.stop_strings import StopStringMatcher


@dataclass
class Usage:
    """Token counts of a whole request, shared by its choices."""

    prompt_tokens: int
    completion_tokens: int = 0  # all choices
    cached_tokens: int | None = None  # known once the request's first step ran
    cached_tokens_given: bool = False  # set by a hand-over (the prefill replica's count): kept as it is


class ChoiceOutput:
    """Detokenizer, stop matcher, timings and logprobs of one choice of a request."""

    def __init__(self, tokenizer, prompt_ids: list[int], params: SamplingParams, arrival: float,
                 reasoning_open: bool = False) -> None:
        self.tokenizer = tokenizer
        self.reasoning_open = reasoning_open
        self.params = params
        self.prompt_ids = prompt_ids
        self.num_tokens = 0
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids, params.skip_special_tokens)
        self.stops = StopStringMatcher(params.stop, params.include_stop_str_in_output)
        self.held_logprobs = HeldLogprobs()
        self.last_time = arrival
        self.finished = False

    def chunk(self, index: int, events: list[TokenEvent], usage: Usage) -> GenerationChunk:
        """The chunk of this choice (number `index`) for its events of one batch."""
        chunk = self.consume(events, usage)
        chunk.index = index
        if chunk.prompt_logprobs is None and events[0].prompt_logprobs is not None:
            chunk.prompt_logprobs = self._prompt_logprobs(events[0].prompt_logprobs)
        return chunk

    def replay(self, index: int, output_ids: list[int], finish: FinishReason | None, stop_token_id: int | None,
               usage: Usage) -> GenerationChunk | None:
        """Take the ids a client already has (a resumed request) as if they had just been
        sampled, discarding their text, which the client has: what was held back (a partial
        character, a possible stop string) stays held and goes out with the next new text,
        and usage counts them. `finish`: the last id ends the choice (the engine's rules).
        Returns the choice's last chunk when the ids end it (nothing new in it)."""
        if not output_ids:
            return None
        events = [TokenEvent(-1, index, token, None, None, self.last_time) for token in output_ids]
        events[-1] = dataclasses.replace(events[-1], finish_reason=finish, stop_token_id=stop_token_id)
        replayed = self.consume(events, usage)
        if len(replayed.token_ids) < len(output_ids):
            raise ContinuationError(f"choice {index}: the given tokens go on after a stop string")
        if replayed.finish_reason is None:
            return None
        return GenerationChunk(index=index, finish_reason=replayed.finish_reason, stop_reason=replayed.stop_reason,
                               prompt_tokens=usage.prompt_tokens, reasoning_open=self.reasoning_open)

    def skip(self, output_ids: tuple[int, ...], usage: Usage) -> None:
        """A choice its client already has whole (a resumed request): only usage counts it."""
        self.num_tokens = len(output_ids)
        usage.completion_tokens += len(output_ids)
        self.finished = True

    def consume(self, events: list[TokenEvent], usage: Usage) -> GenerationChunk:
        chunk = GenerationChunk(prompt_tokens=usage.prompt_tokens, reasoning_open=self.reasoning_open)
        if self.params.logprobs is not None:
            chunk.logprobs = []
        texts: list[str] = []
        for event in events:
            if event.queue_time is not None:
                chunk.queue_time_ms = event.queue_time * 1000.0
            if event.cached_tokens is not None and not usage.cached_tokens_given:
                usage.cached_tokens = event.cached_tokens
            chunk.cached_tokens = usage.cached_tokens
            if event.beam_token_ids is not None:
                return self._whole_beam(chunk, event, usage)
            self._time(chunk, event.time)
            self.num_tokens += 1
            usage.completion_tokens += 1
            chunk.token_ids.append(event.token_id)
            if self._shows_token(event):
                self._add_text(event, texts, chunk.logprobs is not None)
            elif chunk.logprobs is not None and event.logprob is not None:
                end = len(self.stops.text)  # no text of its own: its entry waits for the end
                self.held_logprobs.add(end, end, self._token_logprob(event))
            if self.stops.matched is not None:
                chunk.finish_reason, chunk.stop_reason = FinishReason.STOP.value, self.stops.matched
                break
            if event.finish_reason is not None:
                texts.append(self.stops.flush())
                chunk.finish_reason = event.finish_reason.value
                chunk.stop_reason = event.stop_token_id
                break
        self.finished = chunk.finish_reason is not None
        if chunk.logprobs is not None:
            chunk.logprobs = self._released_logprobs()
        chunk.text = "".join(texts)
        chunk.completion_tokens = usage.completion_tokens
        return chunk

    def _add_text(self, event: TokenEvent, texts: list[str], logprobs: bool) -> None:
        # Stop strings only count once min_tokens are out (as vLLM).
        armed = self.num_tokens >= self.params.min_tokens
        start = len(self.stops.text)
        piece = self.detok.push(event.token_id)
        texts.append(self.stops.push(piece, armed))
        if logprobs and event.logprob is not None:
            self.held_logprobs.add(start, start + len(piece), self._token_logprob(event))

    def _released_logprobs(self) -> list[TokenLogprob]:
        """The entries of the tokens whose text this chunk carries (all, once the choice ends)."""
        if self.finished:  # also by a stop string: entries of the cut-off tokens go out too
            return self.held_logprobs.flush()
        return self.held_logprobs.release(self.stops.released)

    def _whole_beam(self, chunk: GenerationChunk, event: TokenEvent, usage: Usage) -> GenerationChunk:
        """Beam search returns each finished beam at once: its text, cut at a stop string."""
        self._time(chunk, event.time)
        ids = event.beam_token_ids
        self.num_tokens = len(ids)
        usage.completion_tokens += len(ids)
        chunk.token_ids = list(ids)
        text = self.tokenizer.decode(ids, skip_special_tokens=self.params.skip_special_tokens)
        chunk.text = self.stops.push(text) + (self.stops.flush() if self.stops.matched is None else "")
        chunk.finish_reason = FinishReason.STOP.value if self.stops.matched else event.finish_reason.value
        chunk.stop_reason = self.stops.matched
        chunk.completion_tokens = usage.completion_tokens
        self.finished = True
        return chunk

    def _token_logprob(self, event: TokenEvent) -> TokenLogprob:
        decode = self.tokenizer.decode
        top = [TopLogprob(decode([tid]), tid, lp) for tid, lp in event.top_logprobs or []]
        return TokenLogprob(decode([event.token_id]), event.token_id, event.logprob, top)

    def _prompt_logprobs(self, scored) -> list[dict[int, TopLogprob] | None]:
        decode = self.tokenizer.decode
        out: list[dict[int, TopLogprob] | None] = [None]  # the first prompt token has no context
        for token_id, logprob, top in scored:
            entry = {tid: TopLogprob(decode([tid]), tid, lp) for tid, lp in top}
            entry[token_id] = TopLogprob(decode([token_id]), token_id, logprob)
            out.append(entry)
        return out

    def _shows_token(self, event: TokenEvent) -> bool:
        """The EOS or stop token that ends a request is not part of its text."""
        if event.finish_reason is not FinishReason.STOP:
            return True
        return event.stop_token_id is not None and self.params.include_stop_str_in_output

    def _time(self, chunk: GenerationChunk, when: float) -> None:
        elapsed_ms = (when - self.last_time) * 1000.0
        if self.num_tokens == 0:
            chunk.prefill_time_ms = elapsed_ms
        else:
            chunk.decode_times_ms.append(elapsed_ms)
        self.last_time = when
