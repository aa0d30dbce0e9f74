"""Speculative decoding through the engine on the CPU: greedy outputs identical to decoding without it
(every architecture, both step-loop depths, prefix caching, preemption, limits, stop tokens, aborts,
logprobs), sampled outputs distributed as without it, the config and CLI, the back-off, the dispatch.

The verification itself against its definition is tests/test_spec_verify.py.
"""
from __future__ import annotations

import collections

import pytest

from engine import LLM, ConfigError, SamplingParams
from engine.entrypoints.cli import build_parser
from engine.request import Request
from engine.spec.config import SpeculativeConfig
from engine.spec.proposer import MAX_BACKOFF_STEPS, Proposer
from engine.worker.dispatch import BatchDescriptor, Dispatcher
from custom_ops import RuntimeMode
from tests.spec_helpers import replay
from tests.test_engine_generate import ARCHS, _build_hf

pytestmark = pytest.mark.usefixtures("one_thread")

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
CONFIG = dict(device="cpu", block_size=4, max_model_len=96, max_num_seqs=4, max_num_batched_tokens=16)
PROMPTS = [[1, 5, 9, 13, 5, 9, 13, 5, 9], [1, 40, 41, 42, 43, 40, 41, 42, 43, 40], [1, 7],
           [1, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 20, 21, 22]]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    dirs = {}
    for arch in ARCHS:
        path = tmp_path_factory.mktemp(f"spec_{arch}")
        _build_hf(arch).save_pretrained(path)
        dirs[arch] = str(path)
    return dirs


def _reference(path: str, prompts, params: SamplingParams, **config):
    """(outputs of an engine without speculation, prompt -> prompt + output tokens)."""
    with LLM(path, **{**CONFIG, **config}) as llm:
        outs = llm.generate(prompts, params)
    return outs, {tuple(p): list(p) + o.token_ids for p, o in zip(prompts, outs)}


def _speculating(path: str, k: int = 3, **config) -> LLM:
    return LLM(path, **{**CONFIG, **config}, speculative_config={**NGRAM, "num_speculative_tokens": k})


# -- greedy: identical token for token -----------------------------------------------------------------

@pytest.mark.parametrize("arch,async_scheduling", [("llama", True), ("llama", False), ("qwen3", True),
                                                   ("gemma3", True), ("gemma3", False)])
def test_greedy_identical_with_proposals_of_every_quality(model_dirs, arch, async_scheduling):
    path = model_dirs[arch]
    params = SamplingParams(max_tokens=40)
    ref, continuations = _reference(path, PROMPTS, params, async_scheduling=async_scheduling)
    with _speculating(path, async_scheduling=async_scheduling) as llm:
        free = llm.runtime.block_pool.num_free_blocks
        proposer = replay(llm, continuations, wrong=0.25)
        # every prompt twice: the second copies hit the prefix cache the first published
        outs = llm.generate(PROMPTS + PROMPTS, params)
        assert [o.token_ids for o in outs] == [o.token_ids for o in ref] * 2
        stats = llm.stats()["spec_decode"]
        assert stats["verify_chunks"] > 20 and 0 < stats["accepted_tokens"] < stats["proposed_tokens"]
        assert stats["accepted_tokens"] == proposer.stats.accepted
        assert llm.stats()["generated_tokens"] == 2 * sum(len(o.token_ids) for o in ref)
        if arch != "gemma3":  # its sliding layers' blocks leave the window: no full-prompt hits
            assert llm.stats()["prefix_cache"]["hit_tokens"] > 0
        assert llm.runtime.block_pool.num_free_blocks == free  # nothing held once all finished
        if async_scheduling:
            assert stats["waits"] > 0


def test_prompt_lookup_runs_and_changes_nothing(model_dirs):
    path = model_dirs["llama"]
    params = SamplingParams(max_tokens=24)
    ref, _ = _reference(path, PROMPTS, params)
    with _speculating(path) as llm:
        assert [o.token_ids for o in llm.generate(PROMPTS, params)] == [o.token_ids for o in ref]
        stats = llm.stats()["spec_decode"]
    assert stats["verify_chunks"] > 0 and stats["proposed_tokens"] > 0
    # a random model accepts little: the back-off must have stopped most of the attempts
    assert stats["backoffs"] > 0


