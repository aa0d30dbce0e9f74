"""A randomized engine-level test: the default step loop (async scheduling, the host one step ahead)
against the synchronous one (async_scheduling=False), through the public API only.

Each seeded workload mixes, in one run of each loop: requests streamed with add_request / step and
arriving over time, aborts (some right after a step that launched a step for the request, so a
token is in flight; some at a fixed step, whatever the request is doing: waiting, prefilling,
preempted), a KV pool small enough to preempt, repeated prompt prefixes for the prefix cache, stop
strings (a real byte-level BPE tokenizer, tests/tiny_tokenizer.py), stop_token_ids, EOS,
max_tokens and max_model_len, greedy and seeded sampling, "n > 1" as several requests with one
prompt and different seeds, penalties, min_tokens, logprobs, and a generate() call while streamed
requests run. Four requests of each workload are of fixed kinds (one ends at max_model_len, one is
aborted with a token in flight, one is stopped by any non-special token, one by the most frequent
characters), so the coverage asserted at the end does not hang on what the random-weight model
happens to generate. The models: a tiny Llama (one KV pool) and a tiny Gemma 3 whose sliding-window
layers have their own pool (window 8, blocks of 4 tokens), with the pools' debug checks on (every
step: each block in exactly one state, no write into a shared or published block).

Checked: every request that was not aborted gets the same tokens, text and finish reason from both
loops; an aborted request ends with one finished "abort" output whose tokens are consistent with the
other loop's (one is a prefix of the other: an abort lands at a different step boundary); each
stream's outputs extend each other; and once everything has finished nothing leaks: no request runs
or waits, every block of every KV group is free again (blocks the prefix cache keeps unreferenced
count as free: they are evicted on demand), as on a fresh engine, and no device token slot is held.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
import transformers

from engine import LLM, RequestOutput, SamplingParams
from tests.hf_helpers import random_hf_model
from tests.tiny_tokenizer import CORPUS, save_tiny_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

BOS, EOS = 2, 1  # the tiny tokenizer's <bos> and <eos>
MODEL = dict(max_position_embeddings=128, initializer_range=0.5, pad_token_id=0, bos_token_id=BOS,
             eos_token_id=EOS, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2)
ARCHS = {
    "llama": (transformers.LlamaConfig, dict(num_hidden_layers=2)),
    # one full-attention layer and two sliding ones (window 8): their own pool, blocks given back
    "gemma3": (transformers.Gemma3TextConfig, dict(num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=16,
                                                   sliding_window=8, sliding_window_pattern=3,
                                                   final_logit_softcapping=30.0)),
}
MAX_MODEL_LEN = 64
# 23 usable blocks of 4 tokens for Llama: six requests of up to ~60 tokens cannot all fit, so the
# scheduler preempts. For Gemma 3 the same budget in bytes is split between the groups (its sliding
# pool gets 9 usable blocks), and the sliding pool is what runs short.
ENGINE = dict(device="cpu", block_size=4, max_model_len=MAX_MODEL_LEN, max_num_seqs=6, max_num_batched_tokens=16,
              num_gpu_blocks=24, enable_prefix_caching=True, hybrid_kv_cache=True)
MAX_STEPS = 1000  # step() calls per run; the workloads need 130-200
# The random-weight models' text is short ASCII pieces and stray bytes: "a" and "e" appear in about
# three outputs of four, the longer ones (held back while a prefix of them ends the text) in one of four.
STOP_STRINGS = ("a", "e", "o", " ", "de", "ade", "you", " +")
# Prompt heads shared by many requests (whole blocks of them hit the prefix cache), and tails.
HEADS = [c[:n] for c, n in zip(CORPUS, (33, 30, 20, 14, 12, 26))]
TAILS = ["Paris", " and", " Berlin?", " fine", " jalapeño", " 🙂", " are you", " fibonacci(n)", " Zürich.", "!"]


@pytest.fixture(autouse=True)
def _debug_checks(monkeypatch):
    monkeypatch.setenv("INFER_GRAPHS_DEBUG_CHECKS", "1")  # the pools check their states every step


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    """arch -> an HF-format dir: random weights over the tiny tokenizer's vocabulary, saved with it."""
    dirs = {}
    for arch, (config_cls, kwargs) in ARCHS.items():
        path = tmp_path_factory.mktemp(f"random_{arch}")
        vocab = save_tiny_tokenizer(path)
        random_hf_model(config_cls(vocab_size=vocab, **MODEL, **kwargs), seed=5).save_pretrained(path)
        dirs[arch] = path
    return dirs


