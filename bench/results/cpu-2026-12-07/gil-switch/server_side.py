"""The stubbed-forward engine (../server-delivery/server_side.py) whose forward sleeps SLEEP_MS with the
GIL released, as a step thread waiting for the GPU does, served on 127.0.0.1:PORT with
sys.setswitchinterval(SWITCH_MS / 1000) (Python's default: 5 ms); prints the engine's us per step
each second while requests run. `--in-process`: no server; one LLM.generate of 64 x 400 tokens, its
us per step."""
import sys, time, threading, concurrent.futures, torch
port, switch_ms, sleep_ms = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
sys.path.insert(0, "/work/main")
torch.set_num_threads(1)
if switch_ms > 0:
    sys.setswitchinterval(switch_ms / 1000)
from engine import LLM, SamplingParams
import models
from bench.configs import load_config
from bench.host import null_forward_config
cfg = null_forward_config(load_config("llama-3.2-3b")); cfg["vocab_size"] = 4096
net = models.from_config(cfg, dtype=torch.float32, device="cpu", seed=0)
llm = LLM(net, max_num_seqs=64, max_model_len=1024, block_size=16, show_progress=False)
H = torch.zeros(8192, cfg["hidden_size"]); g = torch.Generator().manual_seed(0); L = torch.randn(64, 4096, generator=g)
def forward(meta, mode, n):
    time.sleep(sleep_ms / 1000)  # the GPU's share of a step: the GIL is free meanwhile
    return H[:n]
llm.runtime.runner.run_forward = forward
llm.runtime.runner.model.compute_logits = lambda h: L[:h.shape[0]]
if "--in-process" in sys.argv:
    import random
    prompts = [[random.randrange(4096) for _ in range(300)] for _ in range(64)]
    p = SamplingParams(max_tokens=400, ignore_eos=True, temperature=0)
    for rep in range(3):
        n0, t0 = llm.num_steps, time.perf_counter()
        llm.generate(prompts, p)
        print(f"in-process rep {rep}: us/step {(time.perf_counter() - t0) / (llm.num_steps - n0) * 1e6:.0f}", flush=True)
    sys.exit(0)
import uvicorn
from engine.entrypoints.server.app import build_app
from engine.entrypoints.server.engine_loop import EngineLoop
engine = EngineLoop(llm)
app = build_app(engine, "stub", concurrent.futures.ThreadPoolExecutor(max_workers=1))
server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False, lifespan="off"))
engine.start()
def watch():
    last_n, last_t = llm.num_steps, time.perf_counter()
    while True:
        time.sleep(1.0)
        n, t = llm.num_steps, time.perf_counter()
        if n - last_n > 50:
            print(f"us/step {(t - last_t) / (n - last_n) * 1e6:.0f}  running {len(llm.scheduler.running)}", flush=True)
        last_n, last_t = n, t
threading.Thread(target=watch, daemon=True).start()
print("ready", flush=True)
server.run()