def test_limits_stop_tokens_and_preemption(model_dirs):
    """max_tokens and max_model_len never overshoot, a stop token ends where it would without
    proposals (tokens after it in the same verify are dropped), and preempted requests recompute."""
    path = model_dirs["llama"]
    base = SamplingParams(max_tokens=30)
    ref, continuations = _reference(path, PROMPTS, base)
    stop = ref[1].token_ids[12]
    params = [SamplingParams(max_tokens=7), SamplingParams(max_tokens=30, stop_token_ids=[stop]),
              SamplingParams(max_tokens=200), base]
    small = dict(num_gpu_blocks=14, max_model_len=40)
    expected, _ = _reference(path, PROMPTS, params, **small)
    with _speculating(path, k=4, **small) as llm:
        replay(llm, continuations, wrong=0.1)
        outs = llm.generate(PROMPTS, params)
        assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
        assert [o.finish_reason for o in outs] == [o.finish_reason for o in expected]
        assert len(outs[0].token_ids) == 7
        assert len(PROMPTS[2]) + len(outs[2].token_ids) == 40  # max_model_len
        assert llm.stats()["preemptions"] > 0


def test_logprobs_are_of_the_tokens_emitted(model_dirs):
    path = model_dirs["qwen3"]
    params = SamplingParams(max_tokens=20, logprobs=2)
    ref, continuations = _reference(path, PROMPTS, params)
    with _speculating(path) as llm:
        replay(llm, continuations, wrong=0.3)
        outs = llm.generate(PROMPTS, params)
        assert llm.stats()["spec_decode"]["accepted_tokens"] > 0
    for got, want in zip(outs, ref):
        assert got.token_ids == want.token_ids
        assert len(got.logprobs) == len(want.logprobs) == len(want.token_ids)
        for a, b in zip(got.logprobs, want.logprobs):
            assert a.token_id == b.token_id
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_abort_with_a_verify_step_in_flight(model_dirs):
    path = model_dirs["llama"]
    params = SamplingParams(max_tokens=40)
    ref, continuations = _reference(path, PROMPTS, params)
    with _speculating(path) as llm:
        free = llm.runtime.block_pool.num_free_blocks
        replay(llm, continuations, wrong=0.0)
        ids = [llm.add_request(p, params) for p in PROMPTS]
        outputs = collections.defaultdict(list)
        aborted = False
        for _ in range(200):
            for out in llm.step():
                outputs[out.request_id] += out.new_token_ids
            if not aborted and len(outputs[ids[1]]) >= 5:
                assert llm.abort(ids[1])
                aborted = True
            if not llm.has_unfinished_requests():
                break
        assert aborted and not llm.has_unfinished_requests()
        for i, request_id in enumerate(ids):
            if i == 1:  # a prefix of its tokens, nothing after the abort
                assert outputs[request_id] == ref[1].token_ids[:len(outputs[request_id])]
            else:
                assert outputs[request_id] == ref[i].token_ids
        assert llm.runtime.block_pool.num_free_blocks == free


# -- sampled: the target's distribution, reproducible with a seed --------------------------------------------

def _sampled_tokens(path: str, speculate: bool, greedy_continuation=None, n: int = 320) -> list[tuple[int, ...]]:
    params = [SamplingParams(max_tokens=3, temperature=1.3, top_k=3, seed=1000 + i) for i in range(n)]
    prompt = PROMPTS[3]
    config = dict(max_num_seqs=8, max_num_batched_tokens=64)
    with (_speculating(path, **config) if speculate else LLM(path, **{**CONFIG, **config})) as llm:
        if speculate:
            replay(llm, {tuple(prompt): greedy_continuation}, wrong=0.0)
        outs = llm.generate([prompt] * n, params)
        if speculate:
            assert llm.stats()["spec_decode"]["accepted_tokens"] > n // 4
    return [tuple(o.token_ids) for o in outs]


