"""Serving compiles nothing: every Triton kernel a step launches outside a graph compiled its variants
during start-up.

Outside the graphs a step runs the LM head (mixed steps: the GEMV at one row, the skinny GEMM per row
bucket, without the argmax keys the decode graphs' copy stores) and the sampler (the argmax, whose
chunk depends on the row count, in the logits' dtype and in float32, and the keys' reduction with and
without its scatter). A variant first met in a serving step compiled inside it: 0.36 s of one step of
gemma-3-1b at batch 64 on a fresh H100 (bench/results/h100-2026-11-27/serving-compiles/). The model
is gemma-3-1b's configuration with one layer: its LM head is a shape the kernel tables serve.
"""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _variants(kernel) -> int:
    """Binaries of a Triton kernel this process holds for the current device (Triton 3.x's per-device
    cache: its first element is the key -> binary dict)."""
    caches = getattr(kernel, "device_caches", None)
    if caches is None:
        pytest.skip("this Triton keeps no per-device kernel cache to count")
    entry = caches.get(torch.cuda.current_device())
    return len(entry[0]) if entry else 0


def test_no_triton_kernel_compiles_in_a_serving_step_at_any_batch_or_sampling_mode():
    import models
    from bench.configs import load_config
    from custom_ops import triton_argmax, triton_gemv, triton_skinny
    kernels = {"gemv": triton_gemv._gemv_kernel, "skinny": triton_skinny._skinny_kernel,
               "row_argmax": triton_argmax._row_argmax_kernel, "keys_argmax": triton_argmax._keys_argmax_kernel}
    torch._dynamo.reset()
    config = dict(load_config("gemma-3-1b"), num_hidden_layers=1)
    net = models.from_config(config, dtype=torch.bfloat16, device="cuda", seed=0)
    llm = LLM(net, max_num_seqs=16, max_model_len=256, block_size=16, max_num_batched_tokens=128,
              prefill_graphs=True, show_progress=False)
    try:
        started = {name: _variants(k) for name, k in kernels.items()}
        vocab = net.config.vocab_size
        prompts = [[(31 * i + 7 * j) % vocab for j in range(5 + 9 * i)] for i in range(16)]
        # greedy, each request stopping at its own length: decode batches 16 down to 1, mixed steps
        # sampling every count of rows while the prefills are chunked
        greedy = [SamplingParams(max_tokens=2 + i, ignore_eos=True) for i in range(16)]
        outputs = llm.generate(prompts, greedy)
        assert [len(o.token_ids) for o in outputs] == [2 + i for i in range(16)]
        # sampled, and greedy and sampled rows in one batch
        sampled = [SamplingParams(max_tokens=3 + i % 5, temperature=0.8, top_p=0.9, seed=i, ignore_eos=True)
                   for i in range(11)]
        llm.generate(prompts[:11], sampled)
        llm.generate(prompts[:7], [greedy[i] if i % 2 else sampled[i] for i in range(7)])
        served = {name: _variants(k) for name, k in kernels.items()}
        assert served == started
        assert started["gemv"] > 0 and started["skinny"] > 0 and started["keys_argmax"] > 0
    finally:
        llm.close()
