"""The stubbed-forward engine of ../gil-switch/ (llama config shrunk, 4,096-token vocabulary, max_num_seqs
64, its forward sleeping SLEEP_MS with the GIL released as a step waiting for the GPU does), served on
127.0.0.1:PORT by the server with the engine loop as a thread (MODE thread) or with the engine in its own
process (MODE process, serve_engine_process). Usage: server_ab.py PORT MODE SLEEP_MS"""
import functools
import sys
import time

sys.path.insert(0, "/work/main")


def build(sleep_ms: float):
    import torch
    import models
    from bench.configs import load_config
    from bench.host import null_forward_config
    from engine import LLM
    torch.set_num_threads(1)
    cfg = null_forward_config(load_config("llama-3.2-3b"))
    cfg["vocab_size"] = 4096
    net = models.from_config(cfg, dtype=torch.float32, device="cpu", seed=0)
    llm = LLM(net, max_num_seqs=64, max_model_len=1024, block_size=16, show_progress=False)
    hidden = torch.zeros(8192, cfg["hidden_size"])
    logits = torch.randn(64, 4096, generator=torch.Generator().manual_seed(0))

    def forward(meta, mode, n):
        time.sleep(sleep_ms / 1000)
        return hidden[:n]
    llm.runtime.runner.run_forward = forward
    llm.runtime.runner.model.compute_logits = lambda h: logits[:h.shape[0]]
    return llm


if __name__ == "__main__":
    import logging
    from engine.entrypoints.server import serve_engine_process, serve_llm
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    port, mode, sleep_ms = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
    make = functools.partial(build, sleep_ms)
    if mode == "process":
        sys.exit(serve_engine_process(make, "stub", port=port))
    sys.exit(serve_llm(make(), "stub", port=port))
