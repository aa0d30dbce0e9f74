"""SlidingBlockPool: the KV blocks of the sliding-window layers (window W), freed once out of the window.

A query at position p of a sliding layer sees keys p - W + 1 .. p. A request whose next query is at
position s (its computed tokens: a chunk starting at s sees keys from s - W + 1) can never read a
block whose every position is below s - W + 1 again, so `release_before(request, s)` gives those
blocks back. A request then holds at most ceil((W - 1) / B) + 1 blocks between steps, plus those of
the chunk it computes, instead of one per B tokens of its whole length.

Block tables stay indexed by position (entry p // B), as the attention kernels read them: a released
entry is replaced by the scratch block, so the host table, and any copy of it, points at an in-bounds
block; the kernels (custom_ops.triton_decode / triton_prefill) never load an entry below the window,
and the CPU reference gathers only the window (custom_ops.reference.paged_attention).

Prefix caching: a sliding block has no prefix chain of its own (its ancestors are released while it
lives), so it is published under the full-attention block at the same table index, which names the
whole prefix (engine.kv.prefix_cache's chained keys). An entry remembers that block's cache node; it is
valid only while the full cache still holds that very node, so a full block evicted and reused for
another prefix never hands out stale sliding K/V (checked on lookup, no callback needed). Any
unreferenced cached sliding block can be evicted (least recently released first): unlike the full
cache there is no tree to keep, since a hit asks only for the blocks of the last W tokens
(engine.kv.groups shortens a hit that lacks them).

Every usable block is exactly one of: free, cached and unreferenced (evictable), or referenced.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from typing import Sequence

from custom_ops import SCRATCH_BLOCK


class SlidingBlockPool:
    def __init__(self, num_blocks: int, block_size: int, window: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"SlidingBlockPool needs num_blocks >= 2 (block {SCRATCH_BLOCK} is scratch), "
                             f"got {num_blocks}")
        if window < 1 or block_size < 1:
            raise ValueError(f"SlidingBlockPool needs window >= 1 and block_size >= 1, got {window}, {block_size}")
        self.num_blocks, self.block_size, self.window = num_blocks, block_size, window
        self._free: deque[int] = deque(b for b in range(num_blocks) if b != SCRATCH_BLOCK)
        self._refs = [0] * num_blocks
        self._tables: dict[str, list[int]] = {}
        self._released: dict[str, int] = {}  # request -> leading table entries given back (now scratch)
        self.caching = False
        self._entries: dict[int, tuple[object, int]] = {}  # full block -> (its cache node, sliding block)
        self._key_of: dict[int, int] = {}                  # published sliding block -> full block
        self._idle: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced: least recent first
        self.released_blocks = 0  # blocks given back because they fell out of the window
        self.evicted_blocks = 0

    # -- sizes ---------------------------------------------------------------------------------------

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks a request can get now: free ones plus unreferenced cached ones (evicted on demand)."""
        return len(self._free) + len(self._idle)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def first_visible_block(self, position: int) -> int:
        """The first table index a query at `position` (or any later one) can read."""
        return max(0, position - self.window + 1) // self.block_size

    def max_blocks_per_request(self, chunk_tokens: int) -> int:
        """The most blocks a request holds while computing a chunk of chunk_tokens tokens: the ones
        covering the chunk and the W - 1 positions before it."""
        return -(-(self.window - 1 + chunk_tokens) // self.block_size) + 1

    def table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def num_held(self, request_id: str) -> int:
        """Blocks the request references now (not counting released, scratch entries)."""
        return sum(1 for b in self._tables.get(request_id, ()) if b != SCRATCH_BLOCK)

    # -- allocation ---------------------------------------------------------------------------------

    def lookup(self, full_block: int, node: object) -> int | None:
        """The cached sliding block published under full_block while it held `node`'s prefix, or None."""
        entry = self._entries.get(full_block)
        return entry[1] if entry is not None and entry[0] is node else None

    def admit_cost(self, hits: Sequence[int], first_index: int, num_tokens: int) -> int:
        """Blocks short for admit(...) with these arguments (0: it fits)."""
        covered = first_index + len(hits)
        needed = max(0, self.blocks_for(num_tokens) - covered)
        available = self.num_free_blocks - sum(1 for b in hits if self._refs[b] == 0)
        return max(0, needed - available)

    def admit(self, request_id: str, hits: Sequence[int], first_index: int, num_tokens: int) -> None:
        """Give a new request the cached `hits` at table indices first_index.. (scratch before them: out
        of the window of its first query), then new blocks up to num_tokens tokens. Check admit_cost first."""
        if request_id in self._tables:
            raise RuntimeError(f"SlidingBlockPool.admit: request {request_id!r} already holds blocks")
        if self.admit_cost(hits, first_index, num_tokens):
            raise RuntimeError(f"SlidingBlockPool.admit: too few free blocks for request {request_id!r}")
        for block in hits:
            if self._refs[block] == 0:
                del self._idle[block]
            self._refs[block] += 1
        table = [SCRATCH_BLOCK] * first_index + list(hits)
        table.extend(self._take() for _ in range(max(0, self.blocks_for(num_tokens) - len(table))))
        self._tables[request_id] = table
        self._released[request_id] = first_index

    def num_new_blocks_needed(self, request_id: str, num_tokens: int) -> int:
        return max(0, self.blocks_for(num_tokens) - len(self.table(request_id)))

    def holds(self, request_id: str, num_tokens: int, next_position: int) -> bool:
        """True when grow(request_id, num_tokens) and release_before(request_id, next_position) would
        change nothing (BlockPool.holds)."""
        table = self._tables.get(request_id)
        if table is None or len(table) * self.block_size < num_tokens:
            return False
        first_visible = max(0, next_position - self.window + 1) // self.block_size  # first_visible_block, inline
        return min(first_visible, len(table)) <= self._released[request_id]

    def grow(self, request_id: str, num_tokens: int) -> bool:
        """Enough blocks for num_tokens tokens; False (and no change) if too few are available."""
        needed = self.num_new_blocks_needed(request_id, num_tokens)
        if needed > self.num_free_blocks:
            return False
        if needed:
            table = self._tables.setdefault(request_id, [])
            self._released.setdefault(request_id, 0)
            table.extend(self._take() for _ in range(needed))
        return True

    def release_before(self, request_id: str, next_position: int) -> int:
        """Give back the request's blocks that no query at next_position or later can see; how many."""
        table = self._tables.get(request_id)
        if table is None:
            return 0
        done, end = self._released[request_id], min(self.first_visible_block(next_position), len(table))
        released = 0
        for i in range(done, end):
            block = table[i]
            if block != SCRATCH_BLOCK:
                self._unref(block)
                released += 1
            table[i] = SCRATCH_BLOCK
        if end > done:
            self._released[request_id] = end
        self.released_blocks += released
        return released

    def free(self, request_id: str) -> None:
        """Drop every reference request_id holds (finish, abort, preemption)."""
        self._released.pop(request_id, None)
        for block in reversed(self._tables.pop(request_id, [])):
            if block != SCRATCH_BLOCK:
                self._unref(block)

    def publish(self, request_id: str, index: int, full_block: int, node: object) -> None:
        """Publish the request's block at `index` under the full-attention block at the same index
        (just published, holding cache node `node`). A no-op if the block was already released or
        is itself a hit, or with caching off."""
        table = self._tables.get(request_id)
        if not self.caching or table is None or index >= len(table):
            return
        block = table[index]
        if block == SCRATCH_BLOCK or block in self._key_of:
            return
        old = self._entries.get(full_block)
        if old is not None:
            if old[0] is node:
                return  # this prefix already has its sliding block
            self._unpublish(old[1])  # published under a node since evicted: stale
        self._entries[full_block] = (node, block)
        self._key_of[block] = full_block

    def reset_prefix_cache(self) -> int:
        """Free every unreferenced cached block; the number freed."""
        freed = 0
        while self._idle:
            block, _ = self._idle.popitem(last=False)
            self._forget(block)
            self._free.append(block)
            freed += 1
        return freed

    def _take(self) -> int:
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._idle.popitem(last=False)  # least recently released cached block
            self._forget(block)
            self.evicted_blocks += 1
        self._refs[block] = 1
        return block

    def _unref(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] < 0:
            raise RuntimeError(f"SlidingBlockPool: block {block} released more often than referenced")
        if self._refs[block] == 0:
            if block in self._key_of:
                self._idle[block] = None
            else:
                self._free.append(block)

    def _unpublish(self, block: int) -> None:
        self._forget(block)
        if self._refs[block] == 0:
            del self._idle[block]
            self._free.append(block)

    def _forget(self, block: int) -> None:
        full_block = self._key_of.pop(block)
        if self._entries.get(full_block, (None, None))[1] == block:
            del self._entries[full_block]

    # -- checks -------------------------------------------------------------------------------------

    def check_writable(self, request_id: str, start: int, end: int) -> None:
        """Debug: positions [start, end) land in blocks only request_id holds and nobody published."""
        table = self._tables.get(request_id, [])
        for index in range(start // self.block_size, (end - 1) // self.block_size + 1):
            block = table[index] if index < len(table) else None
            if block is None or block == SCRATCH_BLOCK or self._refs[block] != 1 or block in self._key_of:
                raise RuntimeError(
                    f"request {request_id!r} would write positions [{start}, {end}) of sliding window {self.window} "
                    f"into table index {index} (block {block}), which is missing, released, shared or published")

    def check_consistency(self) -> None:
        """Debug: every usable block is in exactly one state, and reference counts match the tables."""
        counted = [0] * self.num_blocks
        for request_id, table in self._tables.items():
            held = [b for b in table if b != SCRATCH_BLOCK]
            if len(set(held)) != len(held):
                raise RuntimeError(f"request {request_id!r} holds a sliding block twice: {table}")
            if any(b != SCRATCH_BLOCK for b in table[:self._released[request_id]]):
                raise RuntimeError(f"request {request_id!r} still holds a released sliding block: {table}")
            for block in held:
                counted[block] += 1
        if counted != self._refs:
            bad = [b for b in range(self.num_blocks) if counted[b] != self._refs[b]]
            raise RuntimeError(f"SlidingBlockPool: reference counts of blocks {bad[:8]} do not match the tables")
        free, idle = set(self._free), set(self._idle)
        in_use = sum(1 for r in self._refs if r > 0)
        if len(free) != len(self._free) or SCRATCH_BLOCK in free | idle or free & idle:
            raise RuntimeError("SlidingBlockPool: the free list repeats a block, or a block is free and idle")
        if any(self._refs[b] for b in free | idle) or any(b not in self._key_of for b in idle):
            raise RuntimeError("SlidingBlockPool: a free or idle block is referenced, or an idle one is not cached")
        if any(self._entries.get(f, (None, None))[1] != b for b, f in self._key_of.items()):
            raise RuntimeError("SlidingBlockPool: the published blocks and their keys disagree")
        if len(free) + len(idle) + in_use != self.num_usable_blocks:
            raise RuntimeError(f"SlidingBlockPool: {len(free)} free + {len(idle)} cached + {in_use} in use != "
                               f"{self.num_usable_blocks} usable blocks")

    def stats(self) -> dict[str, int]:
        return {"blocks": self.num_blocks, "blocks_free": self.num_free_blocks,
                "cached_blocks": len(self._key_of), "released_out_of_window": self.released_blocks,
                "evicted_blocks": self.evicted_blocks}
