"""Paged KV-cache bookkeeping: fixed-size blocks, one block table per sequence, prefix cache.

The KV tensors are a pool of `num_blocks * block_size` token slots (see kv_cache.py).
A sequence owns the blocks in its `block_table`; token position p lives in slot
`block_table[p // block_size] * block_size + p % block_size`. Memory grows a block at a
time with the sequence, so nothing is reserved up to a maximum length.

Blocks are reference-counted so sequences can share them: `fork` gives a child the
parent's whole table (n > 1 choices prefill their prompt once). A sequence about to
write into a block it shares gets a private copy first (copy-on-write); `allocate`
returns those (source, destination) block pairs for the KV cache to copy.

Prefix cache (as vLLM and nano-vllm): once a full block's K/V are computed, it is
registered under a chain hash of its tokens and of every block before it (and the
sequence's `cache_salt`), so equal hashes mean equal prefixes. A new sequence whose
leading blocks hash the same takes those blocks by reference instead of computing
them. A block whose last reference goes keeps its hash and stays findable while it
sits in the free pool; the pool hands out least-recently-freed blocks first, so the
cached blocks evicted are the ones unused longest.

Below a block, the cache is token-granular (as llama.cpp's slots and SGLang's radix tree):
every cached block is also filed under its parent's hash with the tokens it holds, and a
sequence's last, partly filled block joins them when the sequence is freed. Past its
matching full blocks, a new sequence takes the child whose tokens share the longest run
with its own next ones, as computed up to there; its first write lands in a private copy
(a block the cache vouches for is never written in place). So a prompt sent again, or an
agent's next turn, prefills only the tokens that are new, not the rest of a block too.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from workers.core.sequence import Sequence


def chain_hash(parent: bytes | None, token_ids: list[int], salt: bytes = b"") -> bytes:
    """Hash of one full block given the hash of the block before it (None for the first)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent if parent is not None else b"\x00" + salt)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


@dataclass(frozen=True)
class PrefixHit:
    """What the prefix cache holds of a sequence's start: full blocks, possibly followed by
    one block whose first tokens match (the tail), and how many tokens all that covers."""

    blocks: tuple[int, ...] = ()
    num_tokens: int = 0


NO_HIT = PrefixHit()

# Children a parent offers as tails, the most recently filed: a lookup compares each with
# the sequence's next tokens, and the root's children (every cached prompt's first block)
# would otherwise make that a scan of the whole cache.
MAX_TAIL_CANDIDATES = 32


