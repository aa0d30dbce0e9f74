"""`upload_step(...)`: a step's staged values from pinned host memory to the device in ONE kernel that
reads the host memory over the bus itself (zero-copy), and in the same launch the two small writes
a copy would need after it: new block-table entries and input ids that live on the device.

Why one kernel: between two decode graphs, a copy-engine transfer of the slab, an index_copy_ of
the new table entries and an index_select of the overlapped loop's input ids are three operations,
each with a hand-off of a few microseconds on an H100, for microseconds of work. Here:
- each program copies BLOCK slab elements;
- an input id below zero, in the ids region, is `-(slot + 1)`: the token waiting in `tokens[slot]` on
  the device (engine.core.step_loop's token slots), resolved as it is copied (no element is written twice, so
  the launch has no race);
- table entry i goes to `tables[index[i]] = value[i]`, index and value read from the host slab.

The kernel reads the host memory when it runs, as an asynchronous copy does: the caller must not
rewrite `host` before then (an event recorded after the launch, as for a copy).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from custom_ops.triton_common import cdiv, interpreting
from custom_ops.triton_launch import launch

BLOCK = 1024  # slab elements a program moves: 8 KiB of int64, 8 per thread at 4 warps


# One compiled variant for every step: no integer is specialized (Triton would otherwise compile a
# variant per class of each count and offset, equal to 1 or divisible by 16, and a serving engine met
# new classes mid-run: a compile on the step's path), and the two optional parts are runtime branches.
@triton.jit(do_not_specialize=["n", "ids_begin", "ids_end", "index_at", "value_at", "num_entries"])
def _upload_step_kernel(src_ptr, src32_ptr, dst_ptr, n, ids_begin, ids_end, tokens_ptr,
                        tables_ptr, index_at, value_at, num_entries, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    values = tl.load(src_ptr + offs, mask=mask, other=0)
    on_device = (offs >= ids_begin) & (offs < ids_end) & (values < 0)  # an empty range without device ids
    token = tl.load(tokens_ptr + (-values - 1), mask=mask & on_device, other=0)
    tl.store(dst_ptr + offs, tl.where(on_device, token, values), mask=mask)
    if tl.program_id(0) * BLOCK < num_entries:
        entry_mask = offs < num_entries
        index = tl.load(src_ptr + index_at + offs, mask=entry_mask, other=0)
        value = tl.load(src32_ptr + value_at + offs, mask=entry_mask, other=0)
        tl.store(tables_ptr + index, value, mask=entry_mask)


def upload_step(host: torch.Tensor, device: torch.Tensor, ids: tuple[int, int] | None = None,
                tokens: torch.Tensor | None = None, tables: torch.Tensor | None = None,
                entries: tuple[int, int, int] = (0, 0, 0), check: bool = True) -> None:
    """device[:] = host, queued on the current stream, with host an int64 pinned CPU tensor and device an
    int64 CUDA tensor of its size (in Triton's interpreter, any CPU tensors).

    `ids` (begin, end): the slab range of the input ids; a negative id there, -(slot + 1), becomes
    tokens[slot] (int64, on the device). `tables` (flat int32 on the device) and `entries`
    (index_at, value_at, count): tables[host[index_at + i]] = host.view(int32)[value_at + i] for
    i < count, in the same launch. `check=False`: the caller made host and device itself and they cannot
    have changed (engine.worker.input_buffers, every step: `is_pinned` alone asks the driver, ~6 us)."""
    if check:
        _check(host, device, ids, tokens, tables, entries)
    n = host.numel()
    if n == 0:
        return
    index_at, value_at, count = entries
    begin, end = ids if ids is not None else (0, 0)
    launch(_upload_step_kernel, (cdiv(n, BLOCK),),
           (host, host.view(torch.int32), device, n, begin, end, device if tokens is None else tokens,
            device.view(torch.int32) if tables is None else tables, index_at, value_at, count),
           dict(BLOCK=BLOCK, num_warps=4))


def _check(host: torch.Tensor, device: torch.Tensor, ids: tuple[int, int] | None, tokens: torch.Tensor | None,
           tables: torch.Tensor | None, entries: tuple[int, int, int]) -> None:
    if host.dtype != torch.int64 or device.dtype != torch.int64 or host.shape != device.shape or host.dim() != 1:
        raise ValueError(f"upload_step: host {tuple(host.shape)} {host.dtype} and device {tuple(device.shape)} "
                         f"{device.dtype} must be one-dimensional int64 of one size")
    if not (host.is_contiguous() and device.is_contiguous()):
        raise ValueError("upload_step needs contiguous host and device tensors")
    if not interpreting() and (not device.is_cuda or host.is_cuda or not host.is_pinned()):
        raise ValueError(f"upload_step needs a pinned CPU host tensor and a CUDA device tensor, got host on "
                         f"{host.device} (pinned: {host.is_pinned()}) and device on {device.device}")
    if (ids is None) != (tokens is None):
        raise ValueError("upload_step: `ids` and `tokens` go together (the id range and the tokens it reads)")
    if tokens is not None and (tokens.dtype != torch.int64 or not tokens.is_contiguous()):
        raise ValueError(f"upload_step: tokens must be contiguous int64, got {tokens.dtype}")
    index_at, value_at, count = entries
    n = host.numel()
    if tables is not None and tables.dtype != torch.int32:
        raise ValueError(f"upload_step: tables must be flat int32, got {tables.dtype}")
    if count and (tables is None or index_at + count > n or value_at + count > 2 * n):
        raise ValueError(f"upload_step: {count} table entries need flat int32 tables and index / value inside "
                         f"the {n}-element slab (index at {index_at}, value at {value_at} as int32)")
