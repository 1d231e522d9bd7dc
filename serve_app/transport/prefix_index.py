"""Where prompt prefixes went: one router's record of which worker replica was sent which
prompt prefix, so the next request sharing that prefix can go where its KV blocks are cached.

A prompt is read as text (the ingress never tokenizes): the request's tools, adapter and
messages in a canonical form, cut into fixed-size character blocks, each block's key a hash
chained over every block before it. Two prompts share the first k keys exactly when they
share the first k blocks of text, so the longest recorded run of keys names the replica
that saw the longest common prefix. Text blocks stand in for the engine's token blocks: a
shared prefix of text is a shared prefix of tokens up to the block that differs.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Collection, Iterable
from typing import Any

from workers.contract.requests import GenerateRequest

_MESSAGE_END = "\x1e"  # never in JSON-escaped or plain chat text of a message's fields below
_FIELD_END = "\x1f"


def prompt_text(request: GenerateRequest) -> str:
    """What the prompt depends on, in a canonical text form (not the model's template)."""
    parts = [request.lora.key if request.lora is not None else "", _FIELD_END]
    if request.tools:
        parts += [json.dumps(request.tools, sort_keys=True, ensure_ascii=False), _FIELD_END]
    if request.chat_template_kwargs:
        parts += [json.dumps(request.chat_template_kwargs, sort_keys=True, ensure_ascii=False), _FIELD_END]
    if request.prompt is not None:
        return "".join(parts) + request.prompt
    if request.prompt_token_ids is not None:  # ids as text: the same ids, the same key
        return "".join(parts) + _FIELD_END + " ".join(map(str, request.prompt_token_ids))
    for message in request.messages or ():
        parts += [str(message.get("role", "")), _FIELD_END, _content_text(message.get("content"), request),
                  _FIELD_END]
        if message.get("tool_calls"):
            parts.append(json.dumps(message["tool_calls"], sort_keys=True, ensure_ascii=False))
        parts.append(_MESSAGE_END)
    return "".join(parts)


def _content_text(content: Any, request: GenerateRequest) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    pieces = []
    for part in content:
        if part.get("type") == "image":  # the image's bytes decide its tokens: key it by them
            data = request.images[part["image_index"]].data
            pieces.append("<image:" + hashlib.blake2b(data, digest_size=8).hexdigest() + ">")
        else:
            pieces.append(str(part.get("text", "")))
    return "".join(pieces)


def block_keys(text: str, block_chars: int) -> list[bytes]:
    """One key per whole block of `block_chars` characters, each chained over the blocks
    before it (a partial last block is left out: it cannot be a shared prefix's whole block)."""
    keys, previous = [], b""
    for start in range(0, len(text) - block_chars + 1, block_chars):
        previous = hashlib.blake2b(previous + text[start:start + block_chars].encode(), digest_size=8).digest()
        keys.append(previous)
    return keys


class PrefixIndex:
    """Block key -> the replicas that were sent a prompt with that block, least recently
    used blocks dropped beyond `max_blocks`. Entries of replicas gone are skipped, then
    evicted in time."""

    def __init__(self, max_blocks: int) -> None:
        self._max_blocks = max_blocks
        self._holders: OrderedDict[bytes, set[str]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._holders)

    def depths(self, keys: Iterable[bytes], replicas: Collection[str]) -> dict[str, int]:
        """For each of `replicas` holding the first block: how many leading blocks it holds
        (a block's key is chained over all before it, so holding block k means having been
        sent blocks 0..k)."""
        depth: dict[str, int] = {}
        for count, key in enumerate(keys, start=1):
            holders = self._holders.get(key)
            if not holders:
                break  # later keys are chained over this one: none can be held either
            for replica in holders:
                if replica in replicas:
                    depth[replica] = count
        return depth

    def record(self, keys: Iterable[bytes], replica: str) -> None:
        for key in keys:
            holders = self._holders.get(key)
            if holders is None:
                self._holders[key] = {replica}
            else:
                holders.add(replica)
                self._holders.move_to_end(key)
        while len(self._holders) > self._max_blocks:
            self._holders.popitem(last=False)


def rendezvous(key: str, replicas: Iterable[str]) -> str | None:
    """The replica a session key belongs to: highest random weight, the same in every
    ingress replica's router without shared state; adding or losing a replica moves only
    the sessions that were on it or now fall to the new one."""
    return max(replicas, key=lambda r: hashlib.blake2b(f"{key}\x00{r}".encode(), digest_size=8).digest(),
               default=None)
