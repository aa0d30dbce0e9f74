"""The graph pool test's measurement, for eager and Inductor pieces: pool bytes for the largest size alone vs all sizes."""
import sys, torch, models
from compile_backend import BackendConfig, InferGraphsBackend, pool_bytes
from tests.test_backend_helpers import hf_config, random_inputs, run_marked
for compiler in ("eager", "inductor"):
    for dtype in (torch.float32, torch.bfloat16):
        cfg = hf_config("llama", hidden_size=1024, intermediate_size=4096, num_hidden_layers=2,
                        num_attention_heads=16, num_key_value_heads=4, head_dim=64)
        model = models.from_config(cfg, dtype=dtype, device="cuda")
        config = BackendConfig(piece_compiler=compiler)
        out = {}
        for label, sizes in (("largest", [config.max_capture_size]), ("all", None)):
            torch._dynamo.reset()
            pool = torch.cuda.graph_pool_handle()
            backend = InferGraphsBackend(config, pool=pool)
            compiled = torch.compile(model, backend=backend, fullgraph=True)
            def forward(n):
                run_marked(compiled, *random_inputs(n, 96, "cuda"))
            with torch.no_grad():
                backend.capture(forward, sizes)
            torch.cuda.synchronize()
            out[label] = (pool_bytes(pool) / 2**20, backend.stats.graph_pool_bytes / 2**20)
        print(compiler, dtype, {k: tuple(round(x, 1) for x in v) for k, v in out.items()},
              f"ratio {out['all'][0] / out['largest'][0]:.2f}", flush=True)
