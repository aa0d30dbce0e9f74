"""What a request can ask of the sampler beyond temperature / top-k / top-p, against references
nobody here wrote: repetition_penalty against transformers' generate() and its
RepetitionPenaltyLogitsProcessor, presence / frequency penalties and logit_bias against a plain-torch
greedy loop over transformers' logits, min_p against MinPLogitsWarper, min_tokens against
generate(min_new_tokens=); through both step loops, under preemption, beside requests that ask for
nothing; and every bad value refused by name."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, InvalidRequestError, SamplingParams
from tests.test_engine_generate import PROMPTS, SMALL, _build_hf

pytestmark = pytest.mark.usefixtures("one_thread")
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    out = {}
    for arch in ("llama", "gemma3"):
        hf = _build_hf(arch).eval()
        path = tmp_path_factory.mktemp(f"penalties_{arch}")
        hf.save_pretrained(path)
        out[arch] = (path, hf)
    return out


def _openai_penalties_greedy(hf, prompt: list[int], presence: float, frequency: float) -> list[int]:
    """Greedy decoding with OpenAI's definition: logit[t] -= frequency * count[t] + presence * (count[t] > 0),
    counts over the generated tokens only."""
    ids, counts = list(prompt), torch.zeros(hf.config.vocab_size, dtype=torch.float64)
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            logits = hf(torch.tensor([ids])).logits[0, -1].double()
            token = int((logits - frequency * counts - presence * (counts > 0).double()).argmax())
            counts[token] += 1
            ids.append(token)
    return ids[len(prompt):]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_repetition_penalty_gives_transformers_generate_tokens(saved, arch):
    path, hf = saved[arch]
    with torch.no_grad():
        expected = [hf.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False, repetition_penalty=1.8,
                                attention_mask=torch.ones(1, len(p), dtype=torch.long))[0, len(p):].tolist()
                    for p in PROMPTS[:3]]
    with LLM(str(path), **SMALL) as llm:
        plain = llm.generate(PROMPTS[:3], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
        outputs = llm.generate(PROMPTS[:3], SamplingParams(max_tokens=MAX_TOKENS, repetition_penalty=1.8))
    for out, want in zip(outputs, expected):  # transformers stops at EOS, so does the engine here
        assert out.token_ids == want
    assert [o.token_ids for o in plain] != [o.token_ids for o in outputs]  # the penalty changed something


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["overlap", "sync"])
def test_presence_and_frequency_penalties_follow_openai_definition_beside_plain_requests(saved, async_scheduling):
    path, hf = saved["llama"]
    penalized = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, presence_penalty=0.7, frequency_penalty=1.3,
                               logprobs=0)
    plain = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(str(path), **SMALL, async_scheduling=async_scheduling) as llm:
        alone = llm.generate(PROMPTS[1], plain)[0].token_ids
        outputs = llm.generate(PROMPTS[:3], [penalized, plain, penalized])
    assert outputs[1].token_ids == alone  # a neighbour's penalties never leak into another row
    for prompt, out in ((PROMPTS[0], outputs[0]), (PROMPTS[2], outputs[2])):
        assert out.token_ids == _openai_penalties_greedy(hf, prompt, 0.7, 1.3)
        # logprobs stay those of the model's own distribution, before the penalties
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out.token_ids])).logits[0].double()
        raw = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
        assert [x.logprob for x in out.logprobs] == pytest.approx(
            [raw[i, t].item() for i, t in enumerate(out.token_ids)], abs=1e-4)


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["overlap", "sync"])
def test_penalties_survive_preemption_and_seeded_sampling_matches_across_loops(saved, async_scheduling):
    path, _ = saved["llama"]
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.9, seed=11, presence_penalty=1.0,
                            frequency_penalty=0.5, repetition_penalty=1.3)
    with LLM(str(path), **SMALL, async_scheduling=False) as llm:
        roomy = [o.token_ids for o in llm.generate(PROMPTS, params)]
    with LLM(str(path), **{**SMALL, "max_num_batched_tokens": 32, "num_gpu_blocks": 18},
             async_scheduling=async_scheduling) as llm:
        tight = llm.generate(PROMPTS, params)
        assert llm.stats()["preemptions"] > 0
    assert [o.token_ids for o in tight] == roomy



def test_penalized_logits_equal_transformers_repetition_processor_and_openai_formula():
    """Row by row on fresh random logits (negative ones included, where repetition multiplies)."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    from engine.request import Request
    from engine.sample.sampler import Sampler

    vocab, gen = 50, torch.Generator().manual_seed(0)
    prompts = [[3, 4, 4, 9], [7, 8], [1, 2, 3]]
    params = [SamplingParams(repetition_penalty=1.7), SamplingParams(presence_penalty=0.4, frequency_penalty=-0.9),
              SamplingParams(repetition_penalty=0.6, frequency_penalty=1.1, presence_penalty=-1.5)]
    requests = [Request(str(i), p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
    outputs: list[list[int]] = [[], [], []]
    sampler = Sampler(torch.device("cpu"), seed=0)
    for _ in range(4):
        logits = torch.randn(3, vocab, generator=gen) * 3
        got = sampler._penalized(logits.clone(), requests, [0, 1, 2])
        for i, (request, out) in enumerate(zip(requests, outputs)):
            sp, want = request.params, logits[i:i + 1].double().clone()
            if sp.repetition_penalty != 1:
                want = RepetitionPenaltyLogitsProcessor(sp.repetition_penalty)(
                    torch.tensor([prompts[i] + out]), want)
            counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=vocab).double()
            want = want - sp.frequency_penalty * counts - sp.presence_penalty * (counts > 0).double()
            torch.testing.assert_close(got[i:i + 1].double(), want, rtol=1e-6, atol=1e-5)
        tokens = torch.randint(0, 6, (3,), generator=gen)  # small ids: tokens repeat and overlap prompts
        for i, request in enumerate(requests):
            request.output_counts.index_add_(0, tokens[i:i + 1], torch.ones(1, dtype=torch.int32))
            outputs[i].append(int(tokens[i]))


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["overlap", "sync"])
def test_min_tokens_holds_eos_and_stop_tokens_back_as_transformers_min_new_tokens(saved, async_scheduling):
    path, hf = saved["llama"]
    prompt = PROMPTS[3]
    with LLM(str(path), **SMALL, async_scheduling=async_scheduling) as llm:
        free = llm.generate(prompt, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))[0].token_ids
        stop = free[1]  # greedy would end the request at its second token
        early = llm.generate(prompt, SamplingParams(max_tokens=MAX_TOKENS, stop_token_ids=(stop,)))[0]
        held = llm.generate(prompt, SamplingParams(max_tokens=MAX_TOKENS, stop_token_ids=(stop,), min_tokens=6))[0]
    assert len(early.token_ids) <= 2
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False, min_new_tokens=6,
                           eos_token_id=[hf.config.eos_token_id, stop], pad_token_id=0,
                           attention_mask=torch.ones(1, len(prompt), dtype=torch.long))[0, len(prompt):].tolist()
    assert held.token_ids == want and len(held.token_ids) >= 6
    assert stop not in held.token_ids[:5] and 2 not in held.token_ids[:5]


