"""End-to-end engine generation on the CPU against transformers, and the engine's handling of bad input.

Each architecture is a tiny random transformers model saved with save_pretrained and loaded by the
engine from that directory; the reference is transformers' own greedy `generate`, one prompt at a
time. The engine runs the prompts as one batch with a small token budget (prefills are chunked and
mixed with decodes) and, in one test, a KV pool so small that requests are preempted and recomputed.
"""
from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch
import transformers

import models
from custom_ops import SCRATCH_BLOCK, RuntimeMode
from engine import LLM, ConfigError, EngineConfig, InvalidRequestError, SamplingParams
from engine.entrypoints.cli import main as cli_main
from engine.worker.dispatch import Dispatcher
from engine.worker.startup import _dummy_seqs, _warm_up
from tests.hf_helpers import random_hf_model

COMMON = dict(vocab_size=96, max_position_embeddings=128, initializer_range=0.5, pad_token_id=0,
              bos_token_id=1, eos_token_id=2)
ARCHS = {
    "llama": (transformers.LlamaConfig, dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2)),
    "qwen3": (transformers.Qwen3Config, dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                             tie_word_embeddings=False)),
    # a window of 6 tokens: every prompt here is longer than that once generation is done
    "gemma3": (transformers.Gemma3TextConfig, dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                                   query_pre_attn_scalar=16, sliding_window=6,
                                                   sliding_window_pattern=2, final_logit_softcapping=30.0)),
}
PROMPTS = [[1, 5, 9, 13], [1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57],
           [1, 7], [1, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29], [1, 60, 61, 62, 63, 64, 65, 66, 67]]
MAX_TOKENS = 10
SMALL = dict(device="cpu", block_size=4, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=8)


pytestmark = pytest.mark.usefixtures("one_thread")


def _build_hf(arch: str) -> transformers.PreTrainedModel:
    config_cls, kwargs = ARCHS[arch]
    return random_hf_model(config_cls(**COMMON, **kwargs), seed=7)


def save_arch_models(tmp_path_factory, stem: str) -> dict:
    """Each architecture's small random model saved as an HF-format directory: arch -> path."""
    dirs = {}
    for arch in ARCHS:
        path = tmp_path_factory.mktemp(f"{stem}_{arch}")
        _build_hf(arch).save_pretrained(path)
        dirs[arch] = path
    return dirs


