"""Suite `spec`: speculative decoding through `LLM.generate`, next to no speculation in the same engine.

One engine with speculative_config {"method": "ngram", "num_speculative_tokens": max k} (its verify
graphs cover every k up to it); each row swaps the engine's proposer, so the rows share the graphs,
the KV pool and the process:
  none        no proposer: plain decoding (the async loop, host and device overlapped)
  ngram       prompt lookup (the engine's own proposer, k tokens, lookup 1..3) on free generation
              from random prompts: what speculation costs where it finds little (goal >= 0.97x none)
  rejected    every proposal wrong, no back-off: every step is a verify step of 1 + k tokens that adds
              one token, so its ms_per_token is the verify step's cost (goal <= 1.15x none at k 4,
              batch 1); derived_ceiling_x = (1 + k) tokens per such step over `none`: what acceptance 1
              (a draft equal to the target, without the draft's cost) would give
  ceiling     proposals replaying the greedy output of the `none` row: acceptance 1 only as long as
              the output stays that of `none`. In bf16 the verify step's kernels (mixed-step graph,
              skinny GEMM) and the decode graph's (GEMV) round differently, and a random-weight model's
              near-tied logits flip within tens of tokens (`diverges_at`: the median first token that
              differs), after which the replay proposes the wrong text. Greedy identity is tested in
              float32 (tests/test_spec_decode_gpu.py).
  draft       a draft model equal to the target (a second copy, same seed: acceptance ~1 where bf16
              rounding agrees): the whole draft-model path (engine/spec/draft.py: catch-up, k - 1 draft
              decode graphs, sampling, verify), its draft_ms a round; a draft as costly as the target
              cannot speed anything up (k draft steps + one verify step for at most 1 + k tokens), so
              this row shows the mechanism's overhead, not a gain
  draft_small a draft of the target's shape cut to --draft-layers layers (default a quarter), random
              weights, so acceptance ~0, proposing on every step (no back-off): its ms_per_token is one
              drafting round plus one verify step; derived_ceiling_x = (1 + k) tokens per such round
              over `none`, what a draft of that cost that the target always agreed with would give
The models carry random weights, so no proposer but the replay sees text a real model would copy;
acceptance on real text is measured with the real default model on the CPU (bench/spec_acceptance.py
where present, bench/results/*/spec-acceptance).

Per batch B (B requests of prompt_len random tokens, output_len tokens out, greedy, ignore_eos):
  tok_per_s    B * (output_len - 1) over the median request's decode time (first token to last)
  ms_per_token the median request's decode time / (output_len - 1)
  speedup      tok_per_s over the `none` row's of the same batch
  acceptance, accepted_len  from the proposer's counts over the row's generate calls

BENCH_SPEC_PROFILE=DIR: after the rows, one more generate at the smallest batch of `none` and of
`rejected` at the largest k, each under torch.profiler with the engine's stages marked
(bench/step_timeline.py): DIR/spec-<model>-<variant>.txt (stage times, the GPU's idle gaps, the host
work between reading a step and launching the next) and .json.gz (the trace); then, without the profiler,
DIR/graph-launch-<model>.txt: the host time and the GPU time of one replay of each decode and verify graph.
"""
from __future__ import annotations

import dataclasses
import os
import random
import statistics
import time

import torch

from bench.common import build_model, parse_ints
from bench.configs import load_config
from bench.measure import Report, ratio
from engine.request import Request
from engine.spec.config import SpeculativeConfig
from engine.spec.proposer import Proposer

PROFILE_ENV = "BENCH_SPEC_PROFILE"
BATCHES = (1, 8, 32)
KS = (2, 4)
PROMPT_LEN = 256
OUTPUT_LEN = 128
VARIANTS = ("none", "ngram", "rejected", "ceiling", "draft", "draft_small")
DRAFTS = ("draft", "draft_small")

COLUMNS = ["batch", "variant", "k", "tok_per_s", "ms_per_token", "speedup", "acceptance", "accepted_len",
           "verify_chunks", "steps", "draft_ms", "derived_ceiling_x", "diverges_at"]


