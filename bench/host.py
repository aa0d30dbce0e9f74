"""Suite `host`: the engine's host time per decode step, measured with a null forward.

The engine runs a model of the benchmark model's family and vocabulary shrunk to almost nothing
(null_forward_config: hidden 64, one layer, or one sliding + one full layer where the model has
sliding-window layers, so the engine keeps the same KV groups), with its decode graphs, so the GPU's part
of a step is a few tens of microseconds (the graph replay, the LM head over the full vocabulary and the
sampler; the `graph_replay_ms` column). The median step time of a `generate` call whose requests all
decode is then the host's time per step: scheduling, input staging, launch, sampling read-back, the
post-step update and the front end (detokenization and stop strings with the `tokenizer` / `stop`
variants, bench.frontend). Per row: the batch, the variant, ms per step and microseconds per request.

BENCH_HOST_PROFILE=DIR: after the measured calls, one more `generate` of each front end's last
variant at the largest batch runs under cProfile (DIR/host-<model>-<frontend>-<variant>.txt, by own time and
by cumulative time): which functions the step thread's microseconds per request are in.

Defaults: batch 64, 512-token prompts, 128 tokens out on CUDA (the e2e suite's shape, so the block
tables are as long); batch 4, 16 / 8 tokens on the CPU, where the rows only show that the suite runs
(the CPU has no graphs: its "null" forward is eager and not negligible).
"""
from __future__ import annotations

import os

import torch

from bench.common import device_and_dtype, parse_ints
from bench.configs import load_config
from bench.e2e import _graph_replays, decode_graph_sizes, frontend_note, measure_generate
from bench.frontend import STOP_STRINGS, engines, load_tokenizer, parse_variants, sampling_params, tokenizer_dir
from bench.measure import Report, host_speed_us, ratio
from bench.paged import BLOCK_SIZE
from bench.profiling import cprofiled

CUDA_SHAPE = {"batches": (64,), "prompt_len": 512, "output_len": 128}
CPU_SHAPE = {"batches": (4,), "prompt_len": 16, "output_len": 8}
NULL_SIZES = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=1, head_dim=16)
PROFILE_ENV = "BENCH_HOST_PROFILE"  # a directory: a cProfile of one more generate per front end goes there
COLUMNS = ["batch", "tokenizer", "stop_strings", "frontend", "ms_per_step", "us_per_request", "steady_steps", "graph_replay_ms",
           "step_x_replay", "host_speed_us", "prompt_len", "output_len"]