# -- the workload ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Arrival:
    step: int                       # added before this step() call (0-based)
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    abort_after_tokens: int | None = None  # abort right after the step() whose output gave it this many
    abort_at_step: int | None = None       # abort right after this step() call, whatever it is doing


@dataclass(frozen=True)
class Workload:
    arrivals: list[Arrival]
    generate_step: int                     # a generate() call right before this step() call
    generate_prompts: list[str | list[int]]
    generate_params: list[SamplingParams]


def _sampling(rng: random.Random, vocab: int, greedy: bool | None = None) -> SamplingParams:
    if greedy is None:
        greedy = rng.random() < 0.5
    sampled = {} if greedy else dict(temperature=rng.choice((0.7, 1.0, 1.3)), top_k=rng.choice((0, 5, 40)),
                                     top_p=rng.choice((1.0, 0.9)), seed=rng.randrange(2**31))
    stop = tuple(rng.sample(STOP_STRINGS, rng.randint(1, 2))) if rng.random() < 0.4 else ()
    # 16 of the ~380 ids: a random-weight model generates one of them now and then
    stop_ids = tuple(rng.sample(range(3, vocab), 16)) if rng.random() < 0.4 else ()
    extra = {}
    if rng.random() < 0.15:  # per-token state on the device, updated by every step that samples
        extra.update(presence_penalty=rng.uniform(-1, 1), frequency_penalty=rng.uniform(-1, 1),
                     repetition_penalty=rng.uniform(0.8, 1.3))
    if rng.random() < 0.15:
        extra["logprobs"] = rng.choice((0, 3))
    max_tokens = rng.randint(1, 24)
    if rng.random() < 0.1:
        extra["min_tokens"] = rng.randint(1, max_tokens)
    return SamplingParams(max_tokens=max_tokens, ignore_eos=rng.random() < 0.5, stop=stop, stop_token_ids=stop_ids,
                          **sampled, **extra)


def _prompt(rng: random.Random, vocab: int, earlier: list[str | list[int]]) -> str | list[int]:
    kind = rng.random()
    if kind < 0.2 and earlier:
        return rng.choice(earlier)  # the very same prompt again: every whole block of it can hit
    if kind < 0.65:
        return rng.choice(HEADS) + "".join(rng.sample(TAILS, rng.randint(1, 3)))
    # token ids; one prompt in ten so long that its output can end at max_model_len
    length = rng.randint(1, 30) if kind < 0.9 else rng.randint(50, MAX_MODEL_LEN - 2)
    return [BOS] + [rng.randrange(3, vocab) for _ in range(length)]


