"""The LM head's argmax keys: the skinny GEMM stores each N tile's best (value, index) key per row as it
writes the logits (custom_ops.triton_skinny, KEYS), `argmax_of_keys` turns them into torch's
`argmax(dim=-1)` of those logits, and the sampler takes its greedy tokens from them when a decode graph
stored them (engine.worker.decode_graphs -> StepResult.argmax_keys -> Sampler.sample).

CPU: the kernels in Triton's interpreter (both MMA layouts, ragged N, ties across tiles, NaNs), the
named refusals, the sampler's choice. GPU (`gpu` mark): a model with gemma-3-1b's vocabulary and hidden
size in an engine with decode graphs: every captured size of 2 rows or more stores keys, and every step
the sampler reads keys for agrees with the logits' argmax.
"""
from __future__ import annotations

import pytest
import torch

import models
from custom_ops import GemvConfig, run_linear
from custom_ops.triton_argmax import argmax_of_keys
from custom_ops.triton_skinny import key_tiles, skinny_gemm
from engine import LLM, SamplingParams
from engine.request import Request
from engine.sample.sampler import Sampler

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def _logits_with_keys(m: int, n: int, config: GemvConfig, dtype: torch.dtype, plant=None):
    x = torch.randn(m, 32, device=DEVICE).to(dtype)
    weight = torch.randn(n, 32, device=DEVICE).to(dtype)
    if plant is not None:
        plant(weight)
    keys = torch.empty(m, key_tiles(n, config), dtype=torch.int64, device=DEVICE)
    return skinny_gemm(x, weight, config, keys=keys), keys


@pytest.mark.parametrize("block_n", [16, 64])  # x on the MMA's left side, and the weight
@pytest.mark.parametrize("m", [2, 5, 17])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_keys_give_torchs_argmax_of_the_logits_as_stored(block_n, m, dtype):
    def equal_rows_across_tiles(weight):  # every row's maximum may tie between tiles: the lower index wins
        weight[150] = weight[3]
        weight[70] = weight[3]
    logits, keys = _logits_with_keys(m, 151, GemvConfig(block_n=block_n, block_k=16, num_warps=1), dtype,
                                     equal_rows_across_tiles)
    assert torch.equal(argmax_of_keys(keys), logits.argmax(dim=-1))


def test_keys_scatter_the_tokens_into_their_slots_from_the_same_launch():
    logits, keys = _logits_with_keys(4, 100, GemvConfig(block_n=16, block_k=16, num_warps=1), torch.float32)
    slots = torch.full((10,), -1, dtype=torch.int64, device=DEVICE)
    index = torch.tensor([7, 2, 9, 0], device=DEVICE)
    tokens = argmax_of_keys(keys, (slots, index))
    assert torch.equal(tokens, logits.argmax(dim=-1)) and torch.equal(slots[index], tokens)
    assert int((slots == -1).sum()) == 6  # nothing else written
    with pytest.raises(ValueError, match="scatter"):
        argmax_of_keys(keys, (slots, index[:3]))


def test_keys_rank_a_nan_above_everything_as_torch_does():
    def nan_row(weight):
        weight[90] = float("nan")  # every row's logit 90 is NaN
    logits, keys = _logits_with_keys(3, 130, GemvConfig(block_n=16, block_k=16, num_warps=1), torch.float32,
                                     nan_row)
    assert torch.equal(argmax_of_keys(keys), logits.argmax(dim=-1)) and bool((argmax_of_keys(keys) == 90).all())


def test_only_a_one_split_skinny_choice_stores_keys_and_others_are_refused_by_name():
    x, weight = torch.randn(4, 32), torch.randn(40, 32)
    assert key_tiles(40, GemvConfig(block_n=16, block_k=16, split_k=2)) is None
    with pytest.raises(ValueError, match=r"skinny_gemm keys \(4, 2\)"):
        skinny_gemm(x, weight, GemvConfig(block_n=16, block_k=16, num_warps=1),
                    keys=torch.empty(4, 2, dtype=torch.int64))  # 40 columns are 3 tiles of 16
    with pytest.raises(ValueError, match="keys .* need `out` and the skinny GEMM's one-split choice"):
        run_linear(x, weight, out=torch.empty(4, 40), keys=torch.empty(4, 3, dtype=torch.int64))  # CPU: no table
    with pytest.raises(ValueError, match="argmax_of_keys needs contiguous int64"):
        argmax_of_keys(torch.zeros(4, 3, dtype=torch.int32))


