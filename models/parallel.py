"""Tensor parallelism inside the models: which slice of each weight a rank holds, and the collectives.

Megatron's split, as vLLM and SGLang use it: `qkv_proj` and `gate_up_proj` are column-parallel (each
rank holds its share of the attention heads and of the intermediate size), `o_proj` and `down_proj`
are row-parallel (each rank multiplies its share of the input features and one all-reduce sums the
partial products), the embedding and LM head are vocab-parallel (each rank holds a contiguous range
of token rows). Norms, rope tables and biases of row-parallel layers are replicated.

The collectives are torch's functional collectives (`_c10d_functional.all_reduce` / `all_gather`):
out-of-place and traceable, so Dynamo keeps them inside the compiled pieces (they are not split
points) and a CUDA graph around a piece or a whole decode step records the NCCL kernel. With one
rank every collective is the identity and no process group is needed, so the single-GPU model is
the same code.

With `symmetric_all_reduce` (the engine sets it on CUDA once it has registered a
custom_ops.all_reduce.SymmetricAllReduce for the group) the all-reduce is the custom op
`infer::all_reduce` instead: symmetric-memory kernels for small messages, NCCL above the crossover.

`models` does not create process groups: the engine makes one and hands it in as a `TensorParallel`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from models.errors import UnsupportedConfigError


@dataclass(frozen=True)
class TensorParallel:
    """A rank's place in its tensor-parallel group and the collectives the layers call; the default
    (one rank, no group) makes every collective the identity."""
    rank: int = 0
    world_size: int = 1
    group: Any = field(default=None, compare=False)  # torch.distributed ProcessGroup when world_size > 1
    symmetric_all_reduce: bool = False  # all_reduce by infer::all_reduce (custom_ops.all_reduce)

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"tensor-parallel rank {self.rank} is outside world size {self.world_size}")
        if self.world_size > 1 and self.group is None:
            raise ValueError(f"tensor parallelism over {self.world_size} ranks needs a process group")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of x over the ranks (out-of-place)."""
        if self.world_size == 1:
            return x
        if self.symmetric_all_reduce:
            return torch.ops.infer.all_reduce(x, self.group.group_name)
        from torch.distributed import _functional_collectives as funcol
        return funcol.all_reduce(x, "sum", self.group)

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, C] on every rank -> [N, world_size * C], rank r's columns at r * C."""
        if self.world_size == 1:
            return x
        from torch.distributed import _functional_collectives as funcol
        rows, cols = x.shape
        # all_gather_single is the newer name (torch 2.13 deprecates all_gather_tensor for it)
        gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
        gathered = gather(x.contiguous(), 0, self.group)  # [world * N, C]
        return gathered.view(self.world_size, rows, cols).permute(1, 0, 2).reshape(rows, self.world_size * cols)


SINGLE = TensorParallel()


@dataclass(frozen=True)
class HeadSplit:
    """How a rank's attention heads map onto the checkpoint's: q heads are split evenly; KV heads are
    split evenly when there are at least as many as ranks, and otherwise each rank keeps the one KV
    head its q heads read (replicated across world_size // num_kv_heads ranks)."""
    num_heads: int          # q heads on this rank
    num_kv_heads: int       # KV heads on this rank
    q_start: int            # first q head (checkpoint index)
    kv_start: int           # first KV head (checkpoint index)

    @classmethod
    def of(cls, num_heads: int, num_kv_heads: int, tp: TensorParallel) -> HeadSplit:
        n = tp.world_size
        check_divides(n, num_heads, "num_attention_heads")
        if n <= num_kv_heads:
            check_divides(n, num_kv_heads, "num_key_value_heads")
            local_kv = num_kv_heads // n
            kv_start = tp.rank * local_kv
        else:
            if n % num_kv_heads:
                raise UnsupportedConfigError(
                    f"tensor_parallel_size {n} exceeds num_key_value_heads {num_kv_heads} and is not a "
                    "multiple of it, so the KV heads cannot be replicated evenly across ranks")
            local_kv = 1
            kv_start = tp.rank // (n // num_kv_heads)
        return cls(num_heads // n, local_kv, tp.rank * (num_heads // n), kv_start)


def check_divides(world_size: int, size: int, what: str) -> None:
    if size % world_size:
        raise UnsupportedConfigError(
            f"tensor_parallel_size {world_size} does not divide {what} {size}: every rank must hold "
            f"the same share")


@dataclass(frozen=True)
class Part:
    """One checkpoint tensor's share in a (possibly fused) weight: it fills the next `rows` rows of
    the weight from checkpoint rows [start, start + rows) of a tensor with `full_rows` rows.
    `name` replaces the module's own name in the checkpoint ("q_proj" inside `qkv_proj`); None keeps it."""
    name: str | None
    rows: int
    full_rows: int
    start: int


@dataclass(frozen=True)
class ShardSlice:
    """The part of a checkpoint tensor (of `full_shape`) that one slot holds: rows or columns
    [start, stop) along `dim`, or the whole tensor when dim is None."""
    full_shape: tuple[int, ...]
    dim: int | None = None
    start: int = 0
    stop: int = 0

    def index(self) -> tuple[slice, ...]:
        if self.dim is None:
            return (slice(None),)
        return (slice(None),) * self.dim + (slice(self.start, self.stop),)


def vocab_range(vocab_size: int, tp: TensorParallel) -> tuple[int, int, int]:
    """(first token row, rows with real tokens, rows allocated) of this rank's vocabulary shard.

    Every rank allocates ceil(V / N) rows so the gathered logits have one shape; the last rank's
    rows past V are zero and their logits are cut off after the gather."""
    per_rank = -(-vocab_size // tp.world_size)
    start = min(tp.rank * per_rank, vocab_size)
    return start, min(per_rank, vocab_size - start), per_rank


def vocab_parallel_embedding(ids: torch.Tensor, weight: torch.Tensor, start: int, tp: TensorParallel) -> torch.Tensor:
    """Embedding rows of ids from a shard holding rows [start, start + len(weight)): each rank
    contributes its own rows and zeros elsewhere, and the all-reduce sums them (exact: one term is
    non-zero)."""
    if tp.world_size == 1:
        return F.embedding(ids, weight)
    local = ids - start
    inside = (local >= 0) & (local < weight.shape[0])
    h = F.embedding(torch.where(inside, local, torch.zeros_like(local)), weight)
    return tp.all_reduce(h * inside.unsqueeze(-1).to(h.dtype))
