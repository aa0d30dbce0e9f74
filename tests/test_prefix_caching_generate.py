"""Prefix caching end to end on the CPU: greedy (and seeded) outputs are the same with caching on and
off for Llama, Qwen3 and Gemma 3 (sliding-window layers), over workloads that share prefixes, with the
pool's debug checks on; hit counts are what the workload predicts; a small pool forces eviction and
preemption."""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.test_engine_generate import ARCHS, _build_hf

BLOCK = 4
SYSTEM = [1] + [3 + (5 * i) % 90 for i in range(13)]  # 14 tokens: 3 full blocks, then 2 tokens mid-block
QUESTIONS = [[40 + 3 * i, 41, 42 + i] for i in range(4)]
REPEATED = SYSTEM[:6] + [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]  # 20 tokens
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
# 64 usable blocks: the workload below never evicts, so its hit counts are exact
ENGINE = dict(device="cpu", block_size=BLOCK, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16,
              num_gpu_blocks=65)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def _debug_checks(monkeypatch):
    monkeypatch.setenv("INFER_GRAPHS_DEBUG_CHECKS", "1")  # the pool checks its states every step


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    dirs = {}
    for arch in ARCHS:
        dirs[arch] = tmp_path_factory.mktemp(f"prefix_{arch}")
        _build_hf(arch).save_pretrained(dirs[arch])
    return dirs


def _hits(llm: LLM) -> int:
    return llm.stats()["prefix_cache"]["hit_tokens"]


def run_workload(llm: LLM) -> tuple[list[list[int]], list[int]]:
    """(every output, in order; hit tokens gained by each phase)."""
    outputs, hits = [], []

    def generate(prompts, params=GREEDY):
        got = [o.token_ids for o in llm.generate(prompts, params)]
        outputs.extend(got)
        return got

    def phase(fn):
        before = _hits(llm)
        fn()
        hits.append(_hits(llm) - before)

    # 1. one system prompt, then different questions behind it (all at once)
    phase(lambda: generate([SYSTEM + QUESTIONS[0]]))
    phase(lambda: generate([SYSTEM + q for q in QUESTIONS[1:]]))

    # 2. multi-turn: each prompt is the last prompt, its answer and a new question
    def chat():
        prompt = SYSTEM + QUESTIONS[2]
        for turn in range(3):
            [answer] = generate([prompt])
            prompt = prompt + answer + [70 + turn, 71]
    phase(chat)
    # 3. identical prompts at once, then one after another
    phase(lambda: generate([REPEATED] * 3))
    phase(lambda: [generate([REPEATED]) for _ in range(2)])
    # 4. seeded sampling behind a shared prefix: same seed, same tokens, whether the prefix was cached
    sampled = [SamplingParams(max_tokens=6, temperature=0.9, top_p=0.95, seed=s, ignore_eos=True) for s in (1, 2)]
    phase(lambda: generate([SYSTEM + QUESTIONS[3], SYSTEM + QUESTIONS[1]], sampled))
    return outputs, hits


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_outputs_are_the_same_with_prefix_caching_on_and_off(model_dirs, arch):
    off_llm = LLM(str(model_dirs[arch]), **ENGINE, enable_prefix_caching=False)
    off, off_hits = run_workload(off_llm)
    on_llm = LLM(str(model_dirs[arch]), **ENGINE)  # on by default
    on, hits = run_workload(on_llm)
    assert on == off
    assert off_hits == [0] * 6 and off_llm.stats()["prefix_cache"]["enabled"] is False
    # What the workload predicts, in blocks of 4 (a request never hits its own last token):
    # 1. the first request runs alone; three questions behind its 14 shared tokens hit 3 blocks each;
    # 2. turn 1 (17 tokens) was asked in 1: 4 blocks; turn 2 (25 tokens) hits the 20 tokens turn 1
    #    computed (its prompt and 5 of 6 answer tokens: the last is never computed), turn 3 (33) 28;
    # 3. of three identical 20-token prompts the first shares one block with SYSTEM; the token budget
    #    (16) admits the others a step later, once the first published its 4 full blocks;
    # 4. then again, twice: 4 blocks each; 5. both prompts were asked in 1: 4 blocks each.
    assert hits == [0, 3 * 12, 16 + 20 + 28, 4 + 2 * 16, 2 * 16, 2 * 16]
    stats = on_llm.stats()["prefix_cache"]
    assert stats["hit_tokens"] == sum(hits) and 0 < stats["hit_rate"] < 1 and stats["cached_blocks"] > 0


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_a_pool_small_enough_to_evict_and_preempt_gives_the_same_outputs(model_dirs, arch):
    # 17 usable blocks of 4 tokens: one max_model_len request needs 16, so four growing ones preempt.
    small = dict(ENGINE, num_gpu_blocks=18)
    off, _ = run_workload(LLM(str(model_dirs[arch]), **small, enable_prefix_caching=False))
    llm = LLM(str(model_dirs[arch]), **small)
    on, _ = run_workload(llm)
    # four long prompts at once on top: they cannot all fit, the newest are preempted and readmitted
    long_prompts = [SYSTEM + QUESTIONS[i] + [60 + i] * 20 for i in range(4)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    off_long = [o.token_ids for o in LLM(str(model_dirs[arch]), **small, enable_prefix_caching=False)
                .generate(long_prompts, params)]
    on_long = [o.token_ids for o in llm.generate(long_prompts, params)]
    assert on == off and on_long == off_long
    stats = llm.stats()
    assert stats["preemptions"] > 0 and stats["prefix_cache"]["evicted_blocks"] > 0
    assert stats["prefix_cache"]["hit_tokens"] > 0