def make_workload(seed: int, vocab: int, num_requests: int = 40) -> Workload:
    rng = random.Random(seed)
    arrivals: list[Arrival] = []
    prompts: list[str | list[int]] = []
    step = 0
    while len(arrivals) < num_requests:
        step += rng.choice((0, 0, 1, 2, 3, 5))
        prompt = _prompt(rng, vocab, prompts)
        prompts.append(prompt)
        n = rng.choice((2, 3)) if rng.random() < 0.2 else 1
        if n > 1:  # "n > 1": one prompt, one set of parameters, a seed per sample
            base = _sampling(rng, vocab, greedy=False)
            group = [replace(base, seed=base.seed + i) for i in range(n)]
        else:
            group = [_sampling(rng, vocab)]
        for params in group:
            abort_after = abort_at = None
            roll = rng.random()
            if roll < 0.15 and params.max_tokens > 1:
                abort_after = rng.randint(1, params.max_tokens - 1)
            elif roll < 0.25:
                abort_at = step + rng.randint(0, 8)
            arrivals.append(Arrival(step, f"r{len(arrivals)}", prompt, params, abort_after, abort_at))
    generate_step = rng.randint(3, max(3, step))
    # and one request of each kind the test must see, whatever the model generates: one that ends at
    # max_model_len, one aborted with a token in flight, one that any token but the special ones stops,
    # one that the most frequent characters stop; added after the generate() call, which could run
    # them to their end between two outputs
    plain = SamplingParams(max_tokens=20, ignore_eos=True)
    anchors = [([BOS] + [rng.randrange(3, vocab) for _ in range(MAX_MODEL_LEN - 4)], plain, None),
               (rng.choice(HEADS), plain, 4),
               (rng.choice(HEADS), replace(plain, stop_token_ids=tuple(range(3, vocab))), None),
               (rng.choice(HEADS), replace(plain, stop=tuple("aeoi nrdlt")), None)]
    for i, (prompt, params, abort_after) in enumerate(anchors):
        arrivals.append(Arrival(rng.randint(generate_step + 1, step + 2), f"a{i}", prompt, params,
                                abort_after_tokens=abort_after))
    generate_prompt = rng.choice(HEADS) + rng.choice(TAILS)
    base = _sampling(rng, vocab, greedy=False)
    generate_params = [replace(base, seed=base.seed + i) for i in range(2)]
    generate_params.append(_sampling(rng, vocab, greedy=True))
    return Workload(arrivals, generate_step, [generate_prompt] * 3, generate_params)


# -- one run ----------------------------------------------------------------------------------------

@dataclass
class Stream:
    """What a client of one request saw: its outputs' running state, checked as each output comes."""
    params: SamplingParams
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    final: RequestOutput | None = None
    aborted: bool = False  # LLM.abort returned True for it

    def take(self, out: RequestOutput, vocab: int) -> None:
        rid = out.request_id
        assert self.final is None, f"request {rid}: an output after its final one"
        assert out.token_ids[:len(self.token_ids)] == self.token_ids, f"request {rid}: tokens were rewritten"
        assert out.new_token_ids == out.token_ids[len(self.token_ids):], f"request {rid}: delta tokens"
        assert out.text == self.text + out.new_text, f"request {rid}: delta text"
        assert all(0 <= t < vocab for t in out.token_ids), f"request {rid}: a token out of the vocabulary"
        assert len(out.token_ids) <= self.params.max_tokens
        if not self.params.min_tokens:  # before min_tokens a stop string is text like any other (vLLM's rule)
            assert not any(s in out.text for s in self.params.stop), f"request {rid}: a stop string in the text"
        if self.params.logprobs is not None:
            assert [lp.token_id for lp in out.logprobs] == out.token_ids, f"request {rid}: logprobs"
            assert all(len(lp.top) == self.params.logprobs for lp in out.logprobs)
        self.token_ids, self.text = list(out.token_ids), out.text
        if out.finished:
            self.final = out
        else:
            assert out.finish_reason is None


