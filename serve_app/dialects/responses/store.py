"""Stored responses (`store: true`): a bounded LRU in this ingress replica's memory, for
`previous_response_id` and `GET /v1/responses/{id}`.

Each entry holds the response's JSON and its conversation as chat messages (the earlier
turns, the input and the output; not the instructions, which a later response does not
inherit), both as JSON text, so nothing a later request builds can change them. The
oldest entries go when either bound (entries, bytes) is passed. Another ingress replica
has its own store: a previous id stored there is unknown here (404).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from serve_app.dialects.responses.response import Response
from serve_app.http.errors import APIError


@dataclass(frozen=True)
class StoredResponse:
    body: str  # the response object's JSON
    conversation: str  # JSON list of chat messages

    @property
    def size(self) -> int:
        return len(self.body) + len(self.conversation)

    def messages(self) -> list[dict[str, Any]]:
        return json.loads(self.conversation)


class ResponseStore:
    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: Response, conversation: list[dict[str, Any]]) -> None:
        entry = StoredResponse(response.dump_json(), json.dumps(conversation, ensure_ascii=False))
        if not self.enabled or entry.size > self.max_bytes:
            return  # larger than the whole store: not kept (a later lookup is a 404)
        self._drop(response.id)
        self._entries[response.id] = entry
        self._bytes += entry.size
        while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
            self._drop(next(iter(self._entries)))

    def get(self, response_id: str, param: str | None = "previous_response_id") -> StoredResponse:
        """The stored response (now the most recently used), or a 404 naming `param`."""
        entry = self._entries.get(response_id)
        if entry is None:
            raise not_stored(response_id, param)
        self._entries.move_to_end(response_id)
        return entry

    def _drop(self, response_id: str) -> None:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self._bytes -= entry.size


def not_stored(response_id: str, param: str | None = "previous_response_id") -> APIError:
    return APIError(
        404, f"No response with id {response_id[:80]!r} is stored on this server replica. Responses are kept only "
        "when created with store: true, in a bounded per-replica memory (the oldest are dropped first); with several "
        "ingress replicas, a response stored by another replica is unknown here. Send the whole conversation in "
        "`input` instead.", param=param, code="response_not_found")