def _common_run(a: tuple[int, ...], b: list[int]) -> int:
    """Length of the run of equal tokens `a` and `b` start with."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # Free blocks, least recently freed first; never-used blocks start at the front.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._refs = [0] * num_blocks
        self._hash_of: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}  # chain hash -> block holding that prefix
        # Token-granular level: parent key (the previous block's chain hash, or the root
        # key of a salt) -> cached blocks hanging from it, each with the tokens it holds.
        self._children: dict[bytes, dict[int, tuple[int, ...]]] = {}
        self._parent_of: list[bytes | None] = [None] * num_blocks
        self.query_tokens = 0  # prompt tokens looked up in the prefix cache (counter)
        self.hit_tokens = 0  # of which found there

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence references, cached ones included (they can be evicted)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    # --- prefix cache ----------------------------------------------------------------

    def cached_prefix(self, seq: Sequence) -> PrefixHit:
        """The longest cached prefix of a sequence that has none yet: its full blocks, then
        the cached block sharing most of the tokens after them. The last token is never
        covered: its logits are needed to sample."""
        if not self.enable_prefix_caching or seq.block_table or _needs_every_prompt_logit(seq):
            return NO_HIT
        wanted = seq.num_tokens - 1
        hashes = self._block_hashes(seq, wanted // self.block_size)
        blocks = self.cached_blocks(hashes)
        start = len(blocks) * self.block_size
        next_tokens = seq.token_ids[start:min(start + self.block_size, wanted)]
        tail, run = self._longest_child(_parent_key(hashes, len(blocks), seq.cache_salt), next_tokens)
        if run:
            blocks.append(tail)
        return PrefixHit(tuple(blocks), start + run)

    def _longest_child(self, parent: bytes, tokens: list[int]) -> tuple[int, int]:
        """(block, run): the cached child of `parent` whose tokens start with the longest run
        of `tokens` (run 0: none starts with even one)."""
        best, best_run = -1, 0
        for block, held in self._children.get(parent, {}).items():
            run = _common_run(held, tokens)
            if run > best_run:
                best, best_run = block, run
        return best, best_run

    def use_prefix(self, seq: Sequence, prefix: PrefixHit) -> None:
        """Start `seq` with `prefix` (from `cached_prefix`) as computed context."""
        if seq.num_cached_tokens is None:  # first admission: what usage reports
            seq.num_cached_tokens = prefix.num_tokens
            self.query_tokens += seq.num_tokens
            self.hit_tokens += seq.num_cached_tokens
        for block in prefix.blocks:
            if self._refs[block] == 0:
                del self._free[block]
            self._refs[block] += 1
        seq.block_table = list(prefix.blocks)
        seq.num_computed_tokens = prefix.num_tokens
        seq.num_cached_blocks = prefix.num_tokens // self.block_size

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Register the full blocks whose K/V are now computed (called after a step ran)."""
        if not self.enable_prefix_caching:
            return
        # Only blocks whose tokens are all known: under async scheduling a step is computed
        # before the token it fed is back on the host.
        full = min(seq.num_computed_tokens, seq.num_tokens) // self.block_size
        if full <= seq.num_cached_blocks:
            return
        hashes = self._block_hashes(seq, full)
        bs = self.block_size
        for index in range(seq.num_cached_blocks, full):
            block, h = seq.block_table[index], hashes[index]
            if h not in self._cached and self._hash_of[block] is None:
                self._register(block, hashes, index, seq.cache_salt, seq.token_ids[index * bs:(index + 1) * bs])
        seq.num_cached_blocks = full

    def _cache_tail(self, seq: Sequence) -> None:
        """File a sequence's partly filled last computed block (it is being freed) under its
        parent, so a later sequence can take the tokens it holds."""
        if not self.enable_prefix_caching:
            return
        known = min(seq.num_computed_tokens, seq.num_tokens)
        index, held = divmod(known, self.block_size)
        if not held or index >= len(seq.block_table):
            return
        block = seq.block_table[index]
        if self._hash_of[block] is None and self._parent_of[block] is None:
            hashes = self._block_hashes(seq, index)
            self._file_child(block, _parent_key(hashes, index, seq.cache_salt), seq.token_ids[index * self.block_size:known])

    def _register(self, block: int, hashes: list[bytes], index: int, salt: bytes, tokens: list[int]) -> None:
        """`block` holds full block `index` of the chain `hashes` (its `tokens`): findable by
        its hash, and filed under its parent as a tail."""
        self._cached[hashes[index]] = block
        self._hash_of[block] = hashes[index]
        self._file_child(block, _parent_key(hashes, index, salt), tokens)

    def _file_child(self, block: int, parent: bytes, tokens: list[int]) -> None:
        siblings = self._children.setdefault(parent, {})
        siblings[block] = tuple(tokens)
        self._parent_of[block] = parent
        if len(siblings) > MAX_TAIL_CANDIDATES:  # the oldest leaves the index (a full one stays cached)
            self._unfile(next(iter(siblings)))

    def _unfile(self, block: int) -> None:
        parent = self._parent_of[block]
        if parent is None:
            return
        siblings = self._children[parent]
        del siblings[block]
        if not siblings:
            del self._children[parent]
        self._parent_of[block] = None

    def prefix_hashes(self, token_ids: list[int], salt: bytes = b"") -> list[bytes]:
        """Chain hashes of every full block of `token_ids` (a prefix handed between replicas)."""
        hashes: list[bytes] = []
        bs = self.block_size
        for i in range(len(token_ids) // bs):
            hashes.append(chain_hash(hashes[-1] if hashes else None, token_ids[i * bs:(i + 1) * bs], salt))
        return hashes

    def cached_blocks(self, hashes: list[bytes]) -> list[int]:
        """The blocks holding the longest cached run of `hashes` (a chain) from its start."""
        blocks = []
        for h in hashes:
            block = self._cached.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def cache_blocks(self, token_ids: list[int], salt: bytes, first: int, count: int) -> list[tuple[int, int]]:
        """Free blocks registered under the chain hashes of full blocks `first` to `first +
        count` of `token_ids` (salted), those not cached yet, for K/V arriving from another
        replica: (index from `first`, block) for the caller to fill. They go back to the free
        pool as the most recently freed, findable like any cached block (tails included).
        Stops where the pool would have to evict a block taken here."""
        hashes, bs = self.prefix_hashes(token_ids, salt), self.block_size
        taken = []
        room = len(self._free)
        for index in range(first, min(first + count, len(hashes))):
            h = hashes[index]
            if h in self._cached:
                continue
            if len(taken) == room:
                break
            block = self._take()
            self._register(block, hashes, index, salt, token_ids[index * bs:(index + 1) * bs])
            taken.append((index - first, block))
        for _, block in taken:
            self._release(block)
        return taken

    def _block_hashes(self, seq: Sequence, count: int) -> list[bytes]:
        """Chain hashes of the first `count` full blocks of `seq`, computed once per sequence."""
        hashes, bs = seq.block_hashes, self.block_size
        while len(hashes) < count:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(chain_hash(parent, seq.token_ids[i * bs : (i + 1) * bs], seq.cache_salt))
        return hashes[:count]

    # --- allocation ------------------------------------------------------------------

    def blocks_needed(self, seq: Sequence, num_new_tokens: int, prefix: PrefixHit = NO_HIT) -> int:
        """Blocks `seq` must take from the pool so `num_new_tokens` more tokens fit after its
        computed ones (after the cached `prefix`, for a sequence being admitted)."""
        computed = seq.num_computed_tokens + prefix.num_tokens
        have = len(seq.block_table) + len(prefix.blocks)
        needed = max(0, -(-(computed + num_new_tokens) // self.block_size) - have)
        # A cached block nobody references sits in the free pool: reusing it takes it out.
        idle_prefix = sum(1 for block in prefix.blocks if self._refs[block] == 0)
        copy = self._needs_copy([*seq.block_table, *prefix.blocks], computed, num_new_tokens)
        return needed + idle_prefix + int(copy)

    def can_allocate(self, seq: Sequence, num_new_tokens: int, prefix: PrefixHit = NO_HIT) -> bool:
        return self.blocks_needed(seq, num_new_tokens, prefix) <= len(self._free)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]]:
        """Grow `seq.block_table` to cover `num_new_tokens` more tokens; return blocks to copy."""
        needed = self.blocks_needed(seq, num_new_tokens)
        if needed > len(self._free):
            raise RuntimeError(f"KV cache out of blocks: need {needed}, have {len(self._free)}")
        copies = []
        if self._needs_copy(seq.block_table, seq.num_computed_tokens, num_new_tokens):
            index = seq.num_computed_tokens // self.block_size
            shared = seq.block_table[index]
            private = self._take()
            self._release(shared)
            seq.block_table[index] = private
            copies.append((shared, private))
        total = seq.num_computed_tokens + num_new_tokens
        while len(seq.block_table) * self.block_size < total:
            seq.block_table.append(self._take())
        return copies

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Give `child` the parent's blocks, shared until one of them writes."""
        child.block_table = list(parent.block_table)
        for block in child.block_table:
            self._refs[block] += 1

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references and forget what was computed."""
        self._cache_tail(seq)
        # Last block first: a prefix chain is evicted from its tail, keeping its head findable.
        for block in reversed(seq.block_table):
            self._release(block)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_cached_blocks = 0

    def max_tokens_capacity(self) -> int:
        return self.num_blocks * self.block_size

    def _needs_copy(self, table: list[int], computed: int, num_new_tokens: int) -> bool:
        """The first write after `computed` tokens of block `table` lands in an existing block
        that another sequence also holds, or that the prefix cache holds (a tail taken from it)."""
        if num_new_tokens <= 0:
            return False
        index = computed // self.block_size
        if index >= len(table):
            return False
        block = table[index]
        return self._refs[block] > 1 or self._parent_of[block] is not None or self._hash_of[block] is not None

    def _take(self) -> int:
        block, _ = self._free.popitem(last=False)
        h = self._hash_of[block]
        if h is not None:  # evict: its slots are about to be overwritten
            del self._cached[h]
            self._hash_of[block] = None
        self._unfile(block)
        self._refs[block] = 1
        return block

    def _release(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] == 0:
            self._free[block] = None


def _root_key(salt: bytes) -> bytes:
    """The parent key of a salt's first blocks (chain hashes are 16 bytes; this is longer)."""
    return b"root:" + salt + b"\x00" * 16


def _parent_key(hashes: list[bytes], index: int, salt: bytes) -> bytes:
    """The key full block `index` (of a chain with these hashes) is filed under."""
    return hashes[index - 1] if index else _root_key(salt)


def _needs_every_prompt_logit(seq: Sequence) -> bool:
    """A request asking prompt_logprobs must compute every prompt position (as vLLM skips
    the cache for it); after preemption its prompt is already scored. A mean-pooled
    embedding needs every position's hidden state likewise."""
    pooling = seq.params.pooling
    return (seq.params.prompt_logprobs is not None and seq.num_output_tokens == 0
            or pooling is not None and pooling.kind == "mean")