def run(model: str, batches=None, ks=None, prompt_len: int | None = None, output_len: int | None = None,
        repeats: int = 2, variants: str | None = None, draft_layers: int | None = None, **_: object) -> Report:
    from engine import LLM, SamplingParams

    batches = parse_ints(batches, BATCHES)
    ks = parse_ints(ks, KS)
    prompt_len, output_len = int(prompt_len or PROMPT_LEN), int(output_len or OUTPUT_LEN)
    wanted = _variants(variants)
    config = load_config(model)
    vocab = config["vocab_size"]
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    report = Report("spec", model, device, COLUMNS)
    net = build_model(model)
    max_k = max(ks)
    drafting = [v for v in DRAFTS if v in wanted]
    # room for the largest batch's verify steps as rows of their own (B (1 + k) of them), as an engine
    # sized for serving has: with max_num_seqs at the batch, batch 8's verify steps of 40 tokens found no
    # verify graph and ran mixed-step graphs (bench/results/h200-2026-12-06/spec-draft/: 1.98x a decode step)
    max_num_seqs = max(max(batches), min(256, max(batches) * (1 + max_k)))
    llm = LLM(net, max_num_seqs=max_num_seqs, max_model_len=prompt_len + output_len + 16, show_progress=False,
              speculative_config={"method": "ngram", "num_speculative_tokens": max_k,
                                  "prompt_lookup_min": 1, "prompt_lookup_max": 3},
              # the drafts' weights and KV pools are built after the target's pool: leave them room
              **({"kv_memory_fraction": 0.5} if drafting else {}))
    layers = int(draft_layers or max(1, config["num_hidden_layers"] // 4))
    drafts = {v: _draft_proposer(llm, model, config, max_k, None if v == "draft" else layers) for v in drafting}
    report.meta.update(batches=batches, ks=ks, prompt_len=prompt_len, output_len=output_len, repeats=repeats,
                       max_num_seqs=max_num_seqs,
                       torch=torch.__version__, cudagraph_mode=llm.config.cudagraph_mode,
                       mixed_graphs=llm.stats()["mixed_graphs"], variants=list(wanted),
                       draft_small_layers=layers if "draft_small" in drafts else None)
    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    for b in batches:
        prompts = [torch.randint(3, vocab, (prompt_len,), generator=gen).tolist() for _ in range(b)]
        llm.scheduler.proposer = None
        llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up (prefix cache, graphs)
        base = _measure(llm, prompts, params, repeats)
        greedy = {tuple(p): list(p) + o.token_ids for p, o in zip(prompts, base["outputs"])}
        report.add(batch=b, variant="none", k=0, **base["row"], speedup=1.0)
        for k in ks:
            for variant in (v for v in VARIANTS[1:] if v in wanted):
                config = SpeculativeConfig(k, 1, 3)
                if variant == "ngram":
                    proposer = Proposer(config)
                elif variant in drafts:
                    proposer = drafts[variant]
                    proposer.config = dataclasses.replace(proposer.config, num_speculative_tokens=k)
                    proposer.reset_stats()
                else:
                    wrong = 1.0 if variant == "rejected" else 0.0
                    proposer = ReplayProposer(config, greedy, vocab, wrong, backoff=variant != "rejected")
                llm.scheduler.proposer = proposer
                # warm-up with the proposer: a verify path's first-call work stays out of the measured calls
                # (the first measured call of a row carried it: bench/results/h100-2026-12-08/validate/)
                llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
                proposer.reset_stats()
                got = _measure(llm, prompts, params, repeats)
                stats = {**proposer.stats.as_dict(), **proposer.stats_dict()}
                derived = None
                if variant in ("rejected", "draft_small"):  # one token per step or round: what 1 + k would give
                    derived = ratio((1 + k) / got["row"]["ms_per_token"], 1 / base["row"]["ms_per_token"])
                report.add(batch=b, variant=variant, k=k, **got["row"],
                           speedup=ratio(got["row"]["tok_per_s"], base["row"]["tok_per_s"]),
                           acceptance=stats["acceptance_rate"], accepted_len=stats["mean_accepted_length"],
                           verify_chunks=stats["verify_chunks"], draft_ms=stats.get("draft_ms_per_round"),
                           derived_ceiling_x=derived, diverges_at=_first_difference(got["outputs"], base["outputs"]))
    if profile_dir := os.environ.get(PROFILE_ENV):
        _profile(llm, model, profile_dir, min(batches), max_k, prompt_len, output_len, vocab)
    stats = llm.stats()
    report.notes.append(f"{repeats} measured generate calls per row (median of their medians) after one warm-up generate per row; "
                        f"prompts of {prompt_len} random tokens, {output_len} out, greedy; engine defaults "
                        f"(cudagraph_mode {stats['cudagraph_mode']}), speculative_config k={max_k} (verify graphs "
                        f"for every k up to it); steps by mode {stats['modes']}, fallbacks {stats['fallback_reasons']}")
    for variant, proposer in drafts.items():
        draft = proposer.stats_dict()
        report.notes.append(f"{variant}: the draft's steps by mode {draft['draft_modes']}, graph fallbacks "
                            f"{draft['draft_graph_fallbacks']}; draft_ms is host time a drafting round takes "
                            "(its catch-up and k - 1 decode steps and the read-back that waits for them)")
        proposer.close()
    llm.close()
    return report


def _profile(llm, model: str, directory: str, batch: int, k: int, prompt_len: int, output_len: int,
             vocab: int) -> None:
    """One generate of `none` and of `rejected` (every step a verify step) under torch.profiler."""
    import engine.core.step_loop as step_loop_module
    from bench.step_timeline import profile_stages
    from engine import SamplingParams
    os.makedirs(directory, exist_ok=True)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, vocab, (prompt_len,), generator=gen).tolist() for _ in range(batch)]
    params = SamplingParams(max_tokens=min(output_len, 48), ignore_eos=True)
    loop, scheduler = llm._loop, llm.scheduler
    stages = [(loop, "step", "step"), (loop, "wait_for", "wait"), (loop, "_resolve", "resolve"),
              (scheduler, "schedule", "schedule"), (loop, "_launch", "launch"),
              (llm.runtime.runner, "execute", "execute"), (step_loop_module, "sample_verify", "sample_verify")]
    scheduler.proposer = None
    greedy = {tuple(p): list(p) + o.token_ids for p, o in zip(prompts, llm.generate(prompts, params))}
    for variant in ("none", "rejected"):
        if variant == "rejected":
            scheduler.proposer = ReplayProposer(SpeculativeConfig(k, 1, 3), greedy, vocab, 1.0, backoff=False)
        llm.generate(prompts, params)  # warm: the same shapes as the profiled call
        profile_stages(lambda: llm.generate(prompts, params), os.path.join(directory, f"spec-{model}-{variant}"),
                       stages)
    scheduler.proposer = None
    if torch.cuda.is_available():
        with open(os.path.join(directory, f"graph-launch-{model}.txt"), "w") as f:
            f.write(_graph_launch_us(llm.runtime.runner))


