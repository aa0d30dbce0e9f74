"""BlockPool: which KV cache blocks are free, cached or in use, and which blocks each request holds.

Pure bookkeeping on the host (no tensors), so the scheduler can plan a step without touching the
GPU. Block 0 (custom_ops.SCRATCH_BLOCK) is never handed out: padding rows of a graph write their
K/V there and read only it, so a captured scatter can never touch a live sequence.

Every other block is exactly one of: free; cached and unreferenced (published in the prefix cache,
evictable); or referenced by >= 1 request (held in its block table; published or not). Reference
counts let requests share published blocks (engine.kv.prefix_cache); with prefix caching off nothing is
published, so every block is free or held by one request.

A request's published blocks are always a prefix of its block table (the blocks it hit on admission,
then the blocks it published in order: publishing stops at the first block whose prefix someone else
published first). So every request that holds a published block holds all its ancestors, and an
unreferenced published block has no referenced descendant: all of them can be evicted, leaves first,
and `num_free_blocks` counts them as available.

Debug checks (`INFER_GRAPHS_DEBUG_CHECKS=1`, or BlockPool(debug_checks=True)): the scheduler checks
every step that no write lands in a shared or published block, and that the states add up.
"""
from __future__ import annotations

import os
from collections import deque
from typing import Sequence

from custom_ops import SCRATCH_BLOCK
from engine.kv.prefix_cache import ROOT, PrefixCache

_STOPPED = -1  # a request whose next block's prefix was published by another request: it publishes no more