def test_sampled_tokens_follow_the_target_distribution(model_dirs):
    """Proposals of the most likely continuation are accepted with probability p, not always: each
    position's token frequencies match sampling without speculation (a verifier that accepted every
    proposal would put far more mass on it)."""
    path = model_dirs["llama"]
    _, continuations = _reference(path, [PROMPTS[3]], SamplingParams(max_tokens=4))
    greedy = continuations[tuple(PROMPTS[3])]
    plain = _sampled_tokens(path, False)
    spec = _sampled_tokens(path, True, greedy)
    assert spec == _sampled_tokens(path, True, greedy)  # seeded: the same tokens again
    for position in range(2):  # the first token (a prefill's) and the first a verify step decides
        a = collections.Counter(t[position] for t in plain)
        b = collections.Counter(t[position] for t in spec)
        tv = sum(abs(a[t] - b[t]) for t in set(a) | set(b)) / (2 * len(plain))
        assert tv < 0.12, (position, a, b)
    for position in (1, 2):  # how often the proposed token comes out: p(proposal), not 1
        proposed = greedy[len(PROMPTS[3]) + position]
        rates = [sum(t[position] == proposed for t in run) / len(run) for run in (plain, spec)]
        assert abs(rates[0] - rates[1]) < 0.1 and rates[1] < 0.9, (position, rates)


# -- parts ------------------------------------------------------------------------------------------------

def test_config_parse_and_errors():
    config = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4})
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (5, 5)  # vLLM's default
    config = SpeculativeConfig.parse({"num_speculative_tokens": 2, "prompt_lookup_max": 3})
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (3, 3)
    for bad, words in [({"num_speculative_tokens": 0}, "num_speculative_tokens"),
                       ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min"),
                       ({"num_speculative_tokens": 2, "method": "eagle"}, "method"),
                       ({"num_speculative_tokens": 2, "method": "draft_model"}, "needs the draft"),
                       ({"num_speculative_tokens": 2, "model": "/d", "prompt_lookup_max": 3}, "prompt_lookup_max"),
                       ({"num_speculative_tokens": 2, "model": "/d", "method": "ngram"}, "'model' is given"),
                       ({"num_speculative_tokens": 2, "model": 3}, "a path or a built model"),
                       ({"num_speculative_tokens": 2, "lookahead": 1}, "lookahead")]:
        with pytest.raises(ConfigError, match="speculative_config") as info:
            LLM("unused", device="cpu", speculative_config=bad)
        assert words in str(info.value)


def test_cli_takes_a_json_object(capsys):
    parser = build_parser()
    args = parser.parse_args(["generate", "--prompt", "x", "--speculative-config",
                              '{"method": "ngram", "num_speculative_tokens": 4}'])
    assert args.speculative_config == {"method": "ngram", "num_speculative_tokens": 4}
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "--prompt", "x", "--speculative-config", "[1, 2]"])
    assert "JSON object" in capsys.readouterr().err


def test_a_proposer_may_allow_misses_before_backing_off():
    """misses_before_backoff (3 for a draft model): that many attempts in a row that gain nothing before
    the request backs off; an acceptance in between starts the count again."""
    proposer = Proposer(SpeculativeConfig.parse(NGRAM))
    proposer.misses_before_backoff = 3
    request = Request("r", [1, 2, 3], SamplingParams())
    for now in (0, 1):
        proposer.verified(request, 3, 0, now)
        assert proposer.eligible(request, now + 1)
    proposer.verified(request, 3, 1, 2)  # accepted: the count starts again
    for now in (3, 4):
        proposer.verified(request, 3, 0, now)
        assert proposer.eligible(request, now + 1)
    proposer.verified(request, 3, 0, 5)
    assert not proposer.eligible(request, 6) and proposer.stats.backoffs == 1