def _graph_launch_us(runner, launches: int = 40) -> str:
    """Per decode and verify graph size, without a profiler (CUPTI's tracing of every kernel node
    inflates both): the host time of one `graph.replay()` (cudaGraphLaunch), launches queued back to
    back so the host never waits, and the GPU time of one replay, CUDA events around the same back-to-
    back launches (the GPU never waits for the host): the verify graph's GPU time over the batch-1
    decode graph's is what the kernels alone make a verify step cost, host and read-back aside. Each
    replay rewrites what the last step wrote (its inputs are still in the static buffers): run it only
    when the engine is about to close."""
    lines = ["graph   rows  host us per replay (median, min)  GPU us per replay"]
    for kind, graphs in (("decode", runner.decode_graphs), ("verify", runner.verify_graphs)):
        for size, graph in sorted((graphs.graphs if graphs is not None else {}).items()):
            torch.cuda.synchronize()
            times = []
            began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            began.record()
            for _ in range(launches):
                start = time.perf_counter()
                graph.replay()
                times.append((time.perf_counter() - start) * 1e6)
            ended.record()
            ended.synchronize()
            gpu_us = began.elapsed_time(ended) * 1e3 / launches
            lines.append(f"{kind:7} {size:4}  {statistics.median(times):8.1f} {min(times):8.1f}  {gpu_us:10.1f}")
    return "\n".join(lines) + "\n"


