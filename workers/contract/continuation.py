"""A request resumed on another replica: what its client has already received.

When a worker's stream breaks mid-request (the replica died or was drained), the ingress
submits the same `GenerateRequest` again, unchanged (messages or prompt, `max_tokens`,
`n`, seed, ...), with a `Continuation`; the new worker templates and tokenizes the prompt
again, counts the given ids as output (against `max_tokens` too) and goes on from there,
so the client's stream only pauses.

The rule for which ids a client has received: a choice's `GenerationChunk.token_ids`,
concatenated over its chunks, are the output tokens the worker has consumed for that
choice, in order. The chunks' text is the text of those tokens except a tail the worker
still holds back (an incomplete UTF-8 character, or text that may begin a stop string).
A continuation lists, per choice, exactly the ids of the chunks received; the new worker
replays them through its detokenizer and stop-string matcher, re-deriving the held-back
tail, which then goes out with the first new text. So nothing is repeated or lost.

Plain frozen dataclasses: cheap to pickle across Ray, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ChoiceProgress:
    """One choice as its client has it: the token ids of every chunk of that choice it
    received, in order, and whether one of those chunks carried a `finish_reason`."""

    token_ids: tuple[int, ...] = ()
    finished: bool = False


@dataclass(frozen=True)
class Continuation:
    """One `ChoiceProgress` per choice of the request (`n` of them, in choice order).

    The resumed stream sends only unfinished choices; its `completion_tokens` count
    every choice's received ids too, as if the request had never been interrupted.
    Prompt log-probabilities are not sent again. A continuation with no ids and no
    finished choice is the request afresh. Beam search delivers each beam whole at the
    end, so it resumes from the start: only finished choices may be listed, and the
    rerun (deterministic) sends the others.
    """

    choices: tuple[ChoiceProgress, ...]

    @property
    def is_empty(self) -> bool:
        """Nothing was received: resuming is the same as starting afresh."""
        return not any(c.token_ids or c.finished for c in self.choices)