def test_back_off_after_misses_aligned_and_recovery():
    """Attempts that gain nothing space the next ones out (windows doubling up to MAX_BACKOFF_STEPS),
    on steps shared by every backing-off request, and one acceptance ends the back-off."""
    proposer = Proposer(SpeculativeConfig.parse(NGRAM))
    requests = [Request(str(i), [1, 2, 3], SamplingParams()) for i in range(2)]
    probes = {r: [] for r in requests}
    for now in range(400):
        for offset, request in enumerate(requests):  # the second request starts 7 steps later
            if now >= 7 * offset and proposer.eligible(request, now):
                probes[request].append(now)
                proposer.verified(request, 3, 0, now)  # gains nothing
    gaps = [b - a for a, b in zip(probes[requests[0]], probes[requests[0]][1:])]
    assert gaps[0] <= 4 and max(gaps) == MAX_BACKOFF_STEPS and gaps == sorted(gaps) and len(set(gaps)) >= 3
    late = [set(p for p in probes[r] if p > 200) for r in requests]
    assert late[0] == late[1] and all(p % MAX_BACKOFF_STEPS == 0 for p in late[0])
    proposer.verified(requests[0], 3, 2, 400)  # one acceptance: eligible every step again
    assert proposer.eligible(requests[0], 401)
    assert not proposer.eligible(Request("p", [1], SamplingParams(presence_penalty=0.5)), 0)


def test_verify_steps_replay_verify_graphs_or_mixed_graphs():
    dispatcher = Dispatcher((1, 2, 4), (8, 16), decode_graphs_wanted=True, piecewise_graphs_wanted=True,
                            mixed_sizes=(10, 20), verify_graphs_wanted=True, verify_sizes=(2, 4))
    small = dispatcher.dispatch(BatchDescriptor(3, False, verify=True))  # every token a decode row
    assert small.mode is RuntimeMode.FULL and small.descriptor == BatchDescriptor(4, True, True)
    verify = dispatcher.dispatch(BatchDescriptor(5, False, verify=True))
    assert verify.mode is RuntimeMode.FULL and verify.descriptor == BatchDescriptor(10, False, True)
    assert dispatcher.dispatch(BatchDescriptor(5, False)).mode is RuntimeMode.PIECEWISE  # a prefill
    assert dispatcher.dispatch(BatchDescriptor(2, True)).descriptor == BatchDescriptor(2, True)  # a decode
    too_big = dispatcher.dispatch(BatchDescriptor(24, False, verify=True))
    assert too_big.mode is RuntimeMode.NONE and too_big.fallback.startswith("verify step of 24")
    assert dispatcher.fallbacks == 1


def test_bench_spec_rows(model_dirs, tmp_path):
    """`python -m bench spec` on a tiny model: every variant's row, the replayed greedy output accepted
    in full, and no row whose output differs from decoding without speculation."""
    from bench.spec import run
    report = run(model_dirs["llama"], batches="1,2", ks="2", prompt_len=12, output_len=10, repeats=1)
    rows = {(r["batch"], r["variant"]): r for r in report.rows}
    variants = ("none", "ngram", "ceiling", "rejected", "draft", "draft_small")
    assert set(rows) == {(b, v) for b in (1, 2) for v in variants}
    for b in (1, 2):
        assert rows[b, "ceiling"]["acceptance"] == 1.0 and rows[b, "ceiling"]["steps"] < rows[b, "none"]["steps"]
        assert rows[b, "rejected"]["acceptance"] == 0.0 and rows[b, "rejected"]["verify_chunks"] > 0
        assert rows[b, "rejected"]["derived_ceiling_x"] > 0
        # the target as its own draft (float32): every proposal accepted
        assert rows[b, "draft"]["acceptance"] == 1.0 and rows[b, "draft"]["steps"] < rows[b, "none"]["steps"]
        # a one-layer random draft proposes on every step, and the target rejects it
        small = rows[b, "draft_small"]
        assert small["verify_chunks"] > 0 and small["acceptance"] < 0.5 and small["derived_ceiling_x"] > 0
        assert rows[b, "draft"]["draft_ms"] > 0 and small["draft_ms"] > 0
        assert all(rows[b, v]["diverges_at"] is None for v in variants[1:])  # float32
    assert run(model_dirs["llama"], batches="1", ks="1", prompt_len=6, output_len=4, repeats=1,
               variants="rejected").rows[-1]["variant"] == "rejected"
    with pytest.raises(ValueError, match="unknown"):
        run(model_dirs["llama"], batches="1", variants="eagle")