def test_min_p_keeps_what_transformers_min_p_warper_keeps():
    from transformers.generation.logits_process import MinPLogitsWarper

    from engine.request import Request
    from engine.sample.sampler import Sampler

    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 64, generator=gen) * 2.5
    min_ps = [0.0, 0.05, 0.2, 0.9]
    requests = [Request(str(i), [1], SamplingParams(temperature=1.0, min_p=m)) for i, m in enumerate(min_ps)]
    got = Sampler._filtered_probs(logits, requests)
    for i, m in enumerate(min_ps):
        scores = logits[i:i + 1].double()
        want = torch.softmax(MinPLogitsWarper(m)(None, scores) if m else scores, dim=-1)
        torch.testing.assert_close(got[i:i + 1].double(), want, rtol=1e-5, atol=1e-7)
    assert (got[3] > 0).sum() < (got[1] > 0).sum() < 64  # the filter removed something



@pytest.mark.parametrize("async_scheduling", [True, False], ids=["overlap", "sync"])
def test_logit_bias_adds_to_the_logits_as_openai_defines_it(saved, async_scheduling):
    """+100 forces a token, -100 bans one; a small bias moves the greedy choice exactly as adding it to
    transformers' logits does."""
    path, hf = saved["llama"]
    prompt = PROMPTS[2]
    with LLM(str(path), **SMALL, async_scheduling=async_scheduling) as llm:
        free = llm.generate(prompt, SamplingParams(max_tokens=6, ignore_eos=True))[0].token_ids
        forced = llm.generate(prompt, SamplingParams(max_tokens=6, ignore_eos=True, logit_bias={77: 100.0}))[0]
        banned = llm.generate(prompt, SamplingParams(max_tokens=6, ignore_eos=True, logit_bias={free[0]: -100}))[0]
        bias = {free[1]: -2.5, 40: 3.0, 41: 1.5}
        moved = llm.generate(prompt, SamplingParams(max_tokens=6, ignore_eos=True, logit_bias=bias))[0]
    assert forced.token_ids == [77] * 6
    assert free[0] not in banned.token_ids
    ids, want = list(prompt), []
    with torch.no_grad():
        for _ in range(6):
            logits = hf(torch.tensor([ids])).logits[0, -1].double()
            for token, b in bias.items():
                logits[token] += b
            want.append(int(logits.argmax()))
            ids.append(want[-1])
    assert moved.token_ids == want and want != free


