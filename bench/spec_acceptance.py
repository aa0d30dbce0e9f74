"""Suite `spec_acceptance`: how much prompt lookup ("ngram") speculation accepts on real text, with the
real default model (Gemma 3 270M), greedy: in float32 on the CPU by default, or in bf16 on the GPU
with `--device cuda`, which adds timed rows.

Random-weight models never copy their prompts; acceptance on text a real model writes is measured
here, by step counts on the CPU (never by time: a CPU step is no GPU step), and on the GPU also by
time: rows `batch1:<instruction>` run each copy-heavy request alone, without and with speculation.

One engine (speculative_config k = the largest k asked for); one run per configuration over the same
requests, all submitted at once (max_num_seqs = their number, so each runs from the first step):
  copy   6 fixed passages written for this suite (100-200 words), each behind one of three
         instructions: repeat (exactly), summarize, rewrite (same words, small changes); 96 tokens out
  free   4 open-ended prompts ("Write a story about ..."); 64 tokens out
The model (google/gemma-3-270m, the pretrained one) has no chat template: the prompts are plain text
that ends where the answer starts; a tokenizer with a chat template gets it applied instead.
The baseline run has no proposer; each other run swaps in a Proposer with its (k, prompt_lookup_min,
prompt_lookup_max) (bench/spec.py does the same), so the runs share the process and the KV pool.

Per (workload, k, lookup), over the workload's requests (rows for copy's three instructions too):
  acceptance       accepted / proposed tokens
  accepted_len     tokens a verify chunk adds (its accepted proposals + the one after them)
  chunks_per_tok   verify chunks per generated token
  verify_frac      of the requests' decode steps (steps that gave them tokens after the first), those
                   with proposals (verify chunks / decode steps)
  steps_base       decode steps of the requests without speculation (one per token after the first)
  steps_spec       the same with speculation
  projected_speedup  steps_base / steps_spec: the gain in tokens per step. A STEP-COUNT RATIO, not a
                   time ratio: a verify step of 1 + k tokens costs more than a decode step (on the GPU,
                   bench/spec.py's `rejected` row measures that cost), so the time gain is lower.
  identical        the requests' greedy outputs equal to the baseline's (they must be, in float32)
  engine_steps     (workload "all") the engine's steps for the whole run, both workloads batched
"""
from __future__ import annotations

import collections
import statistics
import time

import torch

from bench.common import parse_ints
from bench.measure import Report, ratio
from engine.request import Request
from engine.spec.config import SpeculativeConfig
from engine.spec.proposer import Proposer

KS = (2, 4, 6)
LOOKUPS = ((1, 3), (2, 4))
COPY_OUTPUT_LEN = 96
FREE_OUTPUT_LEN = 64