def null_forward_config(config: dict) -> dict:
    """`config` shrunk to a forward that costs the GPU almost nothing, its vocabulary (the LM head and
    sampler the engine runs every step) and its kinds of attention layers kept."""
    tiny = {k: v for k, v in config.items() if k not in ("layer_types", "sliding_window_pattern")}
    tiny.update(NULL_SIZES, num_hidden_layers=1)
    if "query_pre_attn_scalar" in config:
        tiny["query_pre_attn_scalar"] = NULL_SIZES["head_dim"]
    types = config.get("layer_types")
    sliding = (("sliding_attention" in types) if types
               else bool(config.get("sliding_window")) and str(config.get("model_type", "")).startswith("gemma3"))
    if sliding:  # the engine keeps a sliding-window KV group beside the full one, as for the real model
        tiny.update(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"])
    return tiny


FRONTENDS = ("process", "inline")  # EngineConfig.frontend_process True / False


def parse_frontends(value: str | None, on_cuda: bool) -> list[str]:
    """`--frontends process,inline` (default: both on CUDA, inline on the CPU, where the engine's own
    default is inline)."""
    names = [v.strip() for v in value.split(",")] if value else list(FRONTENDS if on_cuda else FRONTENDS[1:])
    unknown = [n for n in names if n not in FRONTENDS]
    if unknown or not names:
        raise ValueError(f"--frontends: unknown {unknown}; choose from {', '.join(FRONTENDS)}")
    return list(dict.fromkeys(names))


def run(model: str, batches=None, prompt_len: int | None = None, output_len: int | None = None,
        tokenizer: str | None = None, variants=None, repeats: int = 2, iters: int = 30, frontends=None,
        **_: object) -> Report:
    from engine import LLM
    import models

    on_cuda = torch.cuda.is_available()
    shape = CUDA_SHAPE if on_cuda else CPU_SHAPE
    batches = parse_ints(batches, shape["batches"])
    prompt_len = int(prompt_len or shape["prompt_len"])
    output_len = int(output_len or shape["output_len"])
    if output_len < 3:
        raise ValueError(f"host needs output_len >= 3 (steps where every request decodes), got {output_len}")
    chosen = parse_variants(variants, tokenizer)
    fronts = parse_frontends(frontends, on_cuda)
    config = null_forward_config(load_config(model))
    vocab = config["vocab_size"]
    tok_dir = tokenizer_dir(tokenizer) if any(v.tokenizer for v in chosen) else None
    tok = load_tokenizer(tok_dir, vocab) if tok_dir is not None else None
    device, dtype = device_and_dtype()
    net = models.from_config(config, dtype=dtype, device=device, seed=0)
    report = Report("host", model, torch.cuda.get_device_name() if on_cuda else "cpu", COLUMNS)
    report.meta.update(null_model={k: config[k] for k in ("hidden_size", "num_hidden_layers", "vocab_size")},
                       layer_types=config.get("layer_types"), batches=batches, prompt_len=prompt_len,
                       output_len=output_len, repeats=repeats, variants=[v.name for v in chosen], frontends=fronts,
                       tokenizer=str(tok_dir) if tok_dir else None, stop=list(STOP_STRINGS), torch=torch.__version__)
    max_batch = max(batches)
    engine_options = dict(max_num_seqs=max_batch, max_model_len=prompt_len + output_len + BLOCK_SIZE,
                          block_size=BLOCK_SIZE, show_progress=False)  # graphs, compile: the engine's defaults
    if (sizes := decode_graph_sizes(max_batch, batches)) is not None:
        engine_options["decode_graph_sizes"] = sizes
    rows, replay, replay_note = {}, {}, None
    for front in fronts:
        # the front end only matters with a tokenizer: the plain variant runs once, with the first
        group_variants = [v for v in chosen if v.tokenizer or front == fronts[0]]
        make = lambda t: LLM(net, tokenizer=t, frontend_process=front == "process", **engine_options)  # noqa: E731
        for llm, group in engines(make, group_variants, tok):
            for b in batches:
                for v in group:
                    speed = host_speed_us()  # the host's pace just before, to compare runs on other hosts
                    rows[b, v.name, front] = dict(measure_generate(llm, v, b, prompt_len, output_len, repeats, vocab),
                                                  host_speed_us=speed)
            if (profile_dir := os.environ.get(PROFILE_ENV)) and group:
                os.makedirs(profile_dir, exist_ok=True)
                prompts = torch.randint(0, vocab, (max_batch, prompt_len), generator=torch.Generator().manual_seed(1)).tolist()
                params = sampling_params(group[-1], output_len)
                cprofiled(lambda: llm.generate(prompts, params), os.path.join(profile_dir, f"host-{model}-{front}-{group[-1].name}"),
                          sort=("tottime", "cumulative"), top=60)
            if replay_note is None:
                replay, replay_note = _graph_replays(llm, batches, vocab, prompt_len + output_len // 2, iters)
                if replay_note[0]:
                    report.notes.append(replay_note[0])
    del net
    for (b, name, front), r in sorted(rows.items(), key=lambda kv: (kv[0][0], [v.name for v in chosen].index(kv[0][1]))):
        v = next(v for v in chosen if v.name == name)
        ms = r["itl_ms"]
        report.add(batch=b, **v.row(), frontend=front if v.tokenizer else "-", ms_per_step=ms,
                   us_per_request=None if ms is None else ms * 1e3 / b,
                   steady_steps=round(r["steady_intervals"] / b),
                   graph_replay_ms=replay.get(b), step_x_replay=ratio(ms, replay.get(b)),
                   host_speed_us=r["host_speed_us"], prompt_len=prompt_len, output_len=output_len)
    report.notes.append(
        f"null forward: {model}'s config with hidden {config['hidden_size']}, {config['num_hidden_layers']} layer(s)"
        f"{' ' + str(config['layer_types']) if config.get('layer_types') else ''}, vocabulary {vocab}; ms_per_step = the median inter-token latency of the "
        f"steps where all requests of a generate call decode (median of {repeats} calls after a warm-up), the host's "
        f"time per step while the GPU runs only graph_replay_ms; host_speed_us = a fixed piece of pure-Python work "
        f"timed just before the row (bench.measure.host_speed_us): a slowed host reads higher there too; decode graphs "
        f"{replay_note[1] if replay_note else '?'}")
    report.notes.append(frontend_note(chosen, tok_dir, tok))
    return report


def host_ms(report: Report, batch: int, variant: str = "stop", frontend: str = "process") -> float | None:
    """The ms per step of one row (for summaries): variant plain / tokenizer / stop; the front end's
    row where the report has it, else its only one."""
    from bench.frontend import VARIANTS
    v = VARIANTS[variant]
    rows = [r for r in report.rows if r["batch"] == batch and (r["tokenizer"], r["stop_strings"]) == tuple(v.row().values())]
    return next((r["ms_per_step"] for r in rows if r.get("frontend") in (frontend, "-")),
                rows[0]["ms_per_step"] if rows else None)