@pytest.fixture(scope="module")
def saved_models(tmp_path_factory) -> dict[str, tuple[Path, list[list[int]]]]:
    """arch -> (model dir, transformers' greedy continuation of each prompt)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out = {}
    for arch in ARCHS:
        hf = _build_hf(arch)
        path = tmp_path_factory.mktemp(arch)
        hf.save_pretrained(path)
        expected = []
        with torch.no_grad():
            for prompt in PROMPTS:
                ids = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                  attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
                expected.append(ids[0, len(prompt):].tolist())
        out[arch] = (path, expected)
    torch.set_num_threads(threads)
    return out


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_batched_greedy_generation_equals_transformers(saved_models, arch):
    path, expected = saved_models[arch]
    llm = LLM(str(path), **SMALL)
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS))
    assert [o.token_ids for o in outputs] == expected
    for out, want in zip(outputs, expected):
        assert out.finish_reason == ("eos" if want[-1] == 2 and len(want) < MAX_TOKENS else "length")
        assert out.ttft_s is not None and len(out.inter_token_latencies_s) == len(out.token_ids) - 1
    stats = llm.stats()
    assert stats["modes"] == {"none": stats["steps"]} and stats["fallbacks"] == 0


def test_preempted_requests_are_recomputed_and_still_match(saved_models):
    path, expected = saved_models["llama"]
    # 64 tokens max per request -> 16 blocks + scratch; 17 usable blocks cannot hold 4 growing requests.
    llm = LLM(str(path), **{**SMALL, "max_num_batched_tokens": 32, "num_gpu_blocks": 18})
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    assert llm.stats()["preemptions"] > 0
    assert any(o.num_preemptions for o in outputs)
    for out, want in zip(outputs, expected):  # transformers stops at EOS; ignore_eos runs past it
        assert out.token_ids[:len(want)] == want and len(out.token_ids) == MAX_TOKENS


def test_compiled_model_generates_the_same_with_one_trace(saved_models):
    path, expected = saved_models["gemma3"]
    torch._dynamo.reset()
    llm = LLM(str(path), **SMALL, compile=True, piece_compiler="eager")
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS))
    assert [o.token_ids for o in outputs] == expected
    backend = llm.stats()["backend"]
    assert backend["graphs_compiled"] == 1 and backend["graphless_steps"] > 0  # decode and prefill alike
    llm.close()


class _EagerDecodeGraphs:
    """Stands in for engine.worker.decode_graphs.DecodeGraphs on the CPU: runs, eagerly, exactly what a
    captured decode graph runs (the FULL forward over the bucket's static buffer slices), so the
    padded FULL metadata (padding rows on the scratch block) is checked without CUDA."""

    def __init__(self, runner, sizes, store_first=False):
        self.runner, self.sizes, self.store_first = runner, tuple(sizes), store_first
        self.replays, self.replays_by_size, self.capture_seconds, self.graph_bytes = 0, {}, 0.0, 0

    def replay(self, batch_size, num_real):
        runner = self.runner
        meta = runner.buffers.metadata(batch_size, batch_size, batch_size, 1, runner.max_model_len, True)
        meta = dataclasses.replace(meta, store_first=self.store_first)
        logits = runner.model.compute_logits(runner.run_forward(meta, RuntimeMode.FULL, batch_size))
        self.replays += 1
        self.replays_by_size[batch_size] = self.replays_by_size.get(batch_size, 0) + 1
        return logits[:num_real]

    def argmax_keys(self, batch_size, num_real):
        return None  # the LM head stores argmax keys only on CUDA (CausalLM.argmax_key_tiles)

    def release(self):  # LLM.close: nothing captured
        pass


@pytest.mark.parametrize("arch", ["gemma3", "qwen3"])
def test_padded_full_and_piecewise_steps_give_the_same_tokens(saved_models, arch):
    """The FULL / PIECEWISE paths with padding (decode rows up to the bucket, tokens up to the piece
    size) on the CPU reference attention: the padding must not change any real token."""
    path, expected = saved_models[arch]
    llm = LLM(str(path), **SMALL)
    runner = llm.runtime.runner
    runner.decode_graphs = _EagerDecodeGraphs(runner, (2, 4))
    runner.dispatcher = Dispatcher((2, 4), (3, 8), decode_graphs_wanted=True, piecewise_graphs_wanted=True)
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS))
    assert [o.token_ids for o in outputs] == expected
    stats = llm.stats()
    assert stats["modes"]["full"] > 0 and stats["modes"]["piecewise"] > 0
    assert set(stats["decode_graph_replays_by_size"]) == {2, 4}  # 1 -> 2 and 3 -> 4 are padded



def test_full_step_with_a_one_token_prefill_chunk_samples_only_the_rows_that_end_a_request(saved_models):
    """A budget of 4 with 3 decodes leaves 1 token for a prefill: a uniform FULL batch in which one
    row samples nothing, so the graph's logits are cut to the sampling rows."""
    path, expected = saved_models["llama"]
    llm = LLM(str(path), **{**SMALL, "max_num_batched_tokens": 4})
    runner = llm.runtime.runner
    runner.decode_graphs = _EagerDecodeGraphs(runner, (2, 4))
    runner.dispatcher = Dispatcher((2, 4), (), decode_graphs_wanted=True)
    schedule, partial = llm.scheduler.schedule, []

    def spy():
        out = schedule()
        if out.is_uniform_decode and not all(c.samples for c in out.chunks):
            partial.append(len(out.chunks))
        return out

    llm.scheduler.schedule = spy
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS))
    assert [o.token_ids for o in outputs] == expected
    assert partial and llm.stats()["modes"]["full"] > 0


@pytest.fixture(scope="module")
def llama_llm(saved_models) -> LLM:
    return LLM(str(saved_models["llama"][0]), **SMALL)


