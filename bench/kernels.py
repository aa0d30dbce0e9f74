"""Suite `kernels`: a census of the GPU kernels one decode step launches, by kind, per step and per layer.

What issue 11 counts before and after each fusion. Parts, each profiled (torch.profiler, CUDA
activity) over STEPS identical steps, separated by a synchronize:
  decode_graph    one replay of the engine's full-decode graph (forward + logits, as the engine serves
                  it: the compiled pieces recorded with attention between them);
  decode_pieces   the same step through the compiled pieces without graphs (RuntimeMode.NONE), the
                  kernels a piecewise step runs;
  sample_greedy   the sampler on that step's logits, every request greedy;
  sample_topp     the sampler with temperature 0.8 and top_p 0.9 for every request;
  prefill_pieces  one sequence's prefill of PREFILL_TOKENS tokens through the compiled pieces (the
                  kernels a piecewise prefill step runs; batch column 1).
Kinds come from kernel names (bench.profiling.classify_kernel): gemm, gemm_splitk_reduce, attention,
attention_merge, kv_store, norm (Inductor kernels with an rsqrt), fused_elementwise (other Inductor
kernels), copy (memcpy/memset/aten copies), reduce, elementwise (aten), other.
"""
from __future__ import annotations

import torch

from bench.common import build_model, parse_ints
from bench.decode import decode_blocks_needed, load_decode_step
from bench.measure import Report
from bench.paged import BLOCK_SIZE, blocks_per_seq, step_metadata
from bench.profiling import kernel_census, kernel_events

BATCHES = (1, 8)
CONTEXT = 512
STEPS = 10
PREFILL_TOKENS = 256
COLUMNS = ["part", "batch", "kind", "per_step", "per_layer", "us_per_step", "names"]


def _require_cuda() -> None:
    # Without CUDA there are no device kernels: every count would be a 0 never measured.
    if not torch.cuda.is_available():
        raise RuntimeError("the kernels suite needs a CUDA device: it counts GPU kernels")


def profile_steps(step, num_steps: int = STEPS, warmup: int = 3) -> list[tuple[str, float]]:
    """(name, duration_us) of the device kernels of num_steps calls of step, after a warm-up."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(num_steps):
            step()
        torch.cuda.synchronize()
    return kernel_events(prof)


def sampling_requests(batch: int, temperature: float, top_p: float = 1.0) -> list:
    from engine.params import SamplingParams
    from engine.request import Request
    params = SamplingParams(max_tokens=1, temperature=temperature, top_p=top_p)
    return [Request(f"census-{i}", [0], params) for i in range(batch)]


def load_prefill_step(runner, vocab_size: int, num_tokens: int):
    """One sequence's prefill of num_tokens (random ids, blocks 1..) into the runner's static buffers;
    the metadata viewing them (as bench.decode.load_decode_step does for a decode step)."""
    meta = step_metadata(1, 0, num_tokens, "cpu")
    ids = torch.randint(0, vocab_size, (num_tokens,)).tolist()
    # sliding-window KV groups (engine.kv.groups) get tables of their own, in their own pools
    size, group_slots, group_tables = runner.block_size, [], []
    for names in runner.group_layers:
        usable = runner.kv_caches[names[0]].shape[1] - 1  # blocks past the scratch block
        table = [1 + i % usable for i in range(-(-num_tokens // size))]
        group_tables.append([table])
        group_slots.append([table[p // size] * size + p % size for p in range(num_tokens)])
    runner.buffers.load(ids, list(range(num_tokens)), meta.slot_mapping.tolist(), meta.query_start_loc.tolist(),
                        meta.seq_lens.tolist(), meta.block_tables.tolist(), [num_tokens - 1], group_slots,
                        group_tables)
    return runner.buffers.metadata(num_tokens, 1, num_tokens, num_tokens, num_tokens, False)


def run(model: str, batches=None, contexts=None, num_steps: int = STEPS, **_: object) -> Report:
    """batches: decode batch sizes (default 1,8); contexts: one cached length (default 512)."""
    _require_cuda()
    from custom_ops import RuntimeMode
    from engine import LLM

    batches = parse_ints(batches, BATCHES)
    context = parse_ints(contexts, (CONTEXT,))[0]
    net = build_model(model)
    num_layers = net.config.num_layers
    max_model_len = max(context, PREFILL_TOKENS) + BLOCK_SIZE
    llm = LLM(net, max_num_seqs=max(batches), max_model_len=max_model_len,
              num_gpu_blocks=max(1 + blocks_per_seq(max_model_len),  # the engine's minimum for one request
                                 *(decode_blocks_needed(b, context) for b in batches)),
              decode_graph_sizes=tuple(sorted(set(batches))), show_progress=False,
              max_num_batched_tokens=max(PREFILL_TOKENS, max(batches)), compile=True)
    runner, sampler = llm.runtime.runner, llm.runtime.sampler
    graphs = runner.decode_graphs  # None without CUDA (the CPU run of tests/test_bench_kernels.py)
    device_name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    report = Report("kernels", model, device_name, COLUMNS)
    report.meta.update(torch=torch.__version__, context=context, batches=batches, num_layers=num_layers,
                       num_steps=num_steps)
    report.notes.append(f"decode at context {context}, {num_layers} layers; per_layer = per_step / layers "
                        "(kinds launched once per step read 1/layers); us_per_step is GPU time, gaps excluded")
    report.notes.append("decode_graph replays the engine's decode graph; "
                        f"prefill_pieces is one sequence of {PREFILL_TOKENS} tokens")
    with torch.inference_mode():
        for t in llm.runtime.kv_cache.tensors:
            t.normal_()  # random K/V, as the decode suite
        for batch in batches:
            meta = load_decode_step(runner, net.config.vocab_size, batch, context)
            greedy = sampling_requests(batch, 0.0)
            top_p = sampling_requests(batch, 0.8, 0.9)
            parts = {}
            if graphs is not None:
                parts["decode_graph"] = lambda: graphs.replay(batch, batch)
            parts["decode_pieces"] = lambda: net.compute_logits(runner.run_forward(meta, RuntimeMode.NONE, batch))
            logits = next(iter(parts.values()))()
            parts["sample_greedy"] = lambda: sampler.sample(logits, greedy)
            parts["sample_topp"] = lambda: sampler.sample(logits, top_p)
            for part, step in parts.items():
                for row in kernel_census(profile_steps(step, num_steps), num_steps, num_layers):
                    report.add(part=part, batch=batch, **row)
        meta = load_prefill_step(runner, net.config.vocab_size, PREFILL_TOKENS)

        def prefill():
            return net.compute_logits(runner.run_forward(meta, RuntimeMode.NONE, PREFILL_TOKENS)[-1:])
        for row in kernel_census(profile_steps(prefill, num_steps), num_steps, num_layers):
            report.add(part="prefill_pieces", batch=1, **row)
    report.meta["engine_stats"] = {k: v for k, v in llm.stats().items() if k != "backend"}
    llm.runtime.kv_cache.release()
    return report
