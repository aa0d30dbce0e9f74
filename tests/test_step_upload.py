"""custom_ops.step_upload: a step's slab copied, its device-resident input ids resolved and its new
block-table entries written by one kernel, against the same result built with plain torch indexing.

CPU: the kernel in Triton's interpreter, and StaticBuffers' torch path (what the CPU engine runs) for
device ids. GPU (`gpu` mark): from pinned memory, rewritten between uploads, queued behind other work,
and StaticBuffers on CUDA (every step by the kernel) against the CPU buffers given the same steps."""
from __future__ import annotations

import pytest
import torch

from custom_ops.step_upload import BLOCK, upload_step
from engine.worker.input_buffers import DeviceIds, StaticBuffers

CUDA = torch.cuda.is_available()


def _step(n: int, ids: tuple[int, int], num_tokens: int, entries: int, generator: torch.Generator):
    """A random slab with some ids in [begin, end) encoded as device tokens, table entries at the start,
    and what the device should hold afterwards (slab, tables), computed with torch indexing."""
    host = torch.randint(0, 2**40, (n,), dtype=torch.int64, generator=generator)
    tokens = torch.randint(0, 2**20, (num_tokens,), dtype=torch.int64, generator=generator)
    begin, end = ids
    rows = torch.randperm(end - begin, generator=generator)[:(end - begin) // 2] + begin
    slots = torch.randint(0, num_tokens, (len(rows),), generator=generator)
    host[rows] = -1 - slots
    want = host.clone()
    want[rows] = tokens[slots]
    tables = torch.randint(0, 2**20, (4 * entries + 1,), dtype=torch.int32, generator=generator)
    index = torch.randperm(tables.numel(), generator=generator)[:entries]
    values = torch.randint(0, 2**30, (entries,), dtype=torch.int32, generator=generator)
    host[:entries] = index  # index at 0, values as int32 right after
    value_at = 2 * entries
    host.view(torch.int32)[value_at:value_at + entries] = values
    want[:entries] = index
    want.view(torch.int32)[value_at:value_at + entries] = values
    want_tables = tables.clone()
    want_tables[index] = values
    return host, tokens, tables, (0, value_at, entries), want, want_tables


@pytest.mark.parametrize("n, ids, entries", [
    (7, (2, 6), 1),                     # under one program
    (BLOCK, (BLOCK - 40, BLOCK), 0),    # one whole program, no table entries
    (2 * BLOCK + 300, (900, 1300), 64),  # ids across a program boundary, a ragged third program
])
def test_upload_step_copies_resolves_device_ids_and_writes_table_entries(n, ids, entries):
    if CUDA:
        pytest.skip("the interpreter's case; the GPU test below covers CUDA")
    host, tokens, tables, where, want, want_tables = _step(n, ids, 50, entries, torch.Generator().manual_seed(n))
    dst = torch.full((n + 5,), -7, dtype=torch.int64)
    upload_step(host, dst[:n], ids, tokens, tables, where)
    assert torch.equal(dst[:n], want) and bool((dst[n:] == -7).all())
    assert torch.equal(tables, want_tables)


def test_upload_step_leaves_negative_values_outside_the_ids_alone():
    if CUDA:
        pytest.skip("the interpreter's case")
    host = torch.tensor([-3, -1, 5, -2], dtype=torch.int64)  # ids are [1, 3): only -1 there is a slot
    dst = torch.zeros(4, dtype=torch.int64)
    upload_step(host, dst, (1, 3), torch.tensor([42, 43, 44]))
    assert dst.tolist() == [-3, 42, 5, -2]


def test_upload_step_names_what_is_wrong():
    slab = torch.zeros(8, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"host \(8,\) torch.int64 and device \(5,\) torch.int64"):
        upload_step(slab, torch.zeros(5, dtype=torch.int64))
    with pytest.raises(ValueError, match="`ids` and `tokens` go together"):
        upload_step(slab, torch.zeros(8, dtype=torch.int64), (0, 4))
    with pytest.raises(ValueError, match="tables must be flat int32, got torch.int64"):
        upload_step(slab, torch.zeros(8, dtype=torch.int64), tables=torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="3 table entries need flat int32 tables and index / value inside"):
        upload_step(slab, torch.zeros(8, dtype=torch.int64), tables=torch.zeros(4, dtype=torch.int32),
                    entries=(0, 14, 3))
    with pytest.raises(ValueError, match="tokens must be contiguous int64"):
        upload_step(slab, torch.zeros(8, dtype=torch.int64), (0, 4), torch.zeros(3, dtype=torch.int32))


def _load_steps(buffers: StaticBuffers, tokens: torch.Tensor) -> list[list[int]]:
    """Three steps through `buffers`: a decode of three rows whose ids are all on the device, a mixed step
    (a prefill chunk, then a decode whose id is on the device) that crosses a block, and a decode with
    none (on CUDA every step takes the upload kernel, on the CPU torch's ops). The input ids
    each step leaves, and the first two table rows, as lists."""
    tables = [[3], [4, 7], [5]]
    seen = []
    buffers.load([-1, -1, -1], [0, 20, 1], [48, 113, 81], [0, 1, 2, 3], [1, 21, 2], tables, [0, 1, 2],
                 device_ids=DeviceIds(tokens, [0, 1, 2], [2, 0, 1]))
    seen.append(buffers.input_ids[:3].tolist())
    tables[0].append(9)
    buffers.load([11, 12, 13, -1], [0, 1, 2, 16], [80, 81, 82, 144], [0, 3, 4], [3, 17], [[6], tables[0]], [2, 3],
                 device_ids=DeviceIds(tokens, [3], [1]))
    seen.append(buffers.input_ids[:4].tolist())
    buffers.load([21, 22], [3, 17], [83, 145], [0, 1, 2], [4, 18], [[6], tables[0]], [0, 1])
    seen.append(buffers.input_ids[:2].tolist())
    seen.append(buffers.block_tables[:2, :2].tolist())
    return seen


def test_static_buffers_write_device_ids_into_the_step_on_the_cpu():
    tokens = torch.tensor([70, 71, 72], dtype=torch.int64)
    buffers = StaticBuffers(max_tokens=8, max_seqs=3, max_blocks_per_seq=4, device=torch.device("cpu"))
    assert _load_steps(buffers, tokens) == [[72, 70, 71], [11, 12, 13, 71], [21, 22], [[6, 0], [3, 9]]]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_upload_step_reads_pinned_memory_when_it_runs_in_stream_order():
    n = 3000
    host = torch.empty(n, dtype=torch.int64, pin_memory=True)
    dst = torch.zeros(n, dtype=torch.int64, device="cuda")
    done = torch.cuda.Event()
    for seed in range(3):  # rewritten only after the previous upload ran, as StaticBuffers does
        done.synchronize()
        step, tokens, tables, where, want, want_tables = _step(n, (1000, 1500), 40, 60,
                                                               torch.Generator().manual_seed(seed))
        host.copy_(step)
        tokens, tables = tokens.cuda(), tables.cuda()
        torch.cuda._sleep(1_000_000)  # queued behind other work: the kernel reads when it runs
        upload_step(host, dst, (1000, 1500), tokens, tables, where)
        done.record()
        assert torch.equal(dst.cpu(), want) and torch.equal(tables.cpu(), want_tables)
    with pytest.raises(ValueError, match="pinned CPU host tensor"):
        upload_step(torch.zeros(4, dtype=torch.int64), torch.zeros(4, dtype=torch.int64, device="cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_static_buffers_match_the_cpu_path_step_for_step():
    tokens = torch.tensor([70, 71, 72], dtype=torch.int64)
    want = _load_steps(StaticBuffers(8, 3, 4, torch.device("cpu")), tokens)
    got = _load_steps(StaticBuffers(8, 3, 4, torch.device("cuda")), tokens.cuda())
    assert got == want


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_every_step_shape_reuses_one_compiled_variant():
    """A serving engine's counts and offsets change from step to step (Triton would specialize each int
    on == 1 / divisible by 16, and compile on the step's path): one binary serves them all."""
    from custom_ops import step_upload
    tables = torch.zeros(4096, dtype=torch.int32, device="cuda")
    tokens = torch.arange(64, dtype=torch.int64, device="cuda")
    for n, entries, with_ids in ((1, 0, False), (16, 1, True), (17, 16, True), (1024, 33, False), (3001, 0, True)):
        host = torch.arange(n, dtype=torch.int64).pin_memory()
        upload_step(host, torch.empty(n, dtype=torch.int64, device="cuda"), (n // 2, n) if with_ids else None,
                    tokens if with_ids else None, tables, (0, 0, entries))
    torch.cuda.synchronize()
    caches = getattr(step_upload._upload_step_kernel, "device_caches", None)
    if caches is None:
        pytest.skip("this Triton keeps no per-device kernel cache to count")
    assert len(caches[torch.cuda.current_device()][0]) == 1
