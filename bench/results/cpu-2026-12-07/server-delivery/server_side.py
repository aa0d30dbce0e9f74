"""A server over the stubbed-forward engine (llama config, vocab 4096, CPU), on 127.0.0.1:PORT; prints
the engine's steps per second while it runs."""
import sys, time, threading, asyncio, concurrent.futures, torch
sys.path.insert(0, sys.argv[2] if len(sys.argv) > 2 else "/work/main")
torch.set_num_threads(1)
import uvicorn
from engine import LLM
import models
from bench.configs import load_config
from bench.host import null_forward_config
from engine.entrypoints.server.app import build_app
from engine.entrypoints.server.engine_loop import EngineLoop
port = int(sys.argv[1])
cfg = null_forward_config(load_config("llama-3.2-3b")); cfg["vocab_size"] = 4096
net = models.from_config(cfg, dtype=torch.float32, device="cpu", seed=0)
llm = LLM(net, max_num_seqs=64, max_model_len=1024, block_size=16, show_progress=False)
H = torch.zeros(8192, cfg["hidden_size"]); g = torch.Generator().manual_seed(0); L = torch.randn(64, 4096, generator=g)
llm.runtime.runner.run_forward = lambda meta, mode, n: H[:n]
llm.runtime.runner.model.compute_logits = lambda h: L[:h.shape[0]]
engine = EngineLoop(llm)
pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
app = build_app(engine, "stub", pool)
config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False, lifespan="off")
server = uvicorn.Server(config)
engine.start()
def watch():
    last_n, last_t = llm.num_steps, time.perf_counter()
    while True:
        time.sleep(1.0)
        n, t = llm.num_steps, time.perf_counter()
        if n > last_n:
            print(f"steps/s {int((n - last_n) / (t - last_t))}  us/step {(t - last_t) / (n - last_n) * 1e6:.0f}  running {len(llm.scheduler.running)}", flush=True)
        last_n, last_t = n, t
threading.Thread(target=watch, daemon=True).start()
print("ready", flush=True)
server.run()
