"""Triton argmax over the last dimension of [N, V] rows in ONE launch (the sampler's greedy token).

At the sampler's shapes (V = 128,256 .. 262,144, N = 1..64) the data is small (0.5 MB for one bf16 row
of 262,144) and torch's reduction is bound by launch and occupancy, not bandwidth: on an H100, between
decode-graph replays, it took 8.9 us of GPU time for that one row and 30 us for 64 rows. Here the grid
is ``(N, num_chunks)``: each program reads one chunk of a row in a single load and reduces it to its
maximum and the first index of it, packed in one int64 key (`_argmax_key`); it stores the key in the
row's partials and bumps the row's arrival counter, and the program that arrives last reduces the
row's keys into ``out`` and resets the counter to 0 for the next launch (as the decode attention
kernel does, custom_ops.triton_decode). No second kernel, no host sync.

The result is torch's ``x.argmax(dim=-1)``: values are compared in float32 (exact for every input
dtype), a NaN ranks above every number, and among equal values (equal NaNs too) the lowest index
wins. Padding lanes past V read -inf with indices >= V, so they lose every tie to a real element: an
all -inf row gives 0.

The grid and every constexpr depend only on (N, V, dtype), so a launch is CUDA-graph capturable; the
partials and counters are bounded workspaces per device (custom_ops.workspace), reused by every launch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from custom_ops.triton_common import cdiv, interpreting, next_power_of_2, sm_count
from custom_ops.triton_launch import launch
from custom_ops.workspace import Workspace

ROW_ARGMAX_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MIN_CHUNK = 1024   # elements one program reads: 2 KiB of bf16, one 16-byte load per thread at 4 warps
MAX_CHUNK = 8192   # 16 KiB of bf16: past this a batch has enough programs without longer ones
MAX_MERGE_BLOCK = 256  # keys the last program loads per step of its merge (one step at N = 1 on an H100)
_KEY_PAD = tl.constexpr(-(2**63))  # below every key: a partial past num_chunks never wins


@triton.jit
def _argmax_key(x, index):
    """An int64 whose order is torch's argmax preference for (float32 x, int32 index >= 0): a NaN
    above every number, then the larger value, then the LOWER index. The high half is x's bits made
    to order as signed ints (negative floats' magnitude bits flipped); the low half is
    0x7FFFFFFF - index. So a chunk, and a row's chunks, reduce with one integer max: not two
    reductions (the float max, then the lowest index holding it), nor a tl.reduce over (value, index)
    with a custom combine, which the interpreter runs element by element (0.25 s a program)."""
    x = tl.where(x == 0.0, 0.0, x)  # -0.0 == 0.0: one key, so the lower index wins, as in torch
    bits = x.to(tl.int32, bitcast=True)
    bits = tl.where(x != x, 0x7FC00000, bits)  # every NaN one key, above +inf's 0x7F800000
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return (ordered.to(tl.int64) << 32) | (0x7FFFFFFF - index).to(tl.int64)


@triton.jit
def _key_index(key):
    """The index an _argmax_key holds (its low half, which the int32 cast keeps)."""
    return (0x7FFFFFFF - key.to(tl.int32)).to(tl.int64)


@triton.jit
def _row_argmax_kernel(
    x_ptr, out_ptr, part_ptr, arrivals_ptr, stride_x, vocab, num_chunks,
    CHUNK: tl.constexpr, BLOCK_CHUNKS: tl.constexpr, SPLIT: tl.constexpr,
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    # Padding lanes read -inf with indices >= vocab: they lose every tie to a real element.
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + offs, mask=offs < vocab, other=float("-inf"))
    key = tl.max(_argmax_key(x.to(tl.float32), offs), axis=0)
    if not SPLIT:
        tl.store(out_ptr + row, _key_index(key))
    else:
        parts = part_ptr + row * num_chunks
        tl.store(parts + chunk, key)
        # The key is stored before the one arrival (acq_rel: released to the last arriver, whose .cg
        # loads below then see every chunk's key from L2, never a stale L1 line).
        tl.debug_barrier()
        counter = arrivals_ptr + row
        arrived = tl.atomic_add(counter, 1, sem="acq_rel")
        if arrived == num_chunks - 1:
            best = tl.full([BLOCK_CHUNKS], _KEY_PAD, tl.int64)
            for start in range(0, num_chunks, BLOCK_CHUNKS):
                c = start + tl.arange(0, BLOCK_CHUNKS)
                keys = tl.load(parts + c, mask=c < num_chunks, other=_KEY_PAD, cache_modifier=".cg")
                best = tl.maximum(best, keys)
            tl.store(out_ptr + row, _key_index(tl.max(best, axis=0)))
            tl.atomic_xchg(counter, 0)  # every chunk of the row has arrived: ready for the next launch


@triton.jit
def argmax_tile_keys(values, index, mask):
    """The best _argmax_key of each column of a [BLOCK_N, BLOCK_M] tile of float32 values (rows of the
    tile are vocabulary entries `index`, columns the batch rows; masked entries never win): what a
    logits matmul's epilogue stores per tile, so the argmax reads keys, not the logits again."""
    keys = tl.where(mask, _argmax_key(values, index), _KEY_PAD)
    return tl.max(keys, axis=0)


# The scatter's index is a slice of the engine's staging slab at whatever offset its region has (8-byte
# aligned): specialized on alignment, an aligned and an unaligned index were two compiles, and the one a
# start-up warm-up did not meet compiled inside a serving step. One load per program needs no hint.
@triton.jit(do_not_specialize_on_alignment=["index_ptr"])
def _keys_argmax_kernel(keys_ptr, out_ptr, scatter_ptr, index_ptr, num_tiles, BLOCK: tl.constexpr,
                        SCATTER: tl.constexpr):
    row = tl.program_id(0)
    best = tl.full([BLOCK], _KEY_PAD, tl.int64)
    for start in range(0, num_tiles, BLOCK):
        t = start + tl.arange(0, BLOCK)
        best = tl.maximum(best, tl.load(keys_ptr + row.to(tl.int64) * num_tiles + t, mask=t < num_tiles,
                                        other=_KEY_PAD))
    token = _key_index(tl.max(best, axis=0))
    tl.store(out_ptr + row, token)
    if SCATTER:
        tl.store(scatter_ptr + tl.load(index_ptr + row), token)


def argmax_of_keys(keys: torch.Tensor, scatter: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """int64 [N]: each row's argmax from the per-tile keys [N, tiles] a logits matmul stored
    (argmax_tile_keys): torch's x.argmax(dim=-1) of the logits it wrote, ties and NaNs included, from
    tiles * 8 bytes a row instead of the whole vocabulary row. `scatter` (dest, index): the tokens also
    go to dest[index[i]] from the same launch (the overlapped loop's token slots: one kernel fewer
    between two decode steps); dest int64, index int64 [N]."""
    if keys.dim() != 2 or keys.dtype != torch.int64 or not keys.is_contiguous():
        raise ValueError(f"argmax_of_keys needs contiguous int64 keys [N, tiles], got {tuple(keys.shape)} "
                         f"{keys.dtype}")
    rows, tiles = keys.shape
    if scatter is not None:
        dest, index = scatter
        if (dest.dtype != torch.int64 or index.dtype != torch.int64 or index.shape != (rows,)
                or not dest.is_contiguous()):
            raise ValueError(f"argmax_of_keys scatter: dest {dest.dtype} (contiguous) and index "
                             f"{tuple(index.shape)} {index.dtype} must be int64, index [{rows}]")
    out = torch.empty(rows, dtype=torch.int64, device=keys.device)
    if rows == 0:
        return out
    if tiles == 0:
        raise ValueError("argmax_of_keys needs at least one key a row")
    dest, index = scatter if scatter is not None else (out, out)
    launch(_keys_argmax_kernel, (rows,), (keys, out, dest, index, tiles),
           dict(BLOCK=min(1024, next_power_of_2(tiles)), SCATTER=scatter is not None, num_warps=4))
    return out


# index / proposals are views into one staged tensor at offsets of n * width words: specialized on
# alignment, a batch's parity would pick the compiled variant (one compiling inside a serving step)
@triton.jit(do_not_specialize_on_alignment=["index_ptr", "proposals_ptr"])
def _verify_keys_kernel(keys_ptr, index_ptr, proposals_ptr, out_ptr, num_tiles, stride_p,
                        WIDTH: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK: tl.constexpr):
    chunk = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK_W)
    in_width = j < WIDTH
    rows = tl.load(index_ptr + chunk * WIDTH + j, mask=in_width, other=0)
    best = tl.full([BLOCK_W, BLOCK], _KEY_PAD, tl.int64)
    for start in range(0, num_tiles, BLOCK):
        t = start + tl.arange(0, BLOCK)
        keys = tl.load(keys_ptr + rows[:, None] * num_tiles + t[None, :],
                       mask=in_width[:, None] & (t < num_tiles)[None, :], other=_KEY_PAD)
        best = tl.maximum(best, keys)
    tokens = _key_index(tl.max(best, axis=1))
    proposals = tl.load(proposals_ptr + chunk * stride_p + j, mask=j < WIDTH - 1, other=-1)
    mismatch = (tokens != proposals).to(tl.int32)  # past the proposals: -1, never a token
    before = tl.cumsum(mismatch, axis=0) - mismatch  # mismatches left of column j
    tl.store(out_ptr + chunk * WIDTH + j, tl.where(before == 0, tokens, -1), mask=in_width)


def verify_greedy_from_keys(keys: torch.Tensor, index: torch.Tensor, proposals: torch.Tensor) -> torch.Tensor:
    """A greedy verify's tokens from the LM head's per-tile argmax keys, in one launch: keys [R, tiles]
    (argmax_tile_keys), index [n, W] (the keys row of chunk i's column j), proposals [n, W - 1] (-1 past
    a chunk's own; rows of any stride) -> int64 [n, W]: each row's argmax (torch's, as argmax_of_keys)
    up to and including the first that differs from its proposal, then -1 (engine.spec.verify's
    greedy_tokens, whose ten small kernels this replaces on a verify step's critical path)."""
    if keys.dim() != 2 or keys.dtype != torch.int64 or not keys.is_contiguous():
        raise ValueError(f"verify_greedy_from_keys needs contiguous int64 keys [R, tiles], got {tuple(keys.shape)} "
                         f"{keys.dtype}")
    n, width = index.shape
    if (index.dtype != torch.int64 or not index.is_contiguous() or proposals.dtype != torch.int64
            or proposals.shape != (n, width - 1) or (width > 1 and proposals.stride(1) != 1)):
        raise ValueError(f"verify_greedy_from_keys: index {tuple(index.shape)} {index.dtype} (contiguous) and "
                         f"proposals {tuple(proposals.shape)} {proposals.dtype} must be int64 [n, W] and [n, W - 1]")
    out = torch.empty(n, width, dtype=torch.int64, device=keys.device)
    tiles = keys.shape[1]
    if n == 0:
        return out
    if tiles == 0:
        raise ValueError("verify_greedy_from_keys needs at least one key a row")
    launch(_verify_keys_kernel, (n,), (keys, index, proposals, out, tiles, proposals.stride(0)),
           dict(WIDTH=width, BLOCK_W=next_power_of_2(width), BLOCK=min(256, next_power_of_2(tiles)), num_warps=4))
    return out


def argmax_chunk(num_rows: int, vocab: int, sm_count: int) -> int:
    """Elements per program: a power of two in [MIN_CHUNK, MAX_CHUNK] giving the grid about two
    programs per SM where the batch allows it.

    One row is cut into about 2 * SMs chunks (an H100's 132 SMs and a 262,144 vocabulary: 256 chunks
    of 1,024, each one 2 KiB load of bf16), so a batch-1 argmax is one short wave over every SM. A
    larger batch needs fewer chunks per row for the same count, down to chunks of MAX_CHUNK (N = 64:
    32 chunks a row, 2,048 programs): longer ones would leave fewer programs in flight to hide the
    memory latency. Never shorter than MIN_CHUNK, one 16-byte load per thread: a shorter chunk only
    adds programs and keys to merge to a grid that already covers the SMs (or a vocabulary too small
    to matter). Depends only on host ints, so a captured graph keeps a valid grid.
    """
    wanted_chunks = cdiv(2 * sm_count, num_rows)
    return min(max(next_power_of_2(cdiv(vocab, wanted_chunks)), MIN_CHUNK), MAX_CHUNK)


_partials: dict[torch.device, Workspace] = {}
_arrivals: dict[torch.device, Workspace] = {}
# First-use sizes on CUDA (grown when a launch needs more): 16k chunk keys, 128 KiB, hold 512 rows of
# a 262,144 vocabulary at 32 chunks each; a counter per row for 1,024 rows.
_PARTIAL_BOUND = 1 << 14
_ARRIVAL_BOUND = 1 << 10


def _workspace(device: torch.device, num_rows: int, num_chunks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(chunk keys int64 [num_rows * num_chunks], arrival counters int32 [num_rows], all 0): views of
    the device's two workspaces (custom_ops.workspace)."""
    cuda = device.type == "cuda"
    if device not in _partials:  # not setdefault: that would build a Workspace on every call
        _partials[device] = Workspace(torch.int64)
        _arrivals[device] = Workspace(torch.int32, zeroed=True)
    keys = _partials[device].take(num_rows * num_chunks, _PARTIAL_BOUND if cuda else 0, device)
    arrivals = _arrivals[device].take(num_rows, _ARRIVAL_BOUND if cuda else 0, device)
    return keys, arrivals


def row_argmax(x: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
    """``x.argmax(dim=-1)`` (int64 [N]) for x [N, V], float32 / bfloat16 / float16 with a contiguous last
    dim, on CUDA (or a CPU tensor in Triton's interpreter). `chunk` (a power of two) overrides
    argmax_chunk's elements per program: tests use it to cut small rows into many chunks."""
    if x.dim() != 2 or x.shape[1] < 1 or x.shape[1] >= 2**31:
        raise ValueError(f"row_argmax needs x [N, V] with 1 <= V < 2**31, got {tuple(x.shape)}")
    if x.dtype not in ROW_ARGMAX_DTYPES:
        raise ValueError(f"row_argmax: x is {x.dtype}; the kernel reads {', '.join(map(str, ROW_ARGMAX_DTYPES))}")
    if x.stride(1) != 1 and x.shape[1] > 1:
        raise ValueError(f"row_argmax needs a contiguous last dimension, got x {tuple(x.shape)} strides {x.stride()}")
    if x.device.type != "cuda" and not interpreting():
        raise ValueError(f"row_argmax: x is on {x.device}; the kernel runs on CUDA (or in Triton's interpreter)")
    if chunk is not None and (chunk < 1 or chunk & (chunk - 1)):
        raise ValueError(f"row_argmax: chunk must be a power of two, got {chunk}")
    num_rows, vocab = x.shape
    out = torch.empty(num_rows, dtype=torch.int64, device=x.device)
    if num_rows == 0:
        return out
    if chunk is None:
        # the interpreter runs programs one by one: the fewest (largest) chunks are the fastest there
        chunk = argmax_chunk(num_rows, vocab, sm_count(x.device) if x.device.type == "cuda" else 1)
    num_chunks = cdiv(vocab, chunk)
    if num_chunks > 1:
        keys, arrivals = _workspace(x.device, num_rows, num_chunks)
    else:
        keys = arrivals = out  # unused without SPLIT
    # launched once per engine step outside any graph: the compiled launcher directly (triton_launch)
    launch(_row_argmax_kernel, (num_rows, num_chunks), (x, out, keys, arrivals, x.stride(0), vocab, num_chunks), dict(
        CHUNK=chunk, BLOCK_CHUNKS=min(next_power_of_2(num_chunks), MAX_MERGE_BLOCK), SPLIT=num_chunks > 1,
        # 8 or 16 elements a thread at 4 warps (one or two 16-byte loads of bf16), 16 or 32 at 8
        num_warps=4 if chunk <= 2048 else 8,
    ))
    return out