def _variants(value: str | None) -> tuple[str, ...]:
    if not value:
        return VARIANTS
    names = tuple(v.strip() for v in value.split(",") if v.strip())
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        raise ValueError(f"bench spec --variants: unknown {unknown}; known: {', '.join(VARIANTS)}")
    return ("none",) + tuple(v for v in VARIANTS[1:] if v in names)


def _draft_proposer(llm, model: str, config: dict, k: int, layers: int | None):
    """A DraftProposer beside the bench's engine: the target's own weights (a second copy: same seed) or,
    with `layers`, the target's shape cut to that many layers, random weights."""
    import models
    from engine.spec.draft import build_draft_proposer
    from engine.worker.timeline import StartupTimeline
    from bench.common import device_and_dtype

    if layers is None:
        draft = build_model(model)
    else:
        device, dtype = device_and_dtype()
        draft = models.from_config({**config, "num_hidden_layers": layers}, dtype=dtype, device=device, seed=1)
    spec = SpeculativeConfig(k, 1, 1, "draft_model", draft)
    proposer = build_draft_proposer(spec, llm.config, llm.model_config, StartupTimeline())
    proposer.backoff = layers is None  # the small random draft proposes on every step (its cost row)
    return proposer


def _measure(llm, prompts, params, repeats: int) -> dict:
    per_call, steps_before = [], llm.num_steps
    outputs = None
    for _ in range(repeats):
        outputs = llm.generate(prompts, params)
        per_call.append(statistics.median(sum(o.inter_token_latencies_s) for o in outputs))
    seconds = statistics.median(per_call)
    n = len(outputs[0].token_ids) - 1
    return {"outputs": outputs,
            "row": {"tok_per_s": len(prompts) * n / seconds, "ms_per_token": seconds / n * 1e3,
                    "steps": (llm.num_steps - steps_before) // repeats}}


def _first_difference(outputs, reference) -> float | None:
    """The median over requests of the first output position that differs from the reference (None
    where every output is identical; a request identical throughout counts as its length)."""
    if [o.token_ids for o in outputs] == [o.token_ids for o in reference]:
        return None
    firsts = []
    for got, want in zip(outputs, reference):
        firsts.append(next((i for i, (a, b) in enumerate(zip(got.token_ids, want.token_ids)) if a != b),
                           len(want.token_ids)))
    return statistics.median(firsts)


class ReplayProposer(Proposer):
    """Proposals from known continuations (prompt -> prompt + greedy output), a share `wrong` of the
    tokens replaced by others at random. `backoff=False` keeps proposing whatever is rejected (the
    `rejected` row: every step a verify step). The tests use it too (tests/spec_helpers.py)."""

    def __init__(self, config: SpeculativeConfig, continuations: dict[tuple[int, ...], list[int]], vocab: int,
                 wrong: float = 0.0, seed: int = 0, backoff: bool = True) -> None:
        super().__init__(config)
        self.continuations, self.vocab, self.wrong, self.backoff = continuations, vocab, wrong, backoff
        self.rng = random.Random(seed)

    def lookup(self, request: Request, num_tokens: int) -> list[int]:
        known = self.continuations.get(tuple(request.prompt_token_ids), [])
        n = len(request.token_ids)
        return [t if self.rng.random() >= self.wrong else (t + 1 + self.rng.randrange(self.vocab - 1)) % self.vocab
                for t in known[n:n + num_tokens]]
