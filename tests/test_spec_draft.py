"""Draft-model speculative decoding through the engine on the CPU (engine/spec/draft.py): greedy outputs
identical to decoding without it (every architecture, both step-loop depths, a draft of another
architecture, prefix caching, preemption, limits), sampled outputs distributed as without it, the
draft's own cache handed back, and the configuration errors.

The drafts are the target with noise added to its weights (they agree with it often, not always: every
accepted length and every rejection position happen) or the target itself (they always agree).
"""
from __future__ import annotations

import collections

import pytest
import torch

from engine import LLM, ConfigError, SamplingParams
from tests.test_engine_generate import ARCHS, COMMON, _build_hf
from tests.test_spec_decode import CONFIG, PROMPTS

pytestmark = pytest.mark.usefixtures("one_thread")

NOISE = 0.2  # the draft's weights: the target's times (1 + NOISE * N(0, 1))


def _noisy(arch: str, noise: float, seed: int = 11):
    hf = _build_hf(arch)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in hf.parameters():
            param.mul_(1 + noise * torch.randn(param.shape, generator=generator))
    return hf


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """arch -> {"target": dir, "draft": dir of the noisy copy}."""
    out = {}
    for arch in ARCHS:
        out[arch] = {}
        for name, hf in (("target", _build_hf(arch)), ("draft", _noisy(arch, NOISE))):
            path = tmp_path_factory.mktemp(f"draft_{arch}_{name}")
            hf.save_pretrained(path)
            out[arch][name] = str(path)
    return out


def _spec(draft: str, k: int = 3) -> dict:
    return {"model": draft, "num_speculative_tokens": k}


def _reference(path: str, prompts, params, **config) -> list[list[int]]:
    with LLM(path, **{**CONFIG, **config}) as llm:
        return [o.token_ids for o in llm.generate(prompts, params)]


def _check_draft_released(llm: LLM, free: int) -> None:
    draft = llm.scheduler.proposer
    assert draft.runtime.block_pool.num_free_blocks == free  # every request's draft blocks handed back
    assert not draft._states


# -- greedy: identical token for token -------------------------------------------------------------------

@pytest.mark.parametrize("arch,async_scheduling", [("llama", True), ("llama", False), ("qwen3", True),
                                                   ("gemma3", True), ("gemma3", False)])
def test_greedy_identical_with_a_draft_that_mostly_agrees(dirs, arch, async_scheduling):
    target, draft = dirs[arch]["target"], dirs[arch]["draft"]
    params = SamplingParams(max_tokens=40)
    ref = _reference(target, PROMPTS, params, async_scheduling=async_scheduling)
    with LLM(target, **CONFIG, async_scheduling=async_scheduling, speculative_config=_spec(draft)) as llm:
        free = llm.scheduler.proposer.runtime.block_pool.num_free_blocks
        target_free = llm.runtime.block_pool.num_free_blocks
        # every prompt twice: the second copies hit the target's prefix cache (the draft has none)
        outs = llm.generate(PROMPTS + PROMPTS, params)
        assert [o.token_ids for o in outs] == ref * 2
        stats = llm.stats()["spec_decode"]
        assert stats["method"] == "draft_model" and stats["model"] == draft
        assert stats["verify_chunks"] > 20 and 0 < stats["accepted_tokens"] < stats["proposed_tokens"]
        assert stats["draft_forwards"] > 0 and stats["draft_kv_full"] == 0
        assert llm.stats()["generated_tokens"] == 2 * sum(len(r) for r in ref)
        _check_draft_released(llm, free)
        assert llm.runtime.block_pool.num_free_blocks == target_free


def test_a_draft_equal_to_the_target_is_always_accepted(dirs):
    target = dirs["llama"]["target"]
    params = SamplingParams(max_tokens=30)
    ref = _reference(target, PROMPTS, params)
    with LLM(target, **CONFIG, speculative_config=_spec(target, k=4)) as llm:
        assert [o.token_ids for o in llm.generate(PROMPTS, params)] == ref
        stats = llm.stats()["spec_decode"]
    assert stats["acceptance_rate"] >= 0.95 and stats["mean_accepted_length"] > 4.5, stats


