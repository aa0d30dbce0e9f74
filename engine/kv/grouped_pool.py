"""GroupedBlockPool: the KV groups' pools (engine.kv.groups) behind BlockPool's interface.

Admission and growth succeed only if every group has the blocks (and then change every group),
preemption frees every group.

Prefix hits (vLLM's rule for hybrid models): a hit of L tokens is usable only if, in every sliding
group, the blocks covering the W - 1 positions before L are still cached (the first recomputed
query at L reads them). `match_prefix` takes the full group's longest hit and shortens it to the
longest L whose window blocks are all cached; outputs with and without prefix caching are the same
because a hit is only ever K/V computed from the same prefix.
"""
from __future__ import annotations

from typing import Sequence

from engine.kv.block_pool import BlockPool, debug_checks_from_env
from engine.kv.groups import KVGroup, blocks_per_sequence
from engine.kv.sliding_pool import SlidingBlockPool


class GroupedBlockPool:
    """Several groups' pools behind BlockPool's interface (the scheduler's and the runner's view)."""

    def __init__(self, full: BlockPool, sliding: Sequence[SlidingBlockPool]) -> None:
        if any(s.block_size != full.block_size for s in sliding):
            raise ValueError("every KV group needs the same block_size")
        self.full, self.sliding = full, list(sliding)
        self.block_size = full.block_size
        self.debug_checks = full.debug_checks

    # -- what the scheduler reads -------------------------------------------------------------------

    @property
    def cache(self):
        return self.full.cache

    @property
    def num_blocks(self) -> int:
        return self.full.num_blocks

    @property
    def num_usable_blocks(self) -> int:
        return self.full.num_usable_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.full.num_free_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return self.full.blocks_for(num_tokens)

    def block_table(self, request_id: str) -> list[int]:
        return self.full.block_table(request_id)

    def tables(self, request_id: str) -> list[list[int]]:
        return [self.full.block_table(request_id)] + [s.table(request_id) for s in self.sliding]

    def tables_by_group(self, request_ids: list[str]) -> list[list[list[int]]]:
        """Per KV group, the block table of each of request_ids (a decode step's tables, group by group)."""
        return [self.full.tables_by_group(request_ids)[0]] + [[s.table(r) for r in request_ids] for s in self.sliding]

    def enable_prefix_caching(self) -> None:
        self.full.enable_prefix_caching()
        for pool in self.sliding:
            pool.caching = True

    def check_fits(self, max_model_len: int, max_num_batched_tokens: int) -> None:
        """ValueError unless one request of max_model_len fits every group (chunks up to the token budget)."""
        for pool in self.sliding:
            need = min(pool.blocks_for(max_model_len), pool.max_blocks_per_request(max_num_batched_tokens))
            if need > pool.num_usable_blocks:
                raise ValueError(
                    f"the sliding-window (W={pool.window}) KV pool has {pool.num_usable_blocks} usable blocks, fewer "
                    f"than one request needs ({need}: the window plus a chunk of up to max_num_batched_tokens="
                    f"{max_num_batched_tokens}): raise num_gpu_blocks / kv_memory_fraction")

    # -- allocation ---------------------------------------------------------------------------------

    def _window_hits(self, cached: Sequence[int]) -> list[tuple[int, list[int]] | None]:
        """Per sliding group: (first table index, cached blocks from it to len(cached)) for a hit of
        len(cached) full blocks, or None if one of those is not cached."""
        out: list[tuple[int, list[int]] | None] = []
        num_tokens = len(cached) * self.block_size
        for pool in self.sliding:
            first = pool.first_visible_block(num_tokens)
            blocks = [pool.lookup(f, self.full.cache.node(f)) for f in cached[first:]]
            out.append(None if None in blocks else (first, blocks))
        return out

    def match_prefix(self, token_ids: Sequence[int]) -> list[int]:
        """The full group's longest hit, shortened until every sliding group holds its window blocks."""
        cached = self.full.match_prefix(token_ids)
        if not cached or not self.sliding:
            return cached
        nodes = [self.full.cache.node(f) for f in cached]
        n, i = len(cached), len(cached) - 1  # candidate hit length; the next index to check, downwards
        while n > 0:
            first = min(p.first_visible_block(n * self.block_size) for p in self.sliding)
            if i < first:
                break
            ok = all(p.lookup(cached[i], nodes[i]) is not None
                     for p in self.sliding if i >= p.first_visible_block(n * self.block_size))
            if ok:
                i -= 1
            else:
                # Index i is in the window of every hit length from i + 1 up to n (the window start
                # only grows with L): the longest candidate left is i.
                n, i = i, i - 1
        return cached[:n]

    def admit(self, request_id: str, cached_blocks: list[int], num_tokens: int) -> bool:
        """BlockPool.admit for every group; False (and no change) if any group is short."""
        hits = self._window_hits(cached_blocks) if cached_blocks else [(0, [])] * len(self.sliding)
        if None in hits:
            raise RuntimeError(f"request {request_id!r}: a prefix hit without its window's sliding blocks "
                               "(use GroupedBlockPool.match_prefix)")
        if any(p.admit_cost(h[1], h[0], num_tokens) for p, h in zip(self.sliding, hits)):
            return False
        if not self.full.admit(request_id, cached_blocks, num_tokens):
            return False
        for pool, (first, blocks) in zip(self.sliding, hits):
            pool.admit(request_id, blocks, first, num_tokens)
        return True

    def grow(self, request_id: str, num_tokens: int) -> bool:
        if self.full.num_new_blocks_needed(request_id, num_tokens) > self.full.num_free_blocks:
            return False
        if any(p.num_new_blocks_needed(request_id, num_tokens) > p.num_free_blocks for p in self.sliding):
            return False
        self.full.grow(request_id, num_tokens)
        for pool in self.sliding:
            pool.grow(request_id, num_tokens)
        return True

    def release_before(self, request_id: str, next_position: int) -> int:
        """Give back the sliding blocks no query at next_position or later can see; how many."""
        return sum(p.release_before(request_id, next_position) for p in self.sliding)

    def holds(self, request_id: str, num_tokens: int, next_position: int) -> bool:
        """BlockPool.holds for every group."""
        if not self.full.holds(request_id, num_tokens, next_position):
            return False
        for pool in self.sliding:  # (a loop, not all() over a generator: once per running request a step)
            if not pool.holds(request_id, num_tokens, next_position):
                return False
        return True

    def free(self, request_id: str) -> int:
        for pool in self.sliding:
            pool.free(request_id)
        return self.full.free(request_id)

    def publish(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> range:
        published = self.full.publish(request_id, token_ids, num_computed_tokens)
        table = self.full.block_table(request_id)
        for index in published:
            node = self.full.cache.node(table[index])
            for pool in self.sliding:
                pool.publish(request_id, index, table[index], node)
        return published

    def reset_prefix_cache(self) -> int:
        return self.full.reset_prefix_cache() + sum(p.reset_prefix_cache() for p in self.sliding)

    # -- queries and checks -------------------------------------------------------------------------

    def slot(self, request_id: str, position: int) -> int:
        return self.full.slot(request_id, position)

    def prefix_cache_stats(self) -> dict[str, float | int | bool]:
        """The full group's hits; cached and evicted blocks counted over every group."""
        stats = self.full.prefix_cache_stats()
        if stats["enabled"]:
            for pool in self.sliding:
                own = pool.stats()
                stats["cached_blocks"] += own["cached_blocks"]
                stats["evicted_blocks"] += own["evicted_blocks"]
        return stats

    def check_writable(self, request_id: str, start: int, end: int) -> None:
        self.full.check_writable(request_id, start, end)
        for pool in self.sliding:
            pool.check_writable(request_id, start, end)

    def check_consistency(self) -> None:
        self.full.check_consistency()
        for pool in self.sliding:
            pool.check_consistency()


def make_block_pool(groups: Sequence[KVGroup], blocks: Sequence[int], block_size: int,
                    debug_checks: bool | None = None) -> BlockPool | GroupedBlockPool:
    """One BlockPool for one group; a GroupedBlockPool (full group first) otherwise."""
    debug = debug_checks_from_env() if debug_checks is None else debug_checks
    full = BlockPool(blocks[0], block_size, debug_checks=debug)
    if len(groups) == 1:
        return full
    return GroupedBlockPool(full, [SlidingBlockPool(n, block_size, g.sliding_window)
                                   for g, n in zip(groups[1:], blocks[1:])])


def group_stats(groups: Sequence[KVGroup], bytes_per_block: Sequence[int], pool: BlockPool | GroupedBlockPool,
                max_model_len: int, block_size: int) -> list[dict[str, object]]:
    """Per group: its layers, blocks, free blocks, bytes per block, and how many sequences of
    max_model_len its pool holds (LLM.stats()['kv_groups'])."""
    pools = [pool] if isinstance(pool, BlockPool) else [pool.full, *pool.sliding]
    out = []
    for group, size, p in zip(groups, bytes_per_block, pools):
        per_seq = blocks_per_sequence(group, max_model_len, block_size)
        out.append({"kind": group.kind, "num_layers": len(group.layer_names), "blocks": p.num_blocks,
                    "blocks_free": p.num_free_blocks, "bytes_per_block": size,
                    "blocks_per_max_len_sequence": per_seq,
                    "max_len_sequences": p.num_usable_blocks // per_seq})
    return out
