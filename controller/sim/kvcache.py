"""The twin's paged KV cache with vLLM's automatic prefix caching.

Follows vLLM 0.32's ``vllm/v1/core/block_pool.py`` (``BlockPool``: ``get_new_blocks``, ``touch``,
``free_blocks``, ``cache_full_blocks``), ``kv_cache_manager.py`` (``get_computed_blocks``,
``allocate_slots``), ``kv_cache_utils.py`` (``hash_block_tokens``: a block's hash chains its parent's)
and ``single_type_kv_cache_manager.py`` (``find_longest_cache_hit``, ``free``):

* Only FULL blocks are hashed: block ``j`` of a request (tokens ``[j*B, (j+1)*B)``, prompt and output
  alike) gets ``hash(parent's hash, its tokens)`` once all its tokens are known; a block is cached
  (entered in the hash table) when ``allocate_slots`` gives it the tokens that fill it; the blocks
  of a request with no shared segment when it frees them (only that request can hit them, and only
  after freeing them: the same answers for less work).
* A request that enters RUNNING with nothing computed (a new one, or a preempted one coming back)
  looks up the longest chain of cached blocks from its first block, at most ``num_tokens - 1`` tokens
  (vLLM never reuses the whole prompt: the last token is computed for its logits); its computed
  tokens start there and the step prefills only the rest. The hit's blocks are ``touch``-ed (shared,
  taken out of the free queue) only when the allocation succeeds; a hit block that sat in the free
  queue counts against the free blocks the allocation needs, as in vLLM's
  ``get_num_blocks_to_allocate``.
* Freeing a request returns its blocks in reverse order; a block whose reference count drops to 0
  goes to the free queue: at its head when it carries no hash (reused first), at its tail when it is
  cached (kept for a later hit). New blocks come from the head, so cached blocks are evicted LRU, and
  only when no uncached free block is left. Free blocks, cached or not, count as free
  (``kv_cache_usage`` = 1 - free / total).
* ``num_cached_tokens``: the hit at a request's first scheduling (vLLM's ``Request.num_cached_tokens``).

The content of a prompt is described by the workload's segments (``RequestSpec.segments``: shared
pieces such as a system prompt or a session's history, by id and length); past them, and in its
output, a request's tokens are its own (keyed by its id), so they hit only when that request itself
comes back after a preemption. A workload with no segments shares nothing, as a trace replay.

Not modelled: partial-block (sub-block) hashing for hybrid models, the null block (the twin has
``num_blocks`` usable blocks, vLLM one fewer), the watermark, a second block with a hash already in
the table (vLLM keeps both under the hash; here the second is freed as uncached), KV events,
sliding-window and Mamba groups, the cache salt and multimodal or LoRA extra keys.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(eq=False, slots=True)
class Block:
    """One KV block (vLLM's ``KVCacheBlock``): its hash once full and cached, and its users."""

    hash: int | None = None
    ref: int = 0


@dataclass(eq=False, slots=True)
class Unreachable:
    """Freed full blocks no lookup can reach (a finished request's own content), ``n`` of them in a row:
    they keep their place in the LRU order as cached blocks do, with no hash to compute."""

    n: int


@dataclass(eq=False, slots=True)
class BlockTable:
    """What one request holds: its blocks in order, and its content's block hashes (computed lazily)."""

    key: int
    """The request's own content key (its tokens past the shared segments)."""
    segments: tuple[tuple[int, int], ...] = ()
    """The prompt's shared pieces as (segment id, tokens), in order."""
    blocks: list[Block] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)
    """The content's block hashes so far (they depend on the content only, so they outlive a free)."""
    looked_at: int = 0
    """Blocks of ``blocks`` already offered to the hash table."""
    filled: int = 0
    """Tokens its blocks hold once the scheduled ones are computed (what vLLM caches up to)."""


def block_hashes(table: BlockTable, num_tokens: int, block_size: int) -> list[int]:
    """``table.hashes``, grown to at least the chained hashes of the first ``num_tokens // block_size``
    blocks of ``table``'s content (it may hold more).

    Token ``i`` is identified by (segment id, offset in the segment) within the segments and by (own
    key, offset past them) after; a block hashes its parent's hash with the pieces it covers."""
    want = num_tokens // block_size
    hashes = table.hashes
    while len(hashes) < want:
        j = len(hashes)
        start, end = j * block_size, (j + 1) * block_size
        pieces: list[tuple[int, int, int]] = []
        pos = 0
        for seg, length in table.segments:
            lo, hi = max(start, pos), min(end, pos + length)
            if lo < hi:
                pieces.append((seg, lo - pos, hi - pos))
            pos += length
        if end > pos:
            lo = max(start, pos)
            pieces.append((table.key, lo - pos, end - pos))
        hashes.append(hash((hashes[-1] if hashes else 0, tuple(pieces))))
    return hashes