def test_a_draft_of_another_architecture(dirs):
    """A draft needs the target's vocabulary, nothing else: a Llama drafts for Gemma 3 (sliding windows)."""
    target = dirs["gemma3"]["target"]
    params = SamplingParams(max_tokens=24)
    ref = _reference(target, PROMPTS, params)
    with LLM(target, **CONFIG, speculative_config=_spec(dirs["llama"]["draft"], k=2)) as llm:
        assert [o.token_ids for o in llm.generate(PROMPTS, params)] == ref
        assert llm.stats()["spec_decode"]["verify_chunks"] > 0


def test_preemption_limits_and_a_built_draft(dirs):
    """A KV pool too small for every request preempts (the draft keeps its own cache for the request's
    return); max_tokens and max_model_len bound the proposals; a built model stands in for a path."""
    import models
    target, draft_path = dirs["llama"]["target"], dirs["llama"]["draft"]
    prompts = PROMPTS + [[1] + list(range(30, 60))]
    params = [SamplingParams(max_tokens=m) for m in (40, 3, 1, 25, 80)]
    config = dict(num_gpu_blocks=20, max_model_len=64)
    ref = _reference(target, prompts, params, **config)
    draft = models.from_pretrained(draft_path, dtype="float32", device="cpu")
    with LLM(target, **CONFIG | config, speculative_config=_spec(draft, k=4)) as llm:
        free = llm.scheduler.proposer.runtime.block_pool.num_free_blocks
        outs = llm.generate(prompts, params)
        assert [o.token_ids for o in outs] == ref
        assert [len(o.token_ids) for o in outs][:3] == [40, 3, 1] and len(outs[4].token_ids) == 64 - len(prompts[4])
        stats = llm.stats()
        assert stats["preemptions"] > 0 and stats["spec_decode"]["accepted_tokens"] > 0
        assert stats["spec_decode"]["model"] == "<LlamaForCausalLM instance>"
        _check_draft_released(llm, free)


def test_a_full_draft_pool_skips_proposals_and_changes_nothing(dirs, monkeypatch):
    """A draft KV pool smaller than the batch needs: requests sit out rounds (draft_kv_full), the
    preempted ones hand their draft blocks back; tokens as without speculation."""
    import engine.spec.draft as draft_module
    monkeypatch.setattr(draft_module, "_draft_blocks", lambda draft, config: 18)  # ~2 requests of 32 tokens
    target, draft = dirs["llama"]["target"], dirs["llama"]["draft"]
    prompts = PROMPTS + [[1] + list(range(30, 50))]
    params = SamplingParams(max_tokens=30)
    config = dict(num_gpu_blocks=20, max_model_len=64)
    ref = _reference(target, prompts, params, **config)
    with LLM(target, **CONFIG | config, speculative_config=_spec(draft)) as llm:
        free = llm.scheduler.proposer.runtime.block_pool.num_free_blocks
        assert [o.token_ids for o in llm.generate(prompts, params)] == ref
        stats = llm.stats()
        spec = stats["spec_decode"]
        assert stats["preemptions"] > 0 and spec["draft_kv_full"] > 0, spec
        assert spec["accepted_tokens"] > 0
        _check_draft_released(llm, free)


def test_logprobs_with_a_draft(dirs):
    """Logprobs of every emitted token, each prompt twice at once (two requests drafted for apart over
    one shared target prefix): the same as without speculation (greedy; the target drafts for itself,
    so most tokens come from verify steps)."""
    target = draft = dirs["qwen3"]["target"]
    params = SamplingParams(max_tokens=16, logprobs=2)
    prompts = [p for p in PROMPTS[:2] for _ in range(2)]
    with LLM(target, **CONFIG) as llm:
        ref = llm.generate(prompts, params)
    with LLM(target, **CONFIG, speculative_config=_spec(draft)) as llm:
        outs = llm.generate(prompts, params)
        assert llm.stats()["spec_decode"]["acceptance_rate"] > 0.9
    for got, want in zip(outs, ref):
        assert got.token_ids == want.token_ids
        assert [p.token_id for p in got.logprobs] == [p.token_id for p in want.logprobs]
        assert [p.logprob for p in got.logprobs] == pytest.approx([p.logprob for p in want.logprobs], abs=1e-4)
        assert [[t for t, _ in p.top] for p in got.logprobs] == [[t for t, _ in p.top] for p in want.logprobs]