BAD = [("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0), ("repetition_penalty", "1.2"),
       ("min_p", 1.5), ("min_tokens", -1), ("min_tokens", 99), ("logprobs", -1), ("logprobs", 21), ("logprobs", 2.5),
       ("logprobs", True), ("logit_bias", {5: 101}), ("logit_bias", {-1: 1.0}), ("logit_bias", {96: 1.0}),
       ("logit_bias", {"5": 1.0})]


@pytest.mark.parametrize("field,value", BAD, ids=[f"{f}={v!r}" for f, v in BAD])
def test_a_bad_sampling_value_is_refused_by_name(saved, field, value):
    path, _ = saved["llama"]
    with LLM(str(path), **SMALL) as llm:
        with pytest.raises(InvalidRequestError, match=field) as info:
            llm.generate(PROMPTS[0], SamplingParams(max_tokens=16, **{field: value}))
        assert info.value.param == field


def _tied_and_random_rows(n: int, vocab: int, dtype: torch.dtype, device: str, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tied = torch.randint(-3, 4, (n, vocab), generator=g).to(dtype)  # every row has many equal maxima
    spread = torch.randn(n, vocab, generator=g).to(dtype)
    with_nan = spread.clone()
    with_nan[0, vocab // 3] = with_nan[0, vocab // 2] = float("nan")  # argmax picks the first NaN
    return [t.to(device) for t in (tied, spread, with_nan)]


@pytest.mark.parametrize("vocab, chunks", [(128256, 256), (151936, 128), (262144, 256), (4096, 16)])
def test_chunked_argmax_is_argmax_with_its_tie_and_nan_rules(vocab, chunks):
    """The greedy token of the chunked reduction is torch's argmax, row by row: the lowest index among
    equal maxima, and a NaN if there is one (CPU here; the GPU test below runs the CUDA kernels)."""
    from engine.sample.argmax import chunked_argmax
    for n in (1, 5):
        for dtype in (torch.float32, torch.bfloat16):
            for x in _tied_and_random_rows(n, vocab, dtype, "cpu", seed=vocab + n):
                assert torch.equal(chunked_argmax(x, chunks), x.argmax(dim=-1))
                assert torch.equal(chunked_argmax(x), x.argmax(dim=-1))  # the default chunk count
    x = torch.randn(2, 1000)
    assert torch.equal(chunked_argmax(x, 16), x.argmax(dim=-1))  # 1000 % 16 != 0: plain argmax


def test_row_argmax_keeps_torchs_argmax_off_cuda():
    """Nothing to time on the CPU: the choice stays torch's argmax, and the rows' tokens are its."""
    from engine.sample.argmax import RowArgmax
    argmax = RowArgmax()
    x = _tied_and_random_rows(3, 4096, torch.float32, "cpu", seed=1)[1]
    assert argmax.choose(x) is False
    assert torch.equal(argmax(x), x.argmax(dim=-1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("vocab", [128256, 151936, 262144])
def test_gpu_chunked_argmax_is_argmax_on_cuda(vocab):
    """Either method the timing picks gives torch's argmax on the device, at every batch size."""
    from engine.sample.argmax import RowArgmax, chunked_argmax
    argmax = RowArgmax()
    argmax.choose(torch.randn(4, vocab, device="cuda", dtype=torch.bfloat16))
    for n in (1, 8, 64):
        for dtype in (torch.float32, torch.bfloat16):
            for x in _tied_and_random_rows(n, vocab, dtype, "cuda", seed=vocab + n):
                assert torch.equal(chunked_argmax(x), x.argmax(dim=-1))
                assert torch.equal(argmax(x), x.argmax(dim=-1))
