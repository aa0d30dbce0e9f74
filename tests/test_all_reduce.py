"""infer::all_reduce on the CPU: the choice of kernel per message, and the op as a traced model sees it
(the sums themselves on 2 GPUs: test_all_reduce_gpu)."""
from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

from custom_ops import all_reduce


class _Group:
    group_name = "test-group"

    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


def _comm(world: int = 2) -> all_reduce.SymmetricAllReduce:
    return all_reduce.SymmetricAllReduce(_Group(world), torch.empty(1 << 20, dtype=torch.uint8), 64 << 10, 512 << 10)


@pytest.mark.parametrize("shape, dtype, kind", [
    ((1, 2048), torch.bfloat16, "one_shot"),           # 4 KB: a decode row
    ((16, 2048), torch.bfloat16, "one_shot"),          # 64 KB: the one-shot bound, inclusive
    ((17, 2048), torch.bfloat16, "two_shot"),
    ((64, 2048), torch.float32, "two_shot"),           # 512 KB: the two-shot bound, inclusive
    ((65, 2048), torch.float32, "nccl"),               # past it
    ((1, 2048), torch.float16, "nccl"),                # the symmetric kernels take bf16 and float32 only
    ((1, 7), torch.bfloat16, "nccl"),                  # 14 bytes: not a whole 16-byte vector
])
def test_the_kernel_is_chosen_by_size_dtype_and_alignment(shape, dtype, kind):
    assert _comm().kind(torch.empty(shape, dtype=dtype)) == kind


def test_two_shot_needs_a_16_byte_share_per_rank_and_the_buffer_bounds_both():
    comm = _comm(world=4)
    assert comm.kind(torch.empty(20, 2048 + 8, dtype=torch.bfloat16)) == "two_shot"   # 82,240 B: 20,560 a rank
    assert comm.kind(torch.empty(17, 2048 + 8, dtype=torch.bfloat16)) == "nccl"       # 69,904 B: 17,476 a rank
    small = all_reduce.SymmetricAllReduce(_Group(2), torch.empty(1024, dtype=torch.uint8), 64 << 10, 512 << 10)
    assert small.kind(torch.empty(1, 512, dtype=torch.bfloat16)) == "one_shot"        # 1 KB fits the buffer
    assert small.kind(torch.empty(1, 520, dtype=torch.bfloat16)) == "nccl"


def test_the_op_without_a_registered_buffer_is_the_groups_plain_all_reduce_and_traces_as_one_node():
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=30))
    try:
        name = dist.group.WORLD.group_name
        assert all_reduce.registered(name) is None
        x = torch.randn(3, 8)
        torch.testing.assert_close(torch.ops.infer.all_reduce(x, name), x)  # one rank: the sum is x

        def fn(t: torch.Tensor) -> torch.Tensor:
            return torch.ops.infer.all_reduce(t * 2, name) + 1

        compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
        torch.testing.assert_close(compiled(x), x * 2 + 1)
    finally:
        dist.destroy_process_group()