# -- sampled: the target's distribution, reproducible with a seed ---------------------------------------------

def _sampled_tokens(target: str, draft: str | None, n: int = 320) -> list[tuple[int, ...]]:
    params = [SamplingParams(max_tokens=3, temperature=1.3, top_k=3, seed=1000 + i) for i in range(n)]
    config = dict(max_num_seqs=8, max_num_batched_tokens=64)
    spec = dict(speculative_config=_spec(draft, k=2)) if draft else {}
    with LLM(target, **CONFIG | config, **spec) as llm:
        outs = llm.generate([PROMPTS[3]] * n, params)
        if draft:
            stats = llm.stats()["spec_decode"]
            assert 0 < stats["accepted_tokens"] < stats["proposed_tokens"]
    return [tuple(o.token_ids) for o in outs]


def test_sampled_tokens_follow_the_target_distribution(dirs):
    """Proposals drawn from the draft's own distribution, accepted with min(1, p/q) and resampled from
    (p - q)+ otherwise: every position's token frequencies match sampling without speculation."""
    target, draft = dirs["llama"]["target"], dirs["llama"]["draft"]
    plain = _sampled_tokens(target, None)
    spec = _sampled_tokens(target, draft)
    assert spec == _sampled_tokens(target, draft)  # seeded: the same tokens again
    for position in range(3):
        a = collections.Counter(t[position] for t in plain)
        b = collections.Counter(t[position] for t in spec)
        tv = sum(abs(a[t] - b[t]) for t in set(a) | set(b)) / (2 * len(plain))
        assert tv < 0.12, (position, a, b)


def test_sampled_proposals_of_the_target_itself_are_accepted(dirs):
    """Verification uses the draft's distribution q (accept with min(1, p/q)): a draft equal to the
    target is accepted almost always. Treating its draws as fixed tokens (accept with p) would also keep
    the target's distribution, but accept only sum(p^2) of them."""
    target = dirs["llama"]["target"]
    params = [SamplingParams(max_tokens=12, temperature=1.3, top_k=3, seed=i) for i in range(16)]
    with LLM(target, **CONFIG, speculative_config=_spec(target, k=3)) as llm:
        llm.generate([PROMPTS[i % 4] for i in range(16)], params)
        stats = llm.stats()["spec_decode"]
    assert stats["acceptance_rate"] > 0.95, stats


# -- configuration ----------------------------------------------------------------------------------------

def test_a_draft_that_cannot_serve_the_target_is_refused(dirs, tmp_path):
    import transformers
    target = dirs["llama"]["target"]
    config_cls, kwargs = ARCHS["llama"]
    for name, change, words in [("vocab", dict(vocab_size=64), "vocabulary (64 tokens)"),
                                ("positions", dict(max_position_embeddings=32), "max_position_embeddings (32)")]:
        path = tmp_path / name
        transformers.LlamaForCausalLM(config_cls(**{**COMMON, **kwargs, **change})).save_pretrained(path)
        with pytest.raises(ConfigError, match=r"speculative_config\['model'\]") as info:
            LLM(target, **CONFIG, speculative_config=_spec(str(path)))
        assert words in str(info.value)
    with pytest.raises(ConfigError, match="does not load"):
        LLM(target, **CONFIG, speculative_config=_spec(str(tmp_path / "missing")))
    import models
    built = models.from_pretrained(target, dtype="bfloat16", device="cpu")
    with pytest.raises(ConfigError, match="bfloat16"):
        LLM(target, **CONFIG, speculative_config=_spec(built))
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        LLM(target, **CONFIG, tensor_parallel_size=2, speculative_config=_spec(built))