@pytest.mark.parametrize("prompt,params,field", [
    ([], SamplingParams(), "prompt is empty"),
    ("", SamplingParams(), "prompt is empty"),
    (list(range(1, 70)), SamplingParams(), "longer than max_model_len"),
    ([1, 5, 96], SamplingParams(), "outside the vocabulary"),
    ([1, -1], SamplingParams(), "outside the vocabulary"),
    ([1, 5], SamplingParams(stop_token_ids=(500,)), "SamplingParams.stop_token_ids"),
    ([1, 5], SamplingParams(logit_bias={500: 1.0}), "SamplingParams.logit_bias"),
    ("hello", SamplingParams(), "no tokenizer"),
])
def test_bad_request_is_refused_by_name_and_in_flight_requests_are_unaffected(saved_models, llama_llm,
                                                                              prompt, params, field):
    _, expected = saved_models["llama"]
    llm = llama_llm
    good = llm.add_request(PROMPTS[1], SamplingParams(max_tokens=MAX_TOKENS), request_id="good")
    for _ in range(3):
        llm.step()
    with pytest.raises(InvalidRequestError, match=rf"request 'bad'.*{field}|{field}.*"):
        llm.add_request(prompt, params, request_id="bad")
    with pytest.raises(InvalidRequestError, match="request 'bad'"):
        llm.add_request(prompt, params, request_id="bad")
    finished = {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            if out.finished:
                finished[out.request_id] = out
    assert list(finished) == [good] and finished[good].token_ids == expected[1]


def test_a_tokenizer_that_was_asked_for_and_does_not_load_is_a_config_error(saved_models, tmp_path):
    with pytest.raises(ConfigError, match="EngineConfig.tokenizer="):
        LLM(str(saved_models["llama"][0]), tokenizer=str(tmp_path / "missing"), **SMALL)


def test_generate_takes_a_tensor_prompt_and_refuses_a_prompt_that_is_not_a_sequence(saved_models, llama_llm):
    _, expected = saved_models["llama"]
    params = SamplingParams(max_tokens=MAX_TOKENS)
    assert llama_llm.generate(torch.tensor(PROMPTS[0]), params)[0].token_ids == expected[0]
    assert [o.token_ids for o in llama_llm.generate(torch.tensor([PROMPTS[0], PROMPTS[0]]), params)] == [expected[0]] * 2
    with pytest.raises(InvalidRequestError, match="request 'bad': prompt must be a string or a sequence"):
        llama_llm.add_request(7, request_id="bad")


def test_a_built_model_with_another_dtype_in_the_config_is_a_config_error(saved_models):
    model = models.from_pretrained(str(saved_models["llama"][0]), dtype="float32", device="cpu")
    with pytest.raises(ConfigError, match="EngineConfig.dtype='bfloat16' but the built model's weights are float32"):
        LLM(model, **{**SMALL, "dtype": "bfloat16"})
    assert LLM(model, **SMALL).config.dtype == "float32"


def test_generate_validates_every_prompt_before_running_any(llama_llm):
    steps = llama_llm.num_steps
    with pytest.raises(InvalidRequestError, match=r"request '\d+\.2': prompt is empty"):
        llama_llm.generate([[1, 2, 3], [1, 4], []], SamplingParams(max_tokens=2))
    assert llama_llm.num_steps == steps and not llama_llm.has_unfinished_requests()


def test_streaming_step_reports_each_token(saved_models, llama_llm):
    _, expected = saved_models["llama"]
    rid = llama_llm.add_request(PROMPTS[3], SamplingParams(max_tokens=MAX_TOKENS))
    seen = []
    while llama_llm.has_unfinished_requests():
        for out in llama_llm.step():
            assert out.request_id == rid and out.token_ids[:len(seen)] == seen
            seen = out.token_ids
    assert seen == expected[3]


def test_a_stream_interleaved_with_generate_still_sees_its_request_finish(saved_models, llama_llm):
    """generate() steps every request in flight; a request added with add_request that finishes
    meanwhile is reported by the next step(), not dropped."""
    _, expected = saved_models["llama"]
    rid = llama_llm.add_request(PROMPTS[3], SamplingParams(max_tokens=MAX_TOKENS))
    llama_llm.step()
    long = SamplingParams(max_tokens=3 * MAX_TOKENS, ignore_eos=True)
    outputs = llama_llm.generate([PROMPTS[0], PROMPTS[2]], long)
    assert [o.token_ids[:len(expected[i])] for o, i in zip(outputs, (0, 2))] == [expected[0], expected[2]]
    assert llama_llm.has_unfinished_requests()  # the stream's last output is still to be reported
    last = {}
    while llama_llm.has_unfinished_requests():
        for out in llama_llm.step():
            last[out.request_id] = out
    assert list(last) == [rid] and last[rid].finished and last[rid].token_ids == expected[3]


def test_max_tokens_none_runs_until_max_model_len_or_eos_or_a_stop_as_vllm(llama_llm):
    prompt = PROMPTS[1]
    max_model_len = SMALL["max_model_len"]
    [free] = llama_llm.generate(prompt, SamplingParams(max_tokens=None, ignore_eos=True))
    assert len(prompt) + len(free.token_ids) == max_model_len and free.finish_reason == "length"
    [bounded] = llama_llm.generate(prompt, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    assert free.token_ids[:MAX_TOKENS] == bounded.token_ids
    # EOS ends it: the model's EOS made the only token it can sample
    [eos] = llama_llm.generate(prompt, SamplingParams(max_tokens=None, logit_bias={COMMON["eos_token_id"]: 100}))
    assert eos.token_ids == [COMMON["eos_token_id"]] and eos.finish_reason == "eos"
    stop = free.token_ids[5]
    [stopped] = llama_llm.generate(prompt, SamplingParams(max_tokens=None, ignore_eos=True, stop_token_ids=[stop]))
    assert stopped.token_ids == free.token_ids[:free.token_ids.index(stop) + 1] and stopped.finish_reason == "stop"


def test_cli_generates_text_with_a_tokenizer(tmp_path, capsys, saved_models):
    """The command line on a tiny Gemma 3 that borrows the default model's tokenizer (if converted)."""
    default_dir = Path.home() / ".cache" / "infer_graphs" / "gemma-3-270m"
    if not (default_dir / "tokenizer.json").is_file():
        pytest.skip("the default model's tokenizer has not been converted on this machine")
    config_cls, kwargs = ARCHS["gemma3"]
    hf = transformers.AutoModelForCausalLM.from_config(
        config_cls(**{**COMMON, "vocab_size": 262144, "bos_token_id": 2, "eos_token_id": 1}, **{
            **kwargs, "hidden_size": 32, "num_hidden_layers": 2}), dtype=torch.float32)
    hf.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (default_dir / name).is_file():
            shutil.copy(default_dir / name, tmp_path / name)
    assert cli_main(["generate", "--model", str(tmp_path), "--prompt", "The capital of France is",
                     "--max-tokens", "4", "--ignore-eos", "--max-model-len", "64"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("The capital of France is") and "tokens/s" in out
    assert ("graphs:" in out) == torch.cuda.is_available()  # no graph counters where there are no graphs


def test_warm_up_pads_a_token_budget_that_max_num_seqs_full_length_requests_cannot_fill(saved_models):
    """64 tokens of budget, 2 sequences of at most 16: the dummy step (the warm-up of every CUDA or
    compiled engine, and each piecewise capture) makes the 32 tokens that do not fit padding."""
    path, expected = saved_models["llama"]
    llm = LLM(str(path), **{**SMALL, "max_model_len": 16, "max_num_seqs": 2, "max_num_batched_tokens": 64})
    runner = llm.runtime.runner
    with torch.inference_mode():  # as at start-up: the static buffers are inference tensors
        meta = runner.load_dummy(64, _dummy_seqs(64, llm.config), uniform_decode=False)
        assert meta.num_seqs == 2 and meta.num_actual_tokens == 32 and meta.seq_lens.tolist() == [16, 16]
        assert (meta.slot_mapping // llm.config.block_size == SCRATCH_BLOCK).all()
        _warm_up(runner, llm.runtime.sampler, llm.config, False)
    assert llm.generate(PROMPTS[0], SamplingParams(max_tokens=MAX_TOKENS))[0].token_ids == expected[0]


def test_vllm_spellings_enforce_eager_and_sampling_params_are_taken(saved_models, llama_llm, monkeypatch):
    """enforce_eager=True: no graphs of either kind (vLLM's meaning), the other fields untouched."""
    _, expected = saved_models["llama"]
    out = llama_llm.generate(PROMPTS[0], sampling_params=SamplingParams(max_tokens=MAX_TOKENS))[0]
    assert out.token_ids == expected[0]
    with pytest.raises(InvalidRequestError, match="both params and sampling_params"):
        llama_llm.generate(PROMPTS[0], SamplingParams(), sampling_params=SamplingParams())
    seen = {}

    class Stop(Exception):
        pass

    def capture(name, **fields):
        seen.update(fields)
        raise Stop

    monkeypatch.setattr(EngineConfig, "from_kwargs", capture)
    with pytest.raises(Stop):
        LLM(str(saved_models["llama"][0]), enforce_eager=True, max_num_seqs=3)
    assert seen == {"cudagraph_mode": "NONE", "max_num_seqs": 3}
    with pytest.raises(ConfigError, match="enforce_eager=True and cudagraph_mode='FULL' disagree"):
        LLM(str(saved_models["llama"][0]), enforce_eager=True, cudagraph_mode="FULL")