def test_a_model_without_stored_keys_refuses_them_in_compute_logits():
    from bench.configs import TINY_LLAMA
    net = models.from_config(TINY_LLAMA, dtype="float32", device="cpu", seed=0)
    assert net.argmax_key_tiles(4) is None  # decode_gemv off, and no table on the CPU
    hidden = torch.randn(4, TINY_LLAMA["hidden_size"])
    with pytest.raises(ValueError, match="stores no argmax keys for 4 rows"):
        net.compute_logits(hidden, out=torch.empty(4, TINY_LLAMA["vocab_size"]),
                           keys=torch.empty(4, 2, dtype=torch.int64))


def test_keys_are_stored_only_where_the_raw_argmax_is_the_token(monkeypatch):
    """With the logits matmul switched on and a kernel that stores keys, one rank without a final softcap
    stores them; under tensor parallelism or a softcap (tanh's rounding can tie distinct raw logits) the
    sampler must read the logits."""
    import dataclasses
    import models.base
    from bench.configs import TINY_LLAMA
    from models.parallel import TensorParallel
    monkeypatch.setattr(models.base, "argmax_key_tiles", lambda rows, weight, dtype, device_type: 7)
    net = models.from_config(TINY_LLAMA, dtype="float32", device="cpu", seed=0)
    assert net.argmax_key_tiles(4) is None  # the logits matmul is plain F.linear until switched on
    models.set_decode_gemv(net, True)
    assert net.argmax_key_tiles(4) == 7
    net.config = dataclasses.replace(net.config, final_logit_softcap=30.0)
    assert net.argmax_key_tiles(4) is None
    net.config = dataclasses.replace(net.config, final_logit_softcap=None)
    net.tp = TensorParallel(0, 2, group=object())
    assert net.argmax_key_tiles(4) is None


def _request(i: int, **params) -> Request:
    return Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=4, **params))


def test_the_sampler_takes_greedy_tokens_from_the_keys_and_never_for_adjusted_logits():
    """Keys planted to name token 7 while the logits' argmax is elsewhere show which source was read."""
    logits = torch.randn(3, 64)
    logits[:, 7] = -10.0
    sampler = Sampler(torch.device("cpu"), seed=0, eos_token_ids=())
    keys = argmax_keys_naming(7, rows=3, tiles=4)
    greedy = [_request(i, temperature=0.0) for i in range(3)]
    assert sampler.sample(logits, greedy, keys).tolist() == [7, 7, 7]
    assert sampler.sample(logits, greedy).tolist() == logits.argmax(dim=-1).tolist()
    biased = [_request(0, temperature=0.0, logit_bias={3: 100.0})] + greedy[1:]
    assert sampler.sample(logits, biased, keys).tolist()[0] == 3  # adjusted logits: the keys are not theirs
    mixed = [greedy[0], _request(1, temperature=1.0, seed=5), greedy[2]]
    tokens = sampler.sample(logits, mixed, keys).tolist()
    assert tokens[0] == tokens[2] == 7 and tokens[1] != 7  # the sampled row draws from the logits
    for requests, argmax_keys in ((greedy, keys), (mixed, keys), (greedy, None)):  # every path scatters
        slots = torch.full((6,), -1, dtype=torch.int64)
        index = torch.tensor([5, 0, 3])
        tokens = sampler.sample(logits, requests, argmax_keys, (slots, index))
        assert torch.equal(slots[index], tokens) and int((slots == -1).sum()) == 3


