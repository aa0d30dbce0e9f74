"""infer::all_reduce on 2 GPUs: every kernel it picks (symmetric-memory one-shot and two-shot, NCCL
above the crossover) sums what the ranks hold, eagerly and replayed in a CUDA graph with new inputs.

The reference is float64: each rank draws every rank's input from the same seeds, so it can sum
them on its own. Ranks are spawned processes (NCCL, one GPU each); a rank's failures come back as
text through a queue, so a wrong sum fails the test instead of hanging it.
"""
from __future__ import annotations

import datetime
import socket
import traceback

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]

WORLD = 2
HIDDEN = 2048
ONE_SHOT_MAX, TWO_SHOT_MAX = 64 << 10, 1 << 20
TOKENS = (1, 7, 16, 17, 128, 256, 257, 300)  # rows of 4 KB (bf16) or 8 KB (float32): each kind for each dtype


def _expected_kind(nbytes: int) -> str:
    return "one_shot" if nbytes <= ONE_SHOT_MAX else "two_shot" if nbytes <= TWO_SHOT_MAX else "nccl"


def _inputs(tokens: int, dtype: torch.dtype, step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * tokens + step)
    return [torch.randn(tokens, HIDDEN, generator=gen, dtype=torch.float64) for _ in range(WORLD)]


def _rank(rank: int, port: int, results) -> None:
    try:
        import torch.distributed as dist
        from custom_ops import all_reduce
        torch.cuda.set_device(rank)
        store = dist.TCPStore("127.0.0.1", port, WORLD, is_master=rank == 0, timeout=datetime.timedelta(seconds=60))
        dist.init_process_group("nccl", store=store, rank=rank, world_size=WORLD, device_id=torch.device("cuda", rank))
        group = dist.group.WORLD
        comm = all_reduce.SymmetricAllReduce.create(group, torch.device("cuda", rank), ONE_SHOT_MAX, TWO_SHOT_MAX)
        assert comm is not None, "symmetric memory is unavailable on this machine"
        all_reduce.register(comm)
        errors = []
        for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
            for tokens in TOKENS:
                x = torch.empty(tokens, HIDDEN, dtype=dtype, device="cuda")
                expected_kind = _expected_kind(x.numel() * x.element_size())
                if comm.kind(x) != expected_kind:
                    errors.append(f"{tokens} tokens {dtype}: kind {comm.kind(x)}, expected {expected_kind}")
                    continue
                for step in range(2):  # eager
                    parts = _inputs(tokens, dtype, step)
                    x.copy_(parts[rank])
                    got = torch.ops.infer.all_reduce(x, group.group_name).double().cpu()
                    want = sum(p.to(dtype).double() for p in parts)
                    if not torch.allclose(got, want, rtol=tol, atol=tol):
                        errors.append(f"eager {tokens} tokens {dtype}: max error {(got - want).abs().max():.3g}")
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    torch.ops.infer.all_reduce(x, group.group_name)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=stream):
                    out = torch.ops.infer.all_reduce(x, group.group_name) * 1  # two all-reduces back to back
                    out = torch.ops.infer.all_reduce(out, group.group_name)
                for step in range(2, 5):  # replays read new inputs at the captured address
                    parts = _inputs(tokens, dtype, step)
                    x.copy_(parts[rank])
                    graph.replay()
                    got = out.double().cpu()
                    want = WORLD * sum(p.to(dtype).double() for p in parts)
                    if not torch.allclose(got, want, rtol=2 * tol, atol=2 * tol):
                        errors.append(f"graph {tokens} tokens {dtype}: max error {(got - want).abs().max():.3g}")
                del graph
        if set(comm.calls) != {"one_shot", "two_shot", "nccl"}:
            errors.append(f"kinds run: {dict(comm.calls)}")
        all_reduce.unregister(group.group_name)
        dist.barrier()
        dist.destroy_process_group()
        results.put((rank, errors))
    except BaseException:
        results.put((rank, [traceback.format_exc()]))


def test_each_kernel_sums_the_ranks_inputs_eagerly_and_in_a_replayed_graph():
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, results)) for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        reports = dict(results.get(timeout=240) for _ in range(WORLD))
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert reports == {0: [], 1: []}