def debug_checks_from_env() -> bool:
    return os.environ.get("INFER_GRAPHS_DEBUG_CHECKS", "") not in ("", "0")


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, debug_checks: bool | None = None) -> None:
        if num_blocks < 2:
            raise ValueError(f"BlockPool needs num_blocks >= 2 (block {SCRATCH_BLOCK} is scratch), got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"BlockPool needs block_size >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.debug_checks = debug_checks_from_env() if debug_checks is None else debug_checks
        self._free: deque[int] = deque(b for b in range(num_blocks) if b != SCRATCH_BLOCK)
        self._refs = [0] * num_blocks
        self._owned: dict[str, list[int]] = {}
        self._published: dict[str, int] = {}  # request -> leading blocks of its table that are published
        self.cache: PrefixCache | None = None
        self._tick = 0

    def enable_prefix_caching(self) -> None:
        if self._owned:
            raise RuntimeError("BlockPool.enable_prefix_caching: blocks are already in use")
        self.cache = PrefixCache(self.block_size)

    @property
    def num_free_blocks(self) -> int:
        """Blocks a request can get now: free ones plus unreferenced cached ones (evicted on demand)."""
        return len(self._free) + (self.cache.num_unreferenced if self.cache else 0)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, request_id: str) -> list[int]:
        """The request's blocks. The list is only ever appended to while the request holds it (a
        preempted request gets a new one), which persistent device block tables rely on."""
        return self._owned.get(request_id, [])

    def tables(self, request_id: str) -> list[list[int]]:
        """The request's block table per KV group (one group here; engine.kv.groups has more)."""
        return [self._owned.get(request_id, [])]

    def tables_by_group(self, request_ids: list[str]) -> list[list[list[int]]]:
        """Per KV group (one here), the block table of each of request_ids."""
        owned = self._owned
        return [[owned.get(r, []) for r in request_ids]]

    def release_before(self, request_id: str, next_position: int) -> int:
        """Every layer sees every earlier position: nothing falls out of a window (engine.kv.groups)."""
        return 0

    def holds(self, request_id: str, num_tokens: int, next_position: int) -> bool:
        """True when request_id already has blocks for num_tokens tokens and nothing to give back for
        a query at next_position: release_before and grow would change nothing. The scheduler's decode
        fast path (one call per running request instead of their several)."""
        return len(self._owned.get(request_id, ())) * self.block_size >= num_tokens

    def num_new_blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """Blocks to add so that request_id holds num_tokens tokens."""
        return max(0, self.blocks_for(num_tokens) - len(self.block_table(request_id)))

    # -- allocation --------------------------------------------------------------------------------

    def match_prefix(self, token_ids: Sequence[int]) -> list[int]:
        """Cached blocks holding the longest run of whole blocks of token_ids; never the last token, which
        must be computed so the request can sample. [] with prefix caching off."""
        if self.cache is None:
            return []
        return self.cache.match(token_ids, (len(token_ids) - 1) // self.block_size)

    def admit(self, request_id: str, cached_blocks: list[int], num_tokens: int) -> bool:
        """Give a request that holds nothing the cached_blocks (from match_prefix), then new blocks up to
        num_tokens tokens; False (and no change) if too few blocks are available."""
        if request_id in self._owned:
            raise RuntimeError(f"BlockPool.admit: request {request_id!r} already holds blocks")
        needed = self.blocks_for(num_tokens) - len(cached_blocks)
        # Referencing an unreferenced cached block takes it out of the evictable ones.
        available = self.num_free_blocks - sum(1 for b in cached_blocks if self._refs[b] == 0)
        if needed > available:
            return False
        for block in cached_blocks:
            if self._refs[block] == 0:
                self.cache.referenced(block)
            self._refs[block] += 1
        table = list(cached_blocks)
        table.extend(self._take() for _ in range(max(0, needed)))
        self._owned[request_id] = table
        self._published[request_id] = len(cached_blocks)
        return True

    def grow(self, request_id: str, num_tokens: int) -> bool:
        """Give request_id enough blocks for num_tokens tokens; False (and no change) if too few are available."""
        needed = self.num_new_blocks_needed(request_id, num_tokens)
        if needed > self.num_free_blocks:
            return False
        if needed:
            if request_id not in self._owned:
                self._owned[request_id] = []
                self._published[request_id] = 0
            self._owned[request_id].extend(self._take() for _ in range(needed))
        return True

    def _take(self) -> int:
        block = self._free.popleft() if self._free else self.cache.evict()
        self._refs[block] = 1
        return block

    def free(self, request_id: str) -> int:
        """Drop every reference request_id holds (finish, abort, preemption); the number of blocks it held.
        Published blocks stay cached; the rest are free again."""
        blocks = self._owned.pop(request_id, [])
        self._published.pop(request_id, None)
        for block in reversed(blocks):  # tail first: the LRU evicts a released prefix from its end
            self._refs[block] -= 1
            if self._refs[block] < 0:
                raise RuntimeError(f"BlockPool: block {block} of request {request_id!r} released more often "
                                   "than referenced")
            if self._refs[block] == 0:
                if self.cache is not None and self.cache.is_cached(block):
                    self._tick += 1
                    self.cache.released(block, self._tick)
                else:
                    self._free.append(block)
        return len(blocks)

    def publish(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> range:
        """Publish the request's full blocks whose K/V are all computed (call after the step that computed
        them); the table indices published now. A no-op with prefix caching off."""
        done = self._published.get(request_id, _STOPPED)
        if self.cache is None or done == _STOPPED:
            return range(0)
        table = self._owned[request_id]
        full = min(num_computed_tokens // self.block_size, len(table))
        size = self.block_size
        parent = table[done - 1] if done else ROOT
        for i in range(done, full):
            block = table[i]
            if not self.cache.publish(parent, tuple(token_ids[i * size:(i + 1) * size]), block):
                # Another request published this prefix first (identical prompts computed at once):
                # this copy stays private, and so do the blocks after it, so published blocks remain a
                # prefix of the table (see the module docstring).
                self._published[request_id] = _STOPPED
                return range(done, i)
            parent = block
        self._published[request_id] = max(done, full)
        return range(done, max(done, full))

    def reset_prefix_cache(self) -> int:
        """Evict every unreferenced cached block (a benchmark starting cold); the number evicted."""
        evicted = 0
        while self.cache is not None and self.cache.num_unreferenced:
            self._free.append(self.cache.evict())
            evicted += 1
        return evicted

    # -- queries and checks -------------------------------------------------------------------------

    def slot(self, request_id: str, position: int) -> int:
        """The cache slot (block * block_size + offset) of the token at `position` of request_id."""
        table = self._owned[request_id]
        return table[position // self.block_size] * self.block_size + position % self.block_size

    def prefix_cache_stats(self) -> dict[str, float | int | bool]:
        if self.cache is None:
            return {"enabled": False, "query_tokens": 0, "hit_tokens": 0, "hit_rate": 0.0, "cached_blocks": 0,
                    "evicted_blocks": 0}
        return {"enabled": True, **self.cache.stats()}

    def check_writable(self, request_id: str, start: int, end: int) -> None:
        """Debug: positions [start, end) of request_id land in blocks only it holds and nobody published
        (the no-copy-on-write invariant: shared and published blocks are full and never written again)."""
        table = self._owned.get(request_id, [])
        for index in range(start // self.block_size, (end - 1) // self.block_size + 1):
            if index >= len(table):
                raise RuntimeError(f"request {request_id!r} writes position {index * self.block_size}+ "
                                   f"but holds only {len(table)} blocks")
            block = table[index]
            if self._refs[block] != 1 or (self.cache is not None and self.cache.is_cached(block)):
                raise RuntimeError(
                    f"request {request_id!r} would write positions [{start}, {end}) into block {block} "
                    f"(table index {index}), which is shared ({self._refs[block]} references) or published")

    def check_consistency(self) -> None:
        """Debug: every usable block is in exactly one state, and reference counts match the tables."""
        counted = [0] * self.num_blocks
        for request_id, table in self._owned.items():
            for block in table:
                counted[block] += 1
            if len(set(table)) != len(table):
                raise RuntimeError(f"request {request_id!r} holds a block twice: {table}")
        if counted != self._refs:
            bad = [b for b in range(self.num_blocks) if counted[b] != self._refs[b]]
            raise RuntimeError(f"BlockPool: reference counts of blocks {bad[:8]} do not match the tables")
        free = set(self._free)
        if len(free) != len(self._free) or SCRATCH_BLOCK in free or counted[SCRATCH_BLOCK]:
            raise RuntimeError("BlockPool: the free list repeats a block or the scratch block is handed out")
        in_use = sum(1 for b in range(self.num_blocks) if self._refs[b] > 0)
        cached_idle = 0
        for block in free:
            if self._refs[block] or (self.cache is not None and self.cache.is_cached(block)):
                raise RuntimeError(f"BlockPool: block {block} is free and also in use or cached")
        if self.cache is not None:
            self.cache.check(self._refs)
            cached_idle = self.cache.num_unreferenced
        if len(free) + cached_idle + in_use != self.num_usable_blocks:
            raise RuntimeError(f"BlockPool: {len(free)} free + {cached_idle} cached + {in_use} in use != "
                               f"{self.num_usable_blocks} usable blocks")