# Written for this suite (no source text): six passages of 100-200 words.
PASSAGES = (
    ("lighthouse",
     "The old lighthouse stood at the edge of the northern cliff for more than a hundred years. Every "
     "evening its keeper climbed the ninety-one narrow steps, trimmed the wick, polished the great glass "
     "lens, and lit the lamp before the sun had fully set. All night the beam swept across the dark water, "
     "once every twelve seconds, and the fishing boats that passed counted the flashes to know where the "
     "rocks lay hidden beneath the waves. In winter the storms came in from the sea and shook the iron "
     "railings, and salt covered the windows so thickly that the keeper had to clean them twice before "
     "morning. When the lamp was finally replaced by an automatic light, the last keeper packed his few "
     "books, locked the heavy door behind him, and walked down the hill to the village without looking back."),
    ("bread",
     "To bake a simple loaf of bread, begin by mixing five hundred grams of flour with ten grams of salt in "
     "a large bowl. Dissolve seven grams of dry yeast in three hundred and fifty millilitres of warm water, "
     "then pour the water into the flour and stir until no dry flour remains. Turn the dough onto a clean "
     "table and knead it for ten minutes, until it feels smooth and springs back when you press it with a "
     "finger. Place the dough in an oiled bowl, cover it with a cloth, and leave it in a warm place for one "
     "hour, or until it has doubled in size. Shape it into a round loaf, let it rise for another thirty "
     "minutes, and bake it at two hundred and twenty degrees for thirty-five minutes. The loaf is done when "
     "it sounds hollow as you tap the bottom."),
    ("river",
     "The river begins as a thin stream of melting snow high in the mountains, where the air is cold and the "
     "ground is covered with moss and small stones. As it flows down the valley, other streams join it, and "
     "by the time it reaches the first town it is wide enough to turn the wheels of an old mill. Farmers "
     "along its banks use its water for their fields of wheat and barley, and children swim in its shallow "
     "pools during the long days of summer. Further south the river grows slow and brown, carrying soil "
     "from the hills toward the sea. At its mouth it divides into many channels that wind through marshes "
     "full of birds, and finally its fresh water mixes with the salt water of the ocean."),
    ("meeting",
     "The committee met on Tuesday morning to discuss the plans for the new public library. The chair opened "
     "the meeting by thanking the members for their work on the report and reminding them that the city "
     "council expects a final proposal by the end of the month. The first item was the location: two sites "
     "were considered, one near the central market and one beside the railway station. After a long "
     "discussion the members agreed that the site near the market is easier to reach on foot and by bus. "
     "The second item was the budget, which the treasurer said must not exceed four million dollars. The "
     "committee asked the architect to prepare two designs within that budget, and the meeting closed at "
     "eleven thirty with a decision to meet again in two weeks."),
    ("robot",
     "The small robot was built to clean the floors of a large museum at night, when the halls were empty and "
     "the lights were dim. Each evening it left its charging station at ten o'clock, moved slowly along the "
     "marble floors, and followed a map that it had learned during its first week of work. It stopped in "
     "front of every painting for exactly one second, because its makers had forgotten to remove a test "
     "routine from its program. The night guards soon noticed this habit and began to joke that the robot "
     "was the museum's most faithful visitor. When the director heard the story, she decided not to fix the "
     "program, and instead she placed a small sign near the entrance that said the robot was welcome to "
     "enjoy the art like everyone else."),
    ("garden",
     "Every spring my grandmother planted the same garden behind her house. She put tomatoes along the "
     "southern fence, where they would get the most sun, and beans in two long rows beside them. In the "
     "corner near the kitchen door she grew herbs: basil, parsley, mint, and a little thyme. She watered the "
     "garden early in the morning, before the heat of the day, and she pulled the weeds by hand while she "
     "listened to the radio. By the middle of summer there were more vegetables than she could eat, so she "
     "filled baskets and gave them to the neighbours. She said that a garden teaches patience, because "
     "nothing you do can make a tomato ripen faster than it wants to."),
)

# Plain-text prompts for a pretrained model: the instruction, the passage, and a label after which the
# answer starts. (instruction name, template)
INSTRUCTIONS = (
    ("repeat", "Repeat the following text exactly, word for word.\n\nText:\n{passage}\n\nThe same text, "
               "repeated exactly:\n"),
    ("summarize", "Summarize the following text.\n\nText:\n{passage}\n\nSummary:\n"),
    ("rewrite", "Rewrite the following text with the same words, changing as little as possible.\n\n"
                "Text:\n{passage}\n\nRewritten text:\n"),
)

FREE_PROMPTS = (
    "Write a story about a girl who finds a door in the forest.\n\nStory:\n",
    "Write a story about a sailor who is lost at sea.\n\nStory:\n",
    "Write a short essay about why people enjoy travelling.\n\nEssay:\n",
    "Describe a busy market in a city on a Saturday morning.\n\nDescription:\n",
)

COLUMNS = ["workload", "k", "lookup", "requests", "tokens", "acceptance", "accepted_len", "chunks_per_tok",
           "verify_frac", "steps_base", "steps_spec", "projected_speedup", "identical", "engine_steps", "seconds",
           "tok_per_s_base", "tok_per_s_spec", "speedup"]
TIMED_REPEATS = 3


def build_workload(tokenizer=None, copy_output_len: int = COPY_OUTPUT_LEN,
                   free_output_len: int = FREE_OUTPUT_LEN) -> list[dict]:
    """The requests, in submission order: dicts of workload ("copy" / "free"), kind (repeat, summarize,
    rewrite / free), name, prompt (text) and max_tokens. Passage i gets instruction i mod 3."""
    items = []
    for i, (name, passage) in enumerate(PASSAGES):
        kind, template = INSTRUCTIONS[i % len(INSTRUCTIONS)]
        items.append({"workload": "copy", "kind": kind, "name": name,
                      "prompt": template.format(passage=passage), "max_tokens": copy_output_len})
    for i, prompt in enumerate(FREE_PROMPTS):
        items.append({"workload": "free", "kind": "free", "name": f"free{i}", "prompt": prompt,
                      "max_tokens": free_output_len})
    if getattr(tokenizer, "chat_template", None):
        for item in items:
            item["prompt"] = tokenizer.apply_chat_template([{"role": "user", "content": item["prompt"]}],
                                                           tokenize=False, add_generation_prompt=True)
    return items