class KVCache:
    """The block pool: ``num_blocks`` blocks of ``block_size`` tokens, with or without prefix caching."""

    def __init__(self, num_blocks: int, block_size: int, caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.caching = caching
        self._uncached_free = num_blocks
        """Free blocks with no hash: at the head of vLLM's free queue, all alike."""
        self._lru: OrderedDict[Block | Unreachable, None] = OrderedDict()
        """Free full blocks after the uncached ones, least recently freed first (the eviction order)."""
        self._lru_blocks = 0
        """Blocks in ``_lru``."""
        self._table: dict[int, Block] = {}
        """Hash -> cached block (vLLM's ``cached_block_hash_to_block``)."""

    @property
    def free(self) -> int:
        """Free blocks, cached ones included (they are evicted when needed)."""
        return self._uncached_free + self._lru_blocks

    @property
    def cached_blocks(self) -> int:
        """Blocks in the hash table, in use or free."""
        return len(self._table)

    @property
    def usage(self) -> float:
        """vLLM's ``kv_cache_usage``: the fraction of blocks not free."""
        return 1.0 - self.free / self.num_blocks

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def lookup(self, table: BlockTable, num_tokens: int) -> list[Block]:
        """``get_computed_blocks``: the longest chain of cached blocks, at most ``num_tokens - 1`` tokens."""
        if not self.caching:
            return []
        hit: list[Block] = []
        for j in range((num_tokens - 1) // self.block_size):
            block = self._table.get(block_hashes(table, (j + 1) * self.block_size, self.block_size)[j])
            if block is None:
                break
            hit.append(block)
        return hit

    def allocate(
        self, table: BlockTable, computed: int, new_tokens: int, num_tokens: int, hit: Sequence[Block] = ()
    ) -> bool:
        """``allocate_slots``: take the ``hit`` blocks and the blocks ``new_tokens`` more need after
        ``computed`` tokens (the hit's included), or change nothing and return False. Then cache the
        blocks that the scheduled tokens fill, up to the ``num_tokens`` known."""
        need = -(-(computed + new_tokens) // self.block_size) - len(table.blocks)
        if hit:
            need -= len(hit)
            evictable = sum(1 for b in hit if b.ref == 0)  # a free cached block leaves the free queue
            if max(need, 0) + evictable > self.free:
                return False
            for block in hit:  # touch
                if block.ref == 0:
                    del self._lru[block]
                    self._lru_blocks -= 1
                block.ref += 1
            table.blocks.extend(hit)
        elif need > self._uncached_free + self._lru_blocks:
            return False
        if need > 0:
            table.blocks.extend([self._new_block() for _ in range(need)])
        table.filled = min(computed + new_tokens, num_tokens)
        # Blocks of a request's own content can be hit by that request alone, once it has freed them:
        # hashing them when they are freed leaves every lookup's answer as vLLM's and spares the work.
        if table.segments and self.caching and table.filled // self.block_size > table.looked_at:
            self._cache_full(table, table.filled // self.block_size)
        return True

    def _new_block(self) -> Block:
        if self._uncached_free > 0:
            self._uncached_free -= 1
            return Block(ref=1)
        self._lru_blocks -= 1  # evict the least recently freed
        first = next(iter(self._lru))
        if isinstance(first, Unreachable):
            first.n -= 1
            if first.n == 0:
                del self._lru[first]
            return Block(ref=1)
        del self._lru[first]
        assert first.hash is not None
        del self._table[first.hash]
        first.hash, first.ref = None, 1
        return first

    def _cache_full(self, table: BlockTable, full: int) -> None:
        """Enter the first ``full`` blocks of ``table`` (all full) in the hash table where not yet."""
        if full <= table.looked_at:
            return
        hashes = block_hashes(table, full * self.block_size, self.block_size)
        for j in range(table.looked_at, full):
            block, h = table.blocks[j], hashes[j]
            if block.hash is None and h not in self._table:
                block.hash = h
                self._table[h] = block
        table.looked_at = full

    def release(self, table: BlockTable, final: bool = False) -> None:
        """``free``: the blocks in reverse order; cached ones wait at the tail for a later hit.
        ``final``: the request finished, so the full blocks of its own content (no shared segment)
        can be hit by no one: they take their place in the LRU order as ``Unreachable``."""
        full = min(table.filled // self.block_size, len(table.blocks)) if self.caching else 0
        dead = final and not table.segments
        if not dead:
            self._cache_full(table, full)
        for j in range(len(table.blocks) - 1, -1, -1):
            block = table.blocks[j]
            block.ref -= 1
            if block.ref > 0:
                continue
            if block.hash is not None:
                self._lru[block] = None
                self._lru_blocks += 1
            elif dead and j < full:
                self._lru_blocks += 1
                last = next(reversed(self._lru)) if self._lru else None
                if isinstance(last, Unreachable):
                    last.n += 1
                else:
                    self._lru[Unreachable(1)] = None
            else:
                self._uncached_free += 1
        table.blocks.clear()
        table.looked_at = table.filled = 0
