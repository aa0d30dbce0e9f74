"""Host issue time (GPU asleep) and wall time of a padded piecewise prefill step: REAL tokens of one
sequence padded to the capture size T, as the engine pads. python hostpad.py MODEL REAL T"""
import sys, time, statistics, dataclasses, torch
from bench.common import build_model
from bench.paged import PagedKV, blocks_per_seq, step_inputs, step_metadata, BLOCK_SIZE
from compile_backend import BackendConfig, InferGraphsBackend, mark_token_dim
from custom_ops import RuntimeMode, SCRATCH_BLOCK
model, real, t = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
net = build_model(model)
kv = PagedKV.allocate(net, 1 + blocks_per_seq(t))
backend = InferGraphsBackend(BackendConfig(capture_sizes=(t,)))
compiled = torch.compile(net, backend=backend, fullgraph=True)
device = net.model.embed_tokens.weight.device
with torch.inference_mode():
    meta = step_metadata(1, 0, real, device)
    pad = torch.full((t - real,), SCRATCH_BLOCK * BLOCK_SIZE, dtype=meta.slot_mapping.dtype, device=device)
    meta = dataclasses.replace(meta, slot_mapping=torch.cat([meta.slot_mapping, pad]))
    assert meta.num_actual_tokens == real
    ids, pos = step_inputs(1, 0, t, net.config.vocab_size, device, seed=t)
    def step():
        with kv.context(meta, RuntimeMode.PIECEWISE, t):
            mark_token_dim(ids, pos)
            return compiled(ids, pos)
    for _ in range(5): step()
    torch.cuda.synchronize()
    host = []
    for rep in range(5):
        torch.cuda._sleep(300_000_000)
        t0 = time.perf_counter()
        for _ in range(10): step()
        host.append((time.perf_counter() - t0) / 10 * 1e6)
        torch.cuda.synchronize()
    wall = []
    for _ in range(50):
        torch.cuda.synchronize(); t0 = time.perf_counter(); step(); torch.cuda.synchronize()
        wall.append((time.perf_counter() - t0) * 1e3)
    print(f"{model} {real}->{t}: host issue us/step {' '.join(f'{h:.0f}' for h in host)} (median {statistics.median(host):.0f}); "
          f"wall median {statistics.median(wall):.3f} ms; stats {dict(backend.stats.__dict__).get('fallback_steps')}", flush=True)
