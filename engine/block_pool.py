"""BlockPool: which KV cache blocks are free, and which blocks each request owns.

Pure bookkeeping on the host (no tensors), so the scheduler can plan a step without touching the
GPU. Block 0 (custom_ops.SCRATCH_BLOCK) is never handed out: padding rows of a graph write their
K/V there and read only it, so a captured scatter can never touch a live sequence.
"""
from __future__ import annotations

from collections import deque

from custom_ops import SCRATCH_BLOCK


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"BlockPool needs num_blocks >= 2 (block {SCRATCH_BLOCK} is scratch), got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"BlockPool needs block_size >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(b for b in range(num_blocks) if b != SCRATCH_BLOCK)
        self._owned: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, request_id: str) -> list[int]:
        return self._owned.get(request_id, [])

    def num_new_blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """Blocks to add so that request_id holds num_tokens tokens."""
        return max(0, self.blocks_for(num_tokens) - len(self.block_table(request_id)))

    def grow(self, request_id: str, num_tokens: int) -> bool:
        """Give request_id enough blocks for num_tokens tokens; False (and no change) if too few are free."""
        needed = self.num_new_blocks_needed(request_id, num_tokens)
        if needed > len(self._free):
            return False
        if needed:
            self._owned.setdefault(request_id, []).extend(self._free.popleft() for _ in range(needed))
        return True

    def free(self, request_id: str) -> int:
        """Return every block of request_id to the pool; the number freed."""
        blocks = self._owned.pop(request_id, [])
        self._free.extend(blocks)
        return len(blocks)

    def slot(self, request_id: str, position: int) -> int:
        """The cache slot (block * block_size + offset) of the token at `position` of request_id."""
        table = self._owned[request_id]
        return table[position // self.block_size] * self.block_size + position % self.block_size
