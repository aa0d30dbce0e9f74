"""MixedGraphs: one native CUDA graph of the whole forward, attention included, per token bucket, for
the steps that are not uniform decodes (prefills, chunked prefills, prefill + decode mixes) under
cudagraph_mode FULL.

A piecewise step launches the attention kernel of every layer from the host between two graph
replays; here one replay runs the step. What makes one graph serve every mix of sequences up to its
token count N: the attention launch is recorded with a fixed grid over max_num_seqs sequence rows and
N query rows, and the step's real values sit in the runner's static buffers, laid out as
ModelRunner._prepare does for a mixed graph: the step's sequences first, then empty ones (no query
rows, no keys: their programs exit at once). The token rows past the step's own belong to no
sequence; the launch reads where they start (query_start_loc[-1]) when it runs and writes them as
zeros, and stores no K/V for them (AttentionMetadata.real_tokens_on_device). No host integer of the
step (its real token count, its longest chunk) is baked into the graph, only N.

The graph ends at the hidden states; the LM head runs on the sampling rows after the replay, as it
does for NONE and PIECEWISE steps (only those rows pay for it). Capture goes largest first into the
engine's graph pool, after the KV pool exists (the graph records the caches' addresses), with
garbage collection frozen and paused.
"""
from __future__ import annotations

from collections import Counter

import torch

from custom_ops import RuntimeMode
from engine.worker.decode_graphs import capture_run, free_memory_gib, frozen_gc


class MixedGraphs:
    def __init__(self, runner, pool) -> None:  # runner: engine.worker.model_runner.ModelRunner; pool: a handle
        from compile_backend.pool import capture_stream
        self.runner = runner
        self.pool = pool
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # size -> a weak view of the graph's output: it does not pin its block, so a later (smaller)
        # capture may reuse it; a replay rewrites it before the step reads it (compile_backend.pool)
        self.hidden: dict[int, torch.Tensor] = {}
        self.capture_seconds = 0.0
        self.graph_bytes = 0
        self.replays = 0
        self.replays_by_size: Counter[int] = Counter()
        with torch.cuda.device(runner.device):
            self.stream = capture_stream()

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(sorted(self.graphs))

    def _warm_up_and_record(self, num_tokens: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Load a dummy step of num_tokens (scratch block only), run it once eagerly (kernel loading,
        first-call work) and record it, both on the capture stream."""
        from compile_backend.pool import new_graph
        runner = self.runner
        meta = runner.load_mixed_dummy(num_tokens)
        self.stream.wait_stream(torch.cuda.current_stream(runner.device))
        with torch.cuda.stream(self.stream):
            runner.run_forward(meta, RuntimeMode.FULL, num_tokens)
            graph = new_graph()
            graph.capture_begin(pool=self.pool)
            try:
                hidden = runner.run_forward(meta, RuntimeMode.FULL, num_tokens)
            finally:
                graph.capture_end()
        torch.cuda.current_stream(runner.device).wait_stream(self.stream)
        return graph, hidden

    def measure(self, num_tokens: int) -> int:
        """Bytes a capture of num_tokens takes and gives back when dropped, from a throwaway capture in
        this object's pool (a pool of its own: the caller drops this object). Run before the KV pool
        exists, as DecodeGraphs.measure."""
        device = self.runner.device
        with frozen_gc():
            graph, hidden = self._warm_up_and_record(num_tokens)
        torch.cuda.synchronize(device)
        free_captured = torch.cuda.mem_get_info(device)[0]
        del graph, hidden
        torch.cuda.empty_cache()
        return max(0, torch.cuda.mem_get_info(device)[0] - free_captured)

    def capture(self, sizes: tuple[int, ...], show_progress: bool) -> None:
        from compile_backend.pool import weak_tensor
        device = self.runner.device
        ordered = sorted(sizes, reverse=True)  # largest first: smaller graphs reuse its pool memory
        with capture_run(device, len(ordered), "mixed graphs", show_progress) as run:
            for n in ordered:
                self.graphs[n], hidden = self._warm_up_and_record(n)
                self.hidden[n] = weak_tensor(hidden)
                del hidden
                run.tick()
        self.capture_seconds, self.graph_bytes = run.seconds, run.graph_bytes
        run.report(f"captured {len(self.graphs)} mixed-step graphs ({ordered[-1]}..{ordered[0]} tokens) in "
                   f"{self.capture_seconds:.2f} s, graph memory {self.graph_bytes / 2**20:.1f} MiB, "
                   f"{free_memory_gib(device):.2f} GiB free")

    def release(self) -> None:
        self.graphs.clear()
        self.hidden.clear()

    def replay(self, num_tokens: int) -> torch.Tensor:
        """Replay the bucket's graph over the step in the static buffers; its hidden states [N, H], valid
        until the next replay of any graph of the pool."""
        self.graphs[num_tokens].replay()
        self.replays += 1
        self.replays_by_size[num_tokens] += 1
        return self.hidden[num_tokens]