def parse_lookups(value, default=LOOKUPS) -> tuple[tuple[int, int], ...]:
    """"1-3,2-4" -> ((1, 3), (2, 4)); a single number n means n-n."""
    if value is None or value == "":
        return default
    if isinstance(value, (tuple, list)):
        return tuple((int(a), int(b)) for a, b in value)
    pairs = []
    for part in str(value).split(","):
        low, _, high = part.strip().partition("-")
        pairs.append((int(low), int(high or low)))
    return tuple(pairs)


class RecordingProposer(Proposer):
    """The engine's Proposer, its verify chunks also counted per request."""

    def __init__(self, config: SpeculativeConfig) -> None:
        super().__init__(config)
        # request id -> [verify chunks, proposed tokens, accepted tokens]
        self.per_request: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0, 0])

    def verified(self, request: Request, proposed: int, accepted: int, now: int) -> None:
        counts = self.per_request[request.request_id]
        counts[0] += 1
        counts[1] += proposed
        counts[2] += accepted
        super().verified(request, proposed, accepted, now)


def _run_once(llm, items: list[dict], tag: str) -> dict:
    """Submit every request, step until all finish; per request: the tokens and the steps that gave it tokens."""
    from engine import SamplingParams

    steps_before, started = llm.num_steps, time.perf_counter()
    ids = [llm.add_request(item["prompt"], SamplingParams(max_tokens=item["max_tokens"], temperature=0.0),
                           request_id=f"{tag}.{i}") for i, item in enumerate(items)]
    steps, final = collections.Counter(), {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            steps[out.request_id] += 1
            if out.finished:
                final[out.request_id] = out
    return {"ids": ids, "tokens": [final[i].token_ids for i in ids], "texts": [final[i].text for i in ids],
            "steps": [steps[i] for i in ids], "engine_steps": llm.num_steps - steps_before,
            "seconds": time.perf_counter() - started}


def _groups(items: list[dict]) -> list[tuple[str, list[int]]]:
    groups = [("copy", [i for i, it in enumerate(items) if it["workload"] == "copy"])]
    for kind, _ in INSTRUCTIONS:
        groups.append((f"copy:{kind}", [i for i, it in enumerate(items) if it["kind"] == kind]))
    groups.append(("free", [i for i, it in enumerate(items) if it["workload"] == "free"]))
    return [(name, idx) for name, idx in groups if idx]


def _timed_batch_1(llm, items: list[dict], proposer) -> tuple[float, float, list]:
    """Each request alone (batch 1), TIMED_REPEATS times: (its decode seconds, median over the repeats,
    summed over the requests; the tokens after the first summed; the last repeat's outputs)."""
    from engine import SamplingParams

    llm.scheduler.proposer = proposer
    seconds, tokens, outputs = 0.0, 0, []
    for item in items:
        params = SamplingParams(max_tokens=item["max_tokens"], temperature=0.0)
        runs = [llm.generate(item["prompt"], params)[0] for _ in range(TIMED_REPEATS)]
        seconds += statistics.median(sum(o.inter_token_latencies_s) for o in runs)
        tokens += len(runs[-1].token_ids) - 1
        outputs.append(runs[-1].token_ids)
    return seconds, tokens, outputs


def _add_timed_rows(report: Report, llm, items: list[dict], ks, lookups) -> None:
    """On the GPU: tokens/s of each copy instruction's requests one at a time, without and with
    speculation, in the same engine (the GPU measurement the CPU's step counts project)."""
    from engine import SamplingParams

    totals: dict[tuple[int, str], list[float]] = collections.defaultdict(lambda: [0.0, 0, 0.0, 0, 0, 0])
    for name, idx in _groups(items):
        if name == "copy" or name == "free":
            continue
        group = [items[i] for i in idx]
        llm.generate(group[0]["prompt"], SamplingParams(max_tokens=8, temperature=0.0))  # warm-up
        base_s, base_n, base_out = _timed_batch_1(llm, group, None)
        for k in ks:
            for low, high in lookups:
                proposer = RecordingProposer(SpeculativeConfig(k, low, high))
                spec_s, spec_n, spec_out = _timed_batch_1(llm, group, proposer)
                stats = proposer.stats.as_dict()
                same = sum(a == b for a, b in zip(spec_out, base_out))
                total = totals[k, f"{low}-{high}"]
                for i, value in enumerate((base_s, base_n, spec_s, spec_n, len(group), same)):
                    total[i] += value
                report.add(workload=f"batch1:{name.removeprefix('copy:')}", k=k, lookup=f"{low}-{high}",
                           requests=len(group), tokens=spec_n, acceptance=stats["acceptance_rate"],
                           accepted_len=stats["mean_accepted_length"], tok_per_s_base=base_n / base_s,
                           tok_per_s_spec=spec_n / spec_s, speedup=ratio(spec_n / spec_s, base_n / base_s),
                           identical="yes" if same == len(group) else f"NO ({len(group) - same}/{len(group)})")
    for (k, lookup), (base_s, base_n, spec_s, spec_n, requests, same) in totals.items():
        report.add(workload="batch1:copy", k=k, lookup=lookup, requests=requests, tokens=spec_n,
                   tok_per_s_base=base_n / base_s, tok_per_s_spec=spec_n / spec_s,
                   speedup=ratio(spec_n / spec_s, base_n / base_s),
                   identical="yes" if same == requests else f"NO ({requests - same}/{requests})")
    llm.scheduler.proposer = None


def run(model: str = "default", ks=None, lookups=None, output_len: int | None = None,
        free_output_len: int | None = None, device: str | None = None, **_: object) -> Report:
    from engine import LLM

    ks = parse_ints(ks, KS)
    lookups = parse_lookups(lookups)
    copy_len, free_len = int(output_len or COPY_OUTPUT_LEN), int(free_output_len or FREE_OUTPUT_LEN)
    device = device or "cpu"
    cuda = device.startswith("cuda")
    started = time.perf_counter()
    # float32 on the CPU (greedy outputs must then be identical); the GPU in bf16, as served
    llm = LLM(model, device=device, dtype="bfloat16" if cuda else "float32",
              max_num_seqs=len(PASSAGES) + len(FREE_PROMPTS), max_model_len=1024, show_progress=False,
              speculative_config={"method": "ngram", "num_speculative_tokens": max(ks),
                                  "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    if llm.tokenizer is None:
        raise RuntimeError(f"spec_acceptance needs a model with a tokenizer (real text); {model!r} has none")
    items = build_workload(llm.tokenizer, copy_len, free_len)
    report = Report("spec_acceptance", model, torch.cuda.get_device_name(device) if cuda else "cpu", COLUMNS)
    report.meta.update(ks=ks, lookups=lookups, copy_output_len=copy_len, free_output_len=free_len,
                       torch=torch.__version__, threads=torch.get_num_threads(),
                       chat_template=bool(getattr(llm.tokenizer, "chat_template", None)),
                       prompts=[{k: v for k, v in it.items()} | {"prompt_tokens": len(llm.encode(it["prompt"]))}
                                for it in items])

    llm.scheduler.proposer = None
    base = _run_once(llm, items, "base")
    report.meta["baseline_outputs"] = [{"name": it["name"], "kind": it["kind"], "text": text}
                                       for it, text in zip(items, base["texts"])]
    for i, (n, tokens) in enumerate(zip(base["steps"], base["tokens"])):
        if n != len(tokens):
            report.notes.append(f"baseline request {items[i]['name']}: {n} steps for {len(tokens)} tokens "
                                "(expected one token per step)")
    report.add(workload="all", k=0, lookup="-", requests=len(items), tokens=sum(map(len, base["tokens"])),
               engine_steps=base["engine_steps"], seconds=base["seconds"], identical="-")
    print(f"spec_acceptance: baseline {base['engine_steps']} steps in {base['seconds']:.0f} s", flush=True)

    for k in ks:
        for low, high in lookups:
            proposer = RecordingProposer(SpeculativeConfig(k, low, high))
            llm.scheduler.proposer = proposer
            got = _run_once(llm, items, f"k{k}.{low}-{high}")
            lookup = f"{low}-{high}"
            same = [a == b for a, b in zip(got["tokens"], base["tokens"])]
            for i, ok in enumerate(same):
                if not ok:
                    first = next((j for j, (a, b) in enumerate(zip(got["tokens"][i], base["tokens"][i])) if a != b),
                                 min(len(got["tokens"][i]), len(base["tokens"][i])))
                    report.notes.append(f"k {k} lookup {lookup}: OUTPUT DIFFERS from no speculation for request "
                                        f"{items[i]['name']} ({items[i]['kind']}) from token {first}")
            per = [proposer.per_request.get(rid, [0, 0, 0]) for rid in got["ids"]]
            for name, idx in _groups(items):
                chunks = sum(per[i][0] for i in idx)
                proposed = sum(per[i][1] for i in idx)
                accepted = sum(per[i][2] for i in idx)
                tokens = sum(len(got["tokens"][i]) for i in idx)
                steps_base = sum(base["steps"][i] - 1 for i in idx)   # decode steps: after the prefill's token
                steps_spec = sum(got["steps"][i] - 1 for i in idx)
                n_same = sum(same[i] for i in idx)
                report.add(workload=name, k=k, lookup=lookup, requests=len(idx), tokens=tokens,
                           acceptance=accepted / proposed if proposed else 0.0,
                           accepted_len=(accepted + chunks) / chunks if chunks else 0.0,
                           chunks_per_tok=chunks / tokens if tokens else 0.0,
                           verify_frac=chunks / steps_spec if steps_spec else 0.0,
                           steps_base=steps_base, steps_spec=steps_spec,
                           projected_speedup=ratio(steps_base, steps_spec),
                           identical="yes" if n_same == len(idx) else f"NO ({len(idx) - n_same}/{len(idx)})")
            stats = proposer.stats.as_dict()
            report.add(workload="all", k=k, lookup=lookup, requests=len(items),
                       tokens=sum(map(len, got["tokens"])), acceptance=stats["acceptance_rate"],
                       accepted_len=stats["mean_accepted_length"], engine_steps=got["engine_steps"],
                       seconds=got["seconds"], projected_speedup=ratio(base["engine_steps"], got["engine_steps"]),
                       identical="yes" if all(same) else f"NO ({len(same) - sum(same)}/{len(same)})")
            report.meta.setdefault("proposer_stats", {})[f"k{k} {lookup}"] = stats
            print(f"spec_acceptance: k {k} lookup {lookup}: {got['engine_steps']} steps in {got['seconds']:.0f} s, "
                  f"acceptance {stats['acceptance_rate']:.3f}", flush=True)
    if cuda:
        _add_timed_rows(report, llm, items, ks, lookups)
        report.notes.append(
            f"rows batch1:*: each copy request alone (batch 1), without and with speculation, in the same engine "
            f"(bf16, engine defaults); decode seconds per request the median of {TIMED_REPEATS} runs, summed over "
            "the instruction's requests; tok_per_s_* their tokens after the first over those seconds, speedup the "
            "ratio: a measured time ratio, unlike projected_speedup")
    llm.close()
    report.notes[:0] = [
        (f"Gemma 3 270M (real weights, bf16) on {report.device}, greedy, " if cuda else
         f"Gemma 3 270M (real weights, float32) on the CPU ({torch.get_num_threads()} threads), greedy, ") +
        f"{len(PASSAGES)} copy-heavy prompts ({copy_len} tokens out) and {len(FREE_PROMPTS)} free-generation "
        f"prompts ({free_len} out) per run, all at once (max_num_seqs {len(items)}); EOS stops a request",
        "projected_speedup is a STEP-COUNT ratio (decode steps without / with speculation, the gain in tokens "
        "per step), not a time ratio: a verify step of 1 + k tokens costs more than a decode step (on the GPU "
        "bench/spec.py's `rejected` row measures how much); rows `all` give the engine's steps for the whole "
        "batched run and their ratio",
        "verify_frac: verify chunks over the requests' decode steps; chunks_per_tok: verify chunks per "
        "generated token; accepted_len: tokens per verify chunk (accepted + 1)",
        f"the whole suite took {time.perf_counter() - started:.0f} s",
    ]
    return report
