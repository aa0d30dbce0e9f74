"""SamplingParams.logprobs: each generated token's log-probability and the step's most likely tokens,
checked against log_softmax of transformers' logits for the same sequence (float32 models), through
the synchronous and the overlapped step loops."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.test_engine_generate import PROMPTS, SMALL, _build_hf

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    out = {}
    for arch in ("llama", "gemma3"):  # gemma3: sliding windows and the final logit softcap
        hf = _build_hf(arch).eval()
        path = tmp_path_factory.mktemp(f"logprobs_{arch}")
        hf.save_pretrained(path)
        out[arch] = (path, hf)
    return out


def _reference(hf, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """[len(generated), V] float64 log-probabilities transformers gives each generated position."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + generated])).logits[0].double()
    return torch.log_softmax(logits[len(prompt) - 1:len(prompt) - 1 + len(generated)], dim=-1)


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["overlap", "sync"])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_logprobs_are_transformers_log_softmax_of_each_step(saved, arch, async_scheduling):
    path, hf = saved[arch]
    llm = LLM(str(path), **SMALL, async_scheduling=async_scheduling)
    params = [SamplingParams(max_tokens=6, logprobs=3, ignore_eos=True),              # greedy, top 3
              SamplingParams(max_tokens=6, ignore_eos=True),                          # none asked
              SamplingParams(max_tokens=6, logprobs=0, temperature=1.0, seed=3, ignore_eos=True),  # sampled
              SamplingParams(max_tokens=6, logprobs=5, temperature=0.7, top_k=4, seed=5, ignore_eos=True)]
    outputs = llm.generate(PROMPTS[:4], params)
    assert outputs[1].logprobs is None
    for prompt, sp, out in zip(PROMPTS, params, outputs):
        if sp.logprobs is None:
            continue
        assert len(out.logprobs) == len(out.token_ids) == 6
        want = _reference(hf, prompt, out.token_ids)
        for i, (token, got) in enumerate(zip(out.token_ids, out.logprobs)):
            assert got.token_id == token
            # the model's own distribution, before temperature and top-k (vLLM's default)
            assert got.logprob == pytest.approx(want[i, token].item(), abs=1e-4), (arch, i)
            values, ids = want[i].topk(sp.logprobs)
            assert [t for t, _ in got.top] == ids.tolist()
            assert [v for _, v in got.top] == pytest.approx(values.tolist(), abs=1e-4)
            if sp.temperature == 0:
                assert got.top[0] == (token, got.logprob)
    assert llm.stats()["fallbacks"] == 0
    llm.close()


def test_streamed_logprobs_arrive_with_their_tokens(saved):
    path, _ = saved["llama"]
    with LLM(str(path), **SMALL) as llm:
        rid = llm.add_request(PROMPTS[1], SamplingParams(max_tokens=7, logprobs=2))
        tokens, logprobs, final = [], [], None
        while llm.has_unfinished_requests():
            for out in llm.step():
                assert out.request_id == rid and len(out.new_logprobs) == len(out.new_token_ids)
                tokens += out.new_token_ids
                logprobs += out.new_logprobs
                final = out
        assert final.finished and tokens == final.token_ids and logprobs == final.logprobs


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["overlap", "sync"])
def test_preempted_requests_keep_one_logprob_per_token(saved, async_scheduling):
    """A preempted request recomputes its tokens without sampling them again: its logprobs stay one
    per generated token, equal to those of a run with blocks to spare."""
    path, _ = saved["llama"]
    params = SamplingParams(max_tokens=10, logprobs=2, ignore_eos=True)
    with LLM(str(path), **SMALL, async_scheduling=async_scheduling) as llm:
        roomy = llm.generate(PROMPTS, params)
    with LLM(str(path), **{**SMALL, "max_num_batched_tokens": 32, "num_gpu_blocks": 18},
             async_scheduling=async_scheduling) as llm:
        tight = llm.generate(PROMPTS, params)
        assert llm.stats()["preemptions"] > 0
    assert any(o.num_preemptions for o in tight)
    for a, b in zip(roomy, tight):
        assert a.token_ids == b.token_ids and len(b.logprobs) == len(b.token_ids)
        assert [[t for t, _ in x.top] for x in b.logprobs] == [[t for t, _ in x.top] for x in a.logprobs]
        assert [v for x in b.logprobs for _, v in x.top] == pytest.approx([v for x in a.logprobs for _, v in x.top],
                                                                          abs=1e-5)



@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_gpu_logprobs_under_decode_and_prefill_graphs_match_transformers(saved, arch):
    """The logits a decode graph or a piecewise graph leaves in its static buffer are read for the
    log-probabilities before the next replay overwrites them (the overlap loop launches that next
    step before reading this one)."""
    from tests.test_engine_gpu import _engine
    path, hf = saved[arch]
    llm = _engine(path, cuda_graphs=True, prefill_graphs=True)
    params = [SamplingParams(max_tokens=12, logprobs=4, ignore_eos=True),
              SamplingParams(max_tokens=12, ignore_eos=True),
              SamplingParams(max_tokens=12, logprobs=1, temperature=0.9, seed=2, ignore_eos=True)]
    outputs = llm.generate(PROMPTS[:3], params)
    stats = llm.stats()
    llm.close()
    assert stats["modes"].get("full", 0) > 0 and stats["modes"].get("piecewise", 0) > 0 and stats["fallbacks"] == 0
    assert outputs[1].logprobs is None
    for prompt, sp, out in zip(PROMPTS, params, outputs):
        if sp.logprobs is None:
            continue
        want = _reference(hf, prompt, out.token_ids)
        for i, (token, got) in enumerate(zip(out.token_ids, out.logprobs)):
            assert got.logprob == pytest.approx(want[i, token].item(), abs=2e-3), (arch, i)
            assert [t for t, _ in got.top] == want[i].topk(sp.logprobs).indices.tolist()
