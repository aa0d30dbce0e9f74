"""PrefixCache: full KV blocks published by content, so requests that share a prompt prefix share them.

A published block is keyed by (its parent's block id, its block_size token ids), where the parent is
the published block holding the previous block_size tokens of the same prefix (ROOT for the first
block). So a key names the whole prefix, not only the block's own tokens: a chained key, as vLLM's
chained block hash, with the parent's block id standing in for the parent's hash. That is sound
because a block is evicted only when no published block names it as its parent (leaves first): while
a key exists, its parent id still holds the same prefix.

Why a dict of chained keys and not a radix tree over tokens (mini-sglang): the unit of sharing is a
full block (a partial block is never shared, see the invariant below), and a tree with one edge per
block is exactly this dict: one lookup per block, no node splitting, no token-level walk. Why no
strong hash: the dict compares the token tuple on every hit, so a collision of Python's (predictable)
tuple hash can only cost a probe, never hand out another prefix's K/V (the cache-poisoning risk that
moved vLLM to sha256 does not exist when keys are compared exactly).

Invariant (no copy-on-write): only full blocks whose K/V are all computed are published, and a
request writes only at positions >= its computed tokens, which lie past its full blocks. So a
published block is never written again, and sharing it needs no copy. BlockPool.check_writable checks
this under debug checks. A published block holds its tokens' K/V for every layer: sliding-window
layers of a model with full-attention layers too have their own pool (engine.kv.sliding_pool), whose
blocks are published under the full block at the same index; with one pool (one kind of layer), every
layer keeps all of a sequence's blocks, so sharing is safe for them.

Eviction: a published block nobody references is kept until a new block is needed; then the least
recently released leaf goes first (a heap on the release tick). A parent becomes a leaf when its last
child is evicted and re-enters the heap with its own, later, tick: a block never goes before its
descendants.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Sequence

ROOT = -1  # the parent of a prefix's first block


@dataclass(slots=True)  # one per cached block: slots make creating and reading it cheaper
class _Node:
    key: tuple[int, tuple[int, ...]]
    parent: int
    num_children: int = 0
    referenced: bool = True   # held by >= 1 request (a block is published by the request computing it)
    released_tick: int = 0    # when it last became unreferenced: the LRU order


class PrefixCache:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._block_of: dict[tuple[int, tuple[int, ...]], int] = {}
        self._nodes: dict[int, _Node] = {}
        self._evictable: list[tuple[int, int]] = []  # (released_tick, block); stale entries are skipped
        self.num_unreferenced = 0
        self.query_tokens = 0
        self.hit_tokens = 0
        self.evicted_blocks = 0

    @property
    def num_cached_blocks(self) -> int:
        return len(self._nodes)

    def is_cached(self, block: int) -> bool:
        return block in self._nodes

    def node(self, block: int) -> object | None:
        """The cache entry of a published block (a new object each time a block is published), or None."""
        return self._nodes.get(block)

    def match(self, token_ids: Sequence[int], max_blocks: int) -> list[int]:
        """The published blocks holding the longest run of whole blocks of token_ids (at most max_blocks)."""
        size, parent, blocks = self.block_size, ROOT, []
        for i in range(max_blocks):
            block = self._block_of.get((parent, tuple(token_ids[i * size:(i + 1) * size])))
            if block is None:
                break
            blocks.append(block)
            parent = block
        return blocks

    def count_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.query_tokens += num_query_tokens
        self.hit_tokens += num_hit_tokens

    def publish(self, parent: int, tokens: tuple[int, ...], block: int) -> bool:
        """Publish a referenced, fully computed block; False if this prefix is already published elsewhere."""
        key = (parent, tokens)
        if self._block_of.setdefault(key, block) != block:  # one hash of the key, not two
            return False
        self._nodes[block] = _Node(key, parent)
        if parent != ROOT:
            self._nodes[parent].num_children += 1
        return True

    def referenced(self, block: int) -> None:
        """block (published) got its first reference: it is no longer evictable."""
        node = self._nodes[block]
        node.referenced = True
        self.num_unreferenced -= 1

    def released(self, block: int, tick: int) -> None:
        """block (published) lost its last reference at `tick`: it stays cached, evictable once a leaf."""
        node = self._nodes[block]
        node.referenced, node.released_tick = False, tick
        self.num_unreferenced += 1
        if node.num_children == 0:
            self._push(block, node)

    def evict(self) -> int:
        """Unpublish the least recently released unreferenced leaf; its block id (now free)."""
        while self._evictable:
            tick, block = heapq.heappop(self._evictable)
            node = self._nodes.get(block)
            if node is None or node.referenced or node.num_children or node.released_tick != tick:
                continue  # stale: evicted, referenced again, released again later, or gained a child
            del self._nodes[block], self._block_of[node.key]
            self.num_unreferenced -= 1
            self.evicted_blocks += 1
            if node.parent != ROOT:
                parent = self._nodes[node.parent]
                parent.num_children -= 1
                if parent.num_children == 0 and not parent.referenced:
                    self._push(node.parent, parent)
            return block
        # Every unreferenced published block has only unreferenced descendants (BlockPool keeps a
        # request's published blocks a prefix of its table), so a leaf always exists when one is counted.
        raise RuntimeError(f"prefix cache: {self.num_unreferenced} unreferenced blocks counted but none "
                           "is an evictable leaf (the cache's invariant is broken)")

    def _push(self, block: int, node: _Node) -> None:
        heapq.heappush(self._evictable, (node.released_tick, block))
        if len(self._evictable) > 4 * len(self._nodes) + 64:  # drop the stale entries now and then
            self._evictable = [(n.released_tick, b) for b, n in self._nodes.items()
                               if not n.referenced and n.num_children == 0]
            heapq.heapify(self._evictable)

    def stats(self) -> dict[str, float | int]:
        return {
            "query_tokens": self.query_tokens,
            "hit_tokens": self.hit_tokens,
            "hit_rate": self.hit_tokens / self.query_tokens if self.query_tokens else 0.0,
            "cached_blocks": self.num_cached_blocks,
            "evicted_blocks": self.evicted_blocks,
        }

    def check(self, refs: Sequence[int]) -> None:
        """Debug: the tree is consistent with itself and with the pool's reference counts."""
        children: dict[int, int] = {}
        for block, node in self._nodes.items():
            if self._block_of.get(node.key) != block:
                raise RuntimeError(f"prefix cache: block {block} is not under its own key")
            if node.parent != ROOT:
                if node.parent not in self._nodes:
                    raise RuntimeError(f"prefix cache: block {block}'s parent {node.parent} is not cached")
                children[node.parent] = children.get(node.parent, 0) + 1
            if node.referenced != (refs[block] > 0):
                raise RuntimeError(f"prefix cache: block {block} referenced={node.referenced} but "
                                   f"{refs[block]} references")
            if node.referenced and node.parent != ROOT and not self._nodes[node.parent].referenced:
                raise RuntimeError(f"prefix cache: block {block} is referenced but its parent {node.parent} "
                                   "is not (it could be evicted before its descendant)")
        for block, node in self._nodes.items():
            if node.num_children != children.get(block, 0):
                raise RuntimeError(f"prefix cache: block {block} counts {node.num_children} children, "
                                   f"has {children.get(block, 0)}")
        unreferenced = sum(1 for n in self._nodes.values() if not n.referenced)
        if unreferenced != self.num_unreferenced:
            raise RuntimeError(f"prefix cache: {self.num_unreferenced} unreferenced blocks counted, "
                               f"{unreferenced} found")
