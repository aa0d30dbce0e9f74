"""Host cost of a graphless step: eager model vs compiled pieces (RuntimeMode.NONE), tiny 28-layer Llama
on the CPU, so the kernels cost ~nothing and what is timed is the framework around them."""
import statistics, sys, time
import torch, transformers
import models
from custom_ops import RuntimeMode
from engine import LLM
torch.set_num_threads(1)
CONFIG = dict(vocab_size=96, max_position_embeddings=256, hidden_size=64, intermediate_size=96,
              num_hidden_layers=28, num_attention_heads=4, num_key_value_heads=2, bos_token_id=1,
              eos_token_id=2, pad_token_id=0)
tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 16
res = {}
for compile_ in (False, True):
    model = models.from_config(transformers.LlamaConfig(**CONFIG), dtype=torch.float32, device="cpu", seed=3)
    llm = LLM(model, device="cpu", block_size=16, max_model_len=256, max_num_seqs=4,
              max_num_batched_tokens=max(64, tokens), show_progress=False, compile=compile_)
    runner = llm.runtime.runner
    with torch.inference_mode():
        meta = runner.load_dummy(tokens, 1, False)
        for _ in range(5):
            runner.run_forward(meta, RuntimeMode.NONE, tokens)
        times = []
        for _ in range(7):
            s = time.perf_counter()
            for _ in range(20):
                runner.run_forward(meta, RuntimeMode.NONE, tokens)
            times.append((time.perf_counter() - s) / 20 * 1e3)
    res[compile_] = min(times)
    if compile_ and len(sys.argv) > 2:
        import cProfile, pstats
        with torch.inference_mode():
            cProfile.run("for _ in range(50): runner.run_forward(meta, RuntimeMode.NONE, tokens)", sys.argv[2])
        pstats.Stats(sys.argv[2]).sort_stats("tottime").print_stats(30)
    llm.close()
print(f"{tokens} tokens: eager {res[False]:.3f} ms, compiled pieces (NONE) {res[True]:.3f} ms, ratio {res[True]/res[False]:.2f}")