def run(path: Path, workload: Workload, async_scheduling: bool,
        frontend_process: bool = False) -> tuple[dict[str, Stream], dict, dict]:
    """Every request's stream (generate()'s outputs under ids "gen0", ...), the stats of the engine when
    fresh and once everything has finished."""
    llm = LLM(str(path), **ENGINE, async_scheduling=async_scheduling, frontend_process=frontend_process)
    assert llm.stats()["frontend_process"] is frontend_process
    vocab = llm.model_config.vocab_size
    fresh = llm.stats()
    streams = {a.request_id: Stream(a.params) for a in workload.arrivals}
    arrivals = sorted(workload.arrivals, key=lambda a: a.step)  # stable: ids in order within a step
    abort_at: dict[int, list[str]] = {}
    for a in arrivals:
        if a.abort_at_step is not None:
            abort_at.setdefault(a.abort_at_step, []).append(a.request_id)
    abort_after = {a.request_id: a.abort_after_tokens for a in arrivals if a.abort_after_tokens is not None}
    step = 0
    while arrivals or llm.has_unfinished_requests():
        assert step < MAX_STEPS, f"still unfinished after {MAX_STEPS} steps (async_scheduling={async_scheduling})"
        while arrivals and arrivals[0].step <= step:
            a = arrivals.pop(0)
            assert llm.add_request(a.prompt, a.params, a.request_id) == a.request_id
        if step == workload.generate_step:  # the streamed requests advance meanwhile, reported at the next step()
            outs = llm.generate(workload.generate_prompts, workload.generate_params)
            for i, (out, params) in enumerate(zip(outs, workload.generate_params)):
                assert out.finished
                streams[f"gen{i}"] = Stream(params)
                streams[f"gen{i}"].take(out, vocab)
        outs = llm.step()
        assert len({o.request_id for o in outs}) == len(outs), "two outputs of one request in one step"
        for out in outs:
            streams[out.request_id].take(out, vocab)
        # right after the step that launched the next one for it: under async scheduling that token is in flight
        for out in outs:
            k = abort_after.get(out.request_id)
            if k is not None and len(out.token_ids) >= k and not out.finished:
                del abort_after[out.request_id]
                streams[out.request_id].aborted = llm.abort(out.request_id)
                assert streams[out.request_id].aborted
        for rid in abort_at.pop(step, []):
            streams[rid].aborted = llm.abort(rid)  # False if it has already finished
            assert llm.abort(rid) is False  # idempotent
        step += 1
    assert llm.abort("no-such-request") is False
    # Under async scheduling the last launched step can still be in flight here, every token of it
    # sampled past its request's end (a stop string or an abort seen after the launch): one more step
    # reads it, reports nothing and gives its requests' device token slots back.
    assert llm.step() == []
    done = llm.stats()
    slots = _device_token_slots_held(llm)
    assert slots in (None, 0), f"{slots} device token slots still held after every request finished"
    assert not llm.has_unfinished_requests()
    llm.close()
    return streams, fresh, done


def _device_token_slots_held(llm: LLM) -> int | None:
    """The async loop's device token slots still held (one per request until it finishes). Engine
    internals, read defensively: None where this version of the engine keeps no such map."""
    for name in ("_loop", "_overlap"):
        slots = getattr(getattr(getattr(llm, name, None), "slots", None), "_slots", None)
        if slots is not None:
            return len(slots)
    return None


def check_finished(rid: str, stream: Stream, prompt_len: int) -> None:
    """One stream's final output: finished once, for a reason its tokens and parameters bear out."""
    final, params = stream.final, stream.params
    assert final is not None, f"request {rid} never reported a finished output"
    reason, tokens = final.finish_reason, final.token_ids
    if stream.aborted:
        assert reason == "abort", f"request {rid}: aborted, finished with {reason!r}"
        return
    if reason in ("eos", "stop"):
        assert len(tokens) >= params.min_tokens, f"request {rid}: ended before min_tokens"
    if reason == "length":
        assert len(tokens) == params.max_tokens or prompt_len + len(tokens) == MAX_MODEL_LEN, rid
    elif reason == "eos":
        assert not params.ignore_eos and tokens[-1] == EOS, rid
    elif reason == "stop":
        assert tokens[-1] in params.stop_token_ids or params.stop, rid
    else:
        raise AssertionError(f"request {rid}: finish_reason {reason!r}, yet it was not aborted")