def argmax_keys_naming(token: int, rows: int, tiles: int) -> torch.Tensor:
    """Keys whose argmax is `token` in every row: the top key (an order-preserving image of +inf)
    in the tile of index 0, naming `token`; every other tile the lowest key."""
    keys = torch.full((rows, tiles), -(2 ** 63), dtype=torch.int64)
    keys[:, 0] = (0x7F800000 << 32) | (0x7FFFFFFF - token)
    return keys


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_decode_graphs_store_keys_and_the_sampler_reads_their_argmax(monkeypatch):
    from bench.configs import GEMMA_3_1B
    import engine.sample.sampler
    config = {**GEMMA_3_1B, "num_hidden_layers": 2}  # the real LM head (262,144 x 1,152)
    net = models.from_config(config, dtype="bfloat16", device="cuda", seed=0)
    checked = []
    real = engine.sample.sampler.argmax_of_keys

    def spy(keys, scatter=None):
        tokens = real(keys, scatter)
        checked.append(keys.shape)
        return tokens
    monkeypatch.setattr(engine.sample.sampler, "argmax_of_keys", spy)
    real_sample = Sampler.sample

    def sample(self, logits, requests, argmax_keys=None, scatter=None):
        tokens = real_sample(self, logits, requests, argmax_keys, scatter)
        if argmax_keys is not None:
            assert torch.equal(tokens, logits.argmax(dim=-1)), "keys' argmax differs from the logits'"
        if scatter is not None:  # the overlap loop's next inputs hold the same tokens
            dest, index = scatter
            assert torch.equal(dest.index_select(0, index), tokens), "scattered tokens differ"
        return tokens
    monkeypatch.setattr(Sampler, "sample", sample)
    prompts = [[2] + list(range(100 + i, 110 + i)) for i in range(8)]
    torch._dynamo.reset()
    with LLM(net, max_model_len=64, max_num_seqs=8, block_size=16, num_gpu_blocks=64,
             decode_graph_sizes=(1, 2, 4, 8), show_progress=False) as llm:
        key_tiles = dict(llm.runtime.runner.decode_graphs.key_tiles)
        llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
        llm.generate(prompts[:3], SamplingParams(max_tokens=6, ignore_eos=True))  # batch 3 pads to 4
    torch._dynamo.reset()
    assert set(key_tiles) == {2, 4, 8}  # one row: the GEMV stores none
    assert {shape[0] for shape in checked} >= {8, 3}  # batch 8, and 3 real rows of the batch-4 graph
    assert all(shape[1] == key_tiles[8] for shape in checked)


def test_a_greedy_verify_step_reads_its_tokens_from_the_keys_as_from_the_logits():
    """A verify graph's LM head stores keys for every token row: a greedy verify takes each row's argmax
    from them (not a pass over the vocabulary), and its tokens (accepted proposals, the target's next,
    then -1) equal those from the logits themselves."""
    from engine.spec.sampling import VerifyLayout, sample_verify
    torch.manual_seed(0)
    logits, keys = _logits_with_keys(10, 151, GemvConfig(block_n=16, block_k=16, num_warps=1), torch.float32)
    best = logits.argmax(dim=-1).tolist()
    greedy = SamplingParams(temperature=0.0)
    requests = [Request("a", [1], greedy), Request("b", [1], greedy)]
    # a: rows 0-4, its first two proposals right; b: rows 5-9, four proposals, all right
    proposals = [(best[0], best[1], (best[2] + 1) % 151, best[3]), tuple(best[5:9])]
    layout = VerifyLayout(requests, proposals, 5)
    sampler = Sampler(torch.device(DEVICE), seed=0)
    with_keys = sample_verify(sampler, logits, layout, keys)
    assert torch.equal(with_keys, sample_verify(sampler, logits, layout))
    assert with_keys.tolist() == [[best[0], best[1], best[2], -1, -1], best[5:10]]


@pytest.mark.parametrize("width", [2, 5, 7])
def test_one_launch_verifies_greedy_chunks_as_the_keys_argmax_and_the_accept_rule_do(width):
    """verify_greedy_from_keys: per chunk, each column's row argmax from its keys, kept up to the first
    column whose proposal differs (all of them where every proposal holds), then -1; proposals padded
    with -1 (a chunk with fewer) and given as a view of a wider tensor, as engine.spec.sampling stages them."""
    from custom_ops.triton_argmax import verify_greedy_from_keys
    from engine.spec.verify import greedy_tokens
    torch.manual_seed(width)
    n = 4
    logits, keys = _logits_with_keys(n * width, 300, GemvConfig(block_n=16, block_k=16, num_warps=1), torch.float32)
    best = logits.argmax(dim=-1)
    index = torch.arange(n * width, device=DEVICE).view(n, width)
    index[3, -1] = index[3, 0]  # a padded column reads a row already used (the chunk's last, in the engine)
    proposals = best[index[:, :-1]].clone()
    proposals[0, 0] += 1                       # chunk 0: the first proposal wrong
    if width > 2:
        proposals[1, width // 2] = -1          # chunk 1: fewer proposals, the rest -1
        proposals[1, width // 2:] = -1
    # chunk 2: every proposal right; chunk 3: right up to its padded column
    both = torch.cat([index, torch.cat([proposals, torch.full((n, 1), -1, device=DEVICE)], dim=1)])
    got = verify_greedy_from_keys(keys, both[:n], both[n:, :width - 1])
    want = greedy_tokens(best[index], proposals)
    assert torch.equal(got, want)
    assert got[0].tolist() == [int(best[index[0, 0]])] + [-1] * (width - 1)
    assert (got[2] >= 0).all()
    with pytest.raises(ValueError, match="verify_greedy_from_keys"):
        verify_greedy_from_keys(keys, both[:n], both[n:, :width])
