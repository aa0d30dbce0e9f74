"""Suite `knockout`: where a decode step's time goes, by replaying the batch-1 decode graph with one
kind of kernel left out.

Under programmatic dependent launch (custom_ops.pdl) a profiler's per-kernel durations include the
time a kernel waits for its predecessor, so they add up to more than the step; and a kernel's cost
to the step is its duration plus the dependency it puts on the critical path. Here each variant
runs in a fresh process whose Triton kernel of one kind is replaced by a launcher that launches
nothing, before the engine compiles and captures: the graph records every other kernel as it is,
and the replay time's drop is what that kind costs the step (its outputs are left unwritten, so
the numbers are timings only, never results).

Kinds: norm (add_rms_norm), rope (qk_norm_rope), attention (decode attention), gemv (the Triton
GEMV: what is left is everything but the weights' stream). The row `norm+rope+attention` leaves
out all three. Columns: replay_ms (median replay of the decode graph at `context` cached tokens),
saved_ms (the replay's drop against `none`), saved_us_per_layer, floor_ms (weights + KV at the
copy ceiling).
"""
from __future__ import annotations

import importlib
import json
import subprocess
import sys

import torch

from bench.common import build_model, free_device_memory, parse_ints
from bench.floors import decode_floor_ms, model_cost
from bench.measure import Report, measure_ceilings

KINDS = {
    "norm": ("custom_ops.triton_rms_norm", "_add_rms_norm_kernel"),
    "rope": ("custom_ops.triton_rope", "_qk_norm_rope_kernel"),
    "attention": ("custom_ops.triton_decode", "_decode_kernel"),
    "gemv": ("custom_ops.triton_gemv", "_gemv_kernel"),
    "gemv_rope": ("custom_ops.triton_gemv_rope", "_gemv_rope_kernel"),  # Llama's q/k/v GEMV, rotary inside
}
GEMV_VARIANT = "gemv+gemv_rope"  # every GEMV left out: what the step costs besides its weights' stream
VARIANTS = ("none", "norm", "rope", "attention", "norm+rope+attention", GEMV_VARIANT)
CONTEXT = 576  # the e2e suite's mid-generation context (512-token prompts, 128 tokens out)
ITERS = 100
CHILD_TIMEOUT_S = 300  # one engine start-up (a cold compile included) and the replays
COLUMNS = ["variant", "context", "replay_ms", "saved_ms", "saved_us_per_layer", "floor_ms"]


class _LaunchNothing:
    """Stands in for a Triton kernel: `kernel[grid](*args)` launches nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def knock_out(kinds: list[str]) -> None:
    """Replace each kind's Triton kernel in its module (the launchers look it up at every call)."""
    for kind in kinds:
        if kind not in KINDS:
            raise ValueError(f"knockout: unknown kernel kind {kind!r}; kinds: {', '.join(KINDS)}")
        module, name = KINDS[kind]
        mod = importlib.import_module(module)
        if not hasattr(mod, name):
            raise AttributeError(f"knockout: {module} has no {name} (renamed? update bench.knockout.KINDS)")
        setattr(mod, name, _LaunchNothing())


def variant_kinds(variant: str) -> list[str]:
    return [] if variant == "none" else variant.split("+")


def replay_ms(model: str, variant: str, context: int, iters: int = ITERS) -> float:
    """In this process: knock the variant's kinds out, build an engine with the batch-1 decode graph
    and time its replay at `context` cached tokens."""
    knock_out(variant_kinds(variant))
    from bench.decode import graph_replay_ms
    from engine import LLM
    net = build_model(model)
    llm = LLM(net, max_num_seqs=1, max_model_len=context + 64, prefill_graphs=False, show_progress=False,
              decode_graph_sizes=(1,))
    try:
        with torch.inference_mode():  # the engine made its pool and buffers in inference mode
            return graph_replay_ms(llm.runtime.runner, net.config.vocab_size, 1, context, iters)
    finally:
        llm.close()


def _child(model: str, variant: str, context: int) -> float:
    done = subprocess.run([sys.executable, "-m", "bench.knockout", model, variant, str(context)],
                          capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"knockout variant {variant!r} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])["replay_ms"]


def run(model: str, contexts=None, **_: object) -> Report:
    if not torch.cuda.is_available():
        raise RuntimeError("the knockout suite needs a CUDA device: it times decode graph replays")
    context = parse_ints(contexts, (CONTEXT,))[0]
    ceilings = measure_ceilings()
    net = build_model(model)
    cost, layers = model_cost(net), net.config.num_layers
    del net
    free_device_memory()  # the children size their KV pools from what the device has free
    floor = decode_floor_ms(cost, 1, context + 1, ceilings.copy_bytes_per_s)
    report = Report("knockout", model, ceilings.device_name, COLUMNS)
    report.meta.update(torch=torch.__version__, context=context, layers=layers, iters=ITERS)
    report.notes.append(f"batch-1 decode graph, {layers} layers, {context} cached tokens; each variant in a fresh "
                        f"process with that kind's Triton kernel launching nothing (timings only); median of {ITERS} "
                        "replays")
    base = None
    for variant in VARIANTS:
        ms = _child(model, variant, context)
        base = ms if variant == "none" else base
        saved = base - ms
        report.add(variant=variant, context=context, replay_ms=ms, saved_ms=saved,
                   saved_us_per_layer=saved * 1e3 / layers, floor_ms=floor)
    return report


if __name__ == "__main__":  # one variant, in its own process: python -m bench.knockout MODEL VARIANT CONTEXT
    ms = replay_ms(sys.argv[1], sys.argv[2], int(sys.argv[3]))
    print(json.dumps({"variant": sys.argv[2], "replay_ms": ms}))