# -- the test ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_random_workload_async_loop_equals_the_synchronous_loop_and_leaks_nothing(model_dirs, arch, seed):
    path = model_dirs[arch]
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    vocab = len(tokenizer)
    workload = make_workload(seed, vocab)
    prompt_len = {a.request_id: len(a.prompt) if isinstance(a.prompt, list) else len(tokenizer(a.prompt)["input_ids"])
                  for a in workload.arrivals}
    prompt_len.update({f"gen{i}": len(tokenizer(p)["input_ids"]) for i, p in enumerate(workload.generate_prompts)})

    sync, sync_fresh, sync_done = run(path, workload, async_scheduling=False)
    overlapped, fresh, done = run(path, workload, async_scheduling=True)
    # the text in a process of its own: stop strings found there end their requests a step or two later
    remote, remote_fresh, remote_done = run(path, workload, async_scheduling=True, frontend_process=True)

    assert sync.keys() == overlapped.keys() == remote.keys()
    for rid, b in [(rid, s) for rid, s in overlapped.items()] + [(rid, s) for rid, s in remote.items()]:
        a = sync[rid]
        check_finished(rid, a, prompt_len[rid])
        check_finished(rid, b, prompt_len[rid])
        if a.aborted or b.aborted:
            # the abort landed at a step boundary of each loop: the tokens agree as far as both go
            n = min(len(a.token_ids), len(b.token_ids))
            assert a.token_ids[:n] == b.token_ids[:n], f"request {rid}: aborted, tokens diverge"
            if a.aborted and b.aborted and len(a.token_ids) == len(b.token_ids):
                assert a.text == b.text, f"request {rid}: aborted after the same tokens, different text"
            continue
        assert (b.token_ids, b.text, b.final.finish_reason) == (a.token_ids, a.text, a.final.finish_reason), \
            f"request {rid} ({a.params}): async scheduling differs from the synchronous loop"
        if a.params.logprobs is not None:  # the same logits up to the batch they ran in
            assert [lp.logprob for lp in b.final.logprobs] == pytest.approx([lp.logprob for lp in a.final.logprobs],
                                                                            abs=1e-4), rid

    for stats_fresh, stats in ((sync_fresh, sync_done), (fresh, done), (remote_fresh, remote_done)):
        # nothing leaks: no request left, every block of every group free again or cached unreferenced
        # (BlockPool.num_free_blocks counts those: they are evicted when a block is needed)
        assert stats["requests_running"] == stats["requests_waiting"] == 0
        assert stats_fresh["kv_blocks_free"] == stats_fresh["kv_blocks"] - 1
        assert stats["kv_blocks_free"] == stats_fresh["kv_blocks_free"]
        assert [g["blocks_free"] for g in stats["kv_groups"]] == [g["blocks"] - 1 for g in stats["kv_groups"]] \
            == [g["blocks_free"] for g in stats_fresh["kv_groups"]]
        assert stats["prefix_cache"]["cached_blocks"] > 0  # the invariant above holds with blocks kept cached
        # the workload did what it is for, in both loops
        assert stats["preemptions"] > 0
        assert stats["prefix_cache"]["hit_tokens"] > 0
    assert done["async_scheduling"] and not sync_done["async_scheduling"]
    assert done["async_discarded_tokens"] > 0  # tokens sampled past a stop or an abort were dropped
    if arch == "gemma3":
        assert [g["kind"] for g in done["kv_groups"]] == ["full", "sliding_8"]

    # and the workload covered what it mixes (the same in both loops: checked above)
    finals = {rid: s.final for rid, s in sync.items()}
    params = {rid: s.params for rid, s in sync.items()}
    reasons = [f.finish_reason for f in finals.values()]
    assert {"length", "stop", "abort"} <= set(reasons)
    assert any(f.finish_reason == "stop" and params[r].stop and f.token_ids[-1] not in params[r].stop_token_ids
               for r, f in finals.items()), "no request ended at a stop string"
    assert any(f.finish_reason == "stop" and f.token_ids and f.token_ids[-1] in params[r].stop_token_ids
               for r, f in finals.items()), "no request ended at a stop token"
    assert any(s.aborted and s.final.token_ids for s in overlapped.values()), \
        "no request was aborted after it had generated tokens"
    assert any(f.finish_reason == "length" and len(f.token_ids) < params[r].max_tokens for r, f in finals.items()), \
        "no request ended at max_model_len"
    assert any(s.final.num_preemptions for s in overlapped.values()), "no request was preempted"
    assert any(p.temperature > 0 for p in params.values()) and any(p.temperature == 0 for p in params.values())
