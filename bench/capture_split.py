"""Where a graph capture's time goes (issue 42), CUDA only: `python -m bench.capture_split [MODEL]`.

On a warm start the piecewise captures are the largest phase (llama-3.2-3b on an H100: 2.8 s for 1,395
graphs, 48 sizes x 29 pieces, nearly all of it inside CUDAGraph.capture_end by cProfile:
bench/results/h100-2026-12-07/host-check/startup-warm.txt). Whether that is the end of the stream
capture or the graph's instantiation decides what can be deferred: here every graph the engine makes is
created with keep_graph=True, so capture_end only ends the capture and instantiate() is timed on its
own, with the device memory each instantiation took outside the caching allocator. Builds the model (random weights, engine defaults, prefill graphs) once and prints JSON: the
start-up phases, the number of graphs, and the seconds in capture_end and in instantiate."""
from __future__ import annotations

import collections
import json
import sys
import time

import torch

import compile_backend.pool as pool
import models
from bench.configs import load_config
from engine import LLM

seconds: collections.Counter = collections.Counter()


class TimedGraph(torch.cuda.CUDAGraph):
    """A graph whose capture_end is split: end the stream capture, then instantiate (timed apart)."""

    def capture_end(self) -> None:
        start = time.perf_counter()
        super().capture_end()
        ended = time.perf_counter()
        free_before = torch.cuda.mem_get_info()[0]
        super().instantiate()
        instantiated = time.perf_counter()
        # device memory an instantiation takes outside the caching allocator: what deferring it past
        # the KV pool's sizing would have to reserve
        seconds["instantiate_device_bytes"] += free_before - torch.cuda.mem_get_info()[0]
        seconds["capture_end"] += ended - start
        seconds["instantiate"] += instantiated - ended
        seconds["graphs"] += 1


def new_graph() -> TimedGraph:
    graph = TimedGraph(keep_graph=True)
    pool._live_graphs.add(graph)  # counted as compile_backend.pool.new_graph counts its graphs
    return graph


def main() -> None:
    pool.new_graph = new_graph
    import compile_backend.piecewise as pw
    import engine.worker.decode_graphs as dg
    for mod in (pw, dg):
        if hasattr(mod, "new_graph"):
            mod.new_graph = new_graph
    name = sys.argv[1] if len(sys.argv) > 1 else "llama-3.2-3b"
    net = models.from_config(load_config(name), dtype=torch.bfloat16, device="cuda", seed=0)
    t = time.perf_counter()
    llm = LLM(net, show_progress=False)
    ready = time.perf_counter() - t
    phases = [(p["name"], round(p["seconds"], 3)) for p in llm.stats()["startup"]["phases"]]
    print(json.dumps({"model": name, "ready_s": round(ready, 2), "phases": phases, "graphs": seconds["graphs"],
                      "capture_end_s": round(seconds["capture_end"], 3),
                      "instantiate_s": round(seconds["instantiate"], 3),
                      "instantiate_device_mib": round(seconds["instantiate_device_bytes"] / 2**20, 1)}, indent=1))


if __name__ == "__main__":
    main()