def test_verify_graph_sizes_follow_the_decode_buckets():
    import dataclasses

    from engine import EngineConfig
    from engine.worker.graphs_and_pool import mixed_graph_sizes, verify_graph_sizes
    config = EngineConfig(device="cpu", max_num_seqs=8, speculative_config={**NGRAM, "num_speculative_tokens": 4})
    config = dataclasses.replace(config.resolve(64), cuda_graphs=True, cudagraph_mode="FULL_DECODE_ONLY")
    assert config.decode_graph_sizes == (1, 2, 4, 8)
    assert mixed_graph_sizes(config) == (10, 20, 40)  # up to 8 tokens: the verify graphs' rows
    assert verify_graph_sizes(config) == (2, 4, 5, 8)  # 5: batch 1's 1 + k tokens, no padding row
    assert config.max_logits_rows == 8 * 5
    assert config.max_seq_rows == 8


def test_one_request_at_a_time_still_verifies_under_a_graph_of_its_1_plus_k_rows():
    """max_num_seqs 1 (one user at a time, where speculation pays most): the decode buckets stop at 1,
    but the step's buffers hold 1 + k sequence rows, so batch 1's verify step has a graph of decode rows
    instead of the mixed-step graph (prefill attention and the skinny GEMMs: 1.8x a decode step on an
    H100, bench/results/h100-2026-12-08/validate/)."""
    import dataclasses

    from engine import EngineConfig
    from engine.worker.graphs_and_pool import mixed_graph_sizes, verify_graph_sizes
    config = EngineConfig(device="cpu", max_num_seqs=1, speculative_config={**NGRAM, "num_speculative_tokens": 4})
    config = dataclasses.replace(config.resolve(64), cuda_graphs=True, cudagraph_mode="FULL_DECODE_ONLY")
    assert config.decode_graph_sizes == (1,)
    assert config.max_seq_rows == 5
    assert verify_graph_sizes(config) == (5,)
    assert mixed_graph_sizes(config) == ()
    plain = dataclasses.replace(config, speculative_config=None)
    assert plain.max_seq_rows == 1 and verify_graph_sizes(plain) == ()


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_verify_steps_as_decode_rows_give_the_same_tokens(model_dirs, arch):
    """A verify step under a decode graph runs each token as a decode row of its own (its own
    sequence length over the request's table; padding rows on the scratch block): the CPU reference
    attention through the decode-graph path (run eagerly) gives the tokens of no speculation, the
    sliding-window layers of Gemma 3 included."""
    from tests.test_engine_generate import _EagerDecodeGraphs
    path = model_dirs[arch]
    params = SamplingParams(max_tokens=30)
    ref, continuations = _reference(path, PROMPTS, params)
    with _speculating(path) as llm:
        runner = llm.runtime.runner
        # decode rows up to max_num_seqs (4): a lone request's verify of 1 + 3 tokens; larger verify
        # steps find no graph on the CPU (counted)
        runner.decode_graphs = _EagerDecodeGraphs(runner, (1, 2, 4))
        runner.verify_graphs = _EagerDecodeGraphs(runner, (2, 4), store_first=True)
        runner.dispatcher = Dispatcher((1, 2, 4), decode_graphs_wanted=True, verify_graphs_wanted=True,
                                       verify_sizes=(2, 4))
        replay(llm, continuations, wrong=0.25)
        dispatch, as_rows = runner.dispatcher.dispatch, []

        def spy(batch):
            result = dispatch(batch)
            if batch.verify and result.descriptor.uniform_decode:
                as_rows.append(batch.num_tokens)
            return result

        runner.dispatcher.dispatch = spy
        outs = llm.generate(PROMPTS, params)
        stats = llm.stats()
        replays = dict(runner.verify_graphs.replays_by_size)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert stats["spec_decode"]["accepted_tokens"] > 0
    assert replays.get(4, 0) > 0, replays
    assert as_rows and max(as_rows) == 4  # a lone request's verify of 1 + 3 tokens as 4 decode rows
