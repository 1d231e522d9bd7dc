"""A sequence's reasoning section under a token budget: where it stands, and the token the
next step must be once the budget is spent (the end tag's, one by one).

Like llama.cpp's reasoning-budget sampler: waiting for the start tag's ids (unless the
prompt left the section open), counting the tokens inside it, forcing the end tag's ids
when the count reaches the budget, then done. A natural end tag ends the count. The state
is rebuilt from a sequence's token ids whenever they change other than by appending (a
fork, an undone step, a resume), so it never disagrees with them."""

from __future__ import annotations

import copy

from workers.contract.sampling_params import ThinkingBudget

WAITING, COUNTING, FORCING, DONE = "waiting", "counting", "forcing", "done"
# How far back a prompt is searched for a section it leaves open: templates open it in the
# generation prompt's last tokens (`<think>\n`); a whole long prompt is not scanned.
OPEN_TAIL = 64


class ThinkingState:
    def __init__(self, budget: ThinkingBudget, prompt_ids: list[int], output_ids: list[int]) -> None:
        self.budget = budget
        self.stage = COUNTING if _left_open(budget, prompt_ids[-OPEN_TAIL:]) else WAITING
        self.count = 0  # tokens inside the section (COUNTING), or end ids forced so far (FORCING)
        self._width = max(len(budget.start_ids), len(budget.end_ids), 1)  # the tags' longest
        self._tail = list(prompt_ids[-self._width:])
        for token in output_ids:
            self.push(token)

    def forced_token(self) -> int | None:
        """The token the next step must produce, or None when it is free."""
        return self.budget.end_ids[self.count] if self.stage == FORCING else None

    def free_run(self, tokens: tuple[int, ...]) -> int:
        """How many of `tokens`, appended in turn, keep every next token free: the part of a
        speculative proposal whose verification rows the budget forces nothing in (the
        state itself is left as it is)."""
        state = copy.copy(self)
        for taken, token in enumerate(tokens):
            state.push(token)
            if state.forced_token() is not None:
                return taken
        return len(tokens)

    def push(self, token: int) -> None:
        budget = self.budget
        self._tail = (self._tail + [token])[-self._width:]
        if self.stage == WAITING:
            if _ends_with(self._tail, budget.start_ids):
                self.stage, self.count = COUNTING, 0
        elif self.stage == COUNTING:
            self.count += 1
            if _ends_with(self._tail, budget.end_ids):
                self.stage = DONE
            elif self.count >= budget.tokens:
                self.stage, self.count = FORCING, 0
        elif self.stage == FORCING:
            self.count += 1
            if self.count == len(budget.end_ids):
                self.stage = DONE


def _ends_with(tokens: list[int], tag: tuple[int, ...]) -> bool:
    return bool(tag) and tuple(tokens[-len(tag):]) == tag


def _left_open(budget: ThinkingBudget, prompt_ids: list[int]) -> bool:
    """Whether the prompt opens the section without closing it (a template that starts
    the reasoning for the model): its last start tag comes after its last end tag."""
    return _last(prompt_ids, budget.start_ids) > _last(prompt_ids, budget.end_ids)


def _last(tokens: list[int], tag: tuple[int, ...]) -> int:
    """Where `tag` last ends in `tokens` (-1: nowhere)."""
    n = len(tag)
    if not n:
        return -1
    for end in range(len(tokens), n - 1, -1):
        if tuple(tokens[end - n:end]) == tag:
            return end
    return -1
