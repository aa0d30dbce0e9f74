"""Per-step attention metadata and the paged KV cache layout.

KV cache layout, one tensor per attention layer: ``[2, num_blocks, block_size, num_kv_heads,
head_dim]`` (index 0 keys, 1 values). A token's slot is ``block * block_size + offset``, so
``cache[0].view(-1, Hkv, D)[slot]`` is its key. Each block row is contiguous per token, which lets
the store write one token with one contiguous ``Hkv * D`` vector and lets the attention kernels load
a ``[block_size, D]`` tile per kv head with a fixed stride.

Block 0 is the scratch block by convention of the engine: padding rows write their K/V there and
padded decode rows read only it, so a captured scatter never touches a live sequence.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

SCRATCH_BLOCK = 0


def allocate_kv_cache(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
    dtype: torch.dtype, device: torch.device | str,
) -> torch.Tensor:
    return torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)


@dataclass
class AttentionMetadata:
    """Where the step's tokens go in the KV cache and which tokens each sequence attends to.

    Tokens are flat: sequence ``i`` owns query rows ``query_start_loc[i]:query_start_loc[i+1]``;
    rows from ``num_actual_tokens`` on are padding (they write the scratch slot, read nothing real).
    ``seq_lens[i]`` counts the sequence's cached tokens plus its new ones, so its new tokens sit at
    positions ``seq_lens[i] - query_len_i ... seq_lens[i] - 1``.
    """

    slot_mapping: torch.Tensor     # [T] int64, one slot per token (padding -> a scratch slot)
    query_start_loc: torch.Tensor  # [B + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor         # [B] int32, cached + new tokens per sequence
    block_tables: torch.Tensor     # [B, max_blocks_per_seq] int32, block ids per sequence
    num_actual_tokens: int         # real tokens; rows beyond are padding
    max_query_len: int             # host-side bound, sizes launch grids
    max_seq_len: int               # host-side bound on seq_lens (a graph uses max_model_len here)
    is_uniform_decode: bool = False  # every sequence has exactly one query token
    # The step's real token count is on the device only (query_start_loc[-1]); num_actual_tokens is
    # then the padded count. For a graph that serves any step up to its size (engine.worker.mixed_graphs):
    # sequences past the step's own have no query rows, and the attention launch zeroes the rows from
    # query_start_loc[-1] on, reading where they start when it runs.
    real_tokens_on_device: bool = False
    # Several rows of a uniform decode step belong to one sequence (speculative decoding's verify
    # step, each proposed token a row: engine.worker.model_runner): row j attends to the new keys of
    # rows before it, so every new K/V is stored before any row attends (no store fused into the
    # decode kernel, whose programs are unordered).
    store_first: bool = False

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])
