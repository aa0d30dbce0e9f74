"""Engines that own their state and give it back: KV caches per engine, close / with / drop, many
compiled engines in one process, the start-up timeline, and sampling that does not depend on the
batch or on preemption. CPU, tiny random models; references are transformers' greedy generate."""
from __future__ import annotations

import gc
import os
import weakref

import pytest
import torch
import transformers

import models
from custom_ops import is_registered
from engine import LLM, SamplingParams
from tests.hf_helpers import random_hf_model

COMMON = dict(vocab_size=96, max_position_embeddings=128, initializer_range=0.5, pad_token_id=0,
              bos_token_id=1, eos_token_id=2, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2)
PROMPTS = [[1, 5, 9, 13], [1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57],
           [1, 7], [1, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29], [1, 60, 61, 62, 63, 64, 65, 66, 67]]
MAX_TOKENS = 8
SMALL = dict(device="cpu", block_size=4, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=8,
             show_progress=False)


pytestmark = pytest.mark.usefixtures("one_thread")


def _greedy(hf, prompt, max_new_tokens=MAX_TOKENS):
    with torch.no_grad():
        ids = hf.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                          attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return ids[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """arch -> (model dir, transformers' greedy continuation of each prompt, ignoring EOS)."""
    out = {}
    for arch, config in (("llama", transformers.LlamaConfig(**COMMON)),
                         ("qwen3", transformers.Qwen3Config(**COMMON, head_dim=16, tie_word_embeddings=False))):
        hf = random_hf_model(config, seed=11)
        hf.generation_config.eos_token_id = None  # the references run past EOS, as ignore_eos does
        path = tmp_path_factory.mktemp(arch)
        hf.save_pretrained(path)
        (path / "generation_config.json").unlink(missing_ok=True)
        out[arch] = (path, [_greedy(hf, p) for p in PROMPTS], hf)
    return out


GREEDY = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)


def test_twelve_compiled_engines_built_used_and_closed_one_after_another_all_generate_correctly(saved):
    """Each compiled engine used to add a Dynamo entry to the model class's forward: the 9th raised
    FailOnRecompileLimitHit and closed engines stayed referenced. Now each engine's compiled code,
    backend and KV tensors die with it."""
    path, expected, _ = saved["llama"]
    for i in range(12):
        llm = LLM(str(path), **SMALL, compile=True, piece_compiler="eager")
        outputs = llm.generate(PROMPTS[:2], GREEDY)
        assert [o.token_ids for o in outputs] == expected[:2], f"engine {i}"
        assert llm.stats()["backend"]["graphs_compiled"] == 1
        backend = weakref.ref(llm.runtime.backend)
        forward = weakref.ref(llm.runtime.compiled.forward)
        kv = [weakref.ref(t) for t in llm.runtime.kv_cache.tensors]
        names = list(llm.runtime.kv_cache.layer_names)
        llm.close()
        del llm, outputs
        gc.collect()
        assert backend() is None and forward() is None and all(r() is None for r in kv), f"engine {i}"
        assert not any(is_registered(n) for n in names)  # the model it loaded went with it


def test_close_is_idempotent_and_a_closed_engine_refuses_work_but_keeps_its_stats(saved):
    path, expected, _ = saved["llama"]
    with LLM(str(path), **SMALL) as llm:
        assert llm.generate(PROMPTS[0], GREEDY)[0].token_ids == expected[0]
    steps = llm.stats()["steps"]
    assert steps > 0 and llm.stats()["startup"]["phases"]
    llm.close()
    for call in (lambda: llm.generate(PROMPTS[0]), llm.step, lambda: llm.add_request(PROMPTS[0])):
        with pytest.raises(RuntimeError, match="closed"):
            call()
    assert llm.stats()["steps"] == steps


def test_dropping_the_last_reference_releases_the_engine(saved):
    path, expected, _ = saved["llama"]
    llm = LLM(str(path), **SMALL, compile=True, piece_compiler="eager")
    assert llm.generate(PROMPTS[0], GREEDY)[0].token_ids == expected[0]
    backend, kv = weakref.ref(llm.runtime.backend), weakref.ref(llm.runtime.kv_cache.tensors[0])
    del llm
    gc.collect()
    assert backend() is None and kv() is None


def test_two_engines_over_one_model_are_isolated_and_one_closing_leaves_the_other_working(saved):
    """Stepped alternately with different prompts and different pool sizes (17 and 200 blocks), each
    engine's greedy output equals transformers'; then one closes and the other still works."""
    path, expected, _ = saved["llama"]
    model = models.from_pretrained(path)
    small = LLM(model, **{**SMALL, "num_gpu_blocks": 17})
    large = LLM(model, **{**SMALL, "num_gpu_blocks": 200})
    a = [small.add_request(PROMPTS[i], GREEDY) for i in (0, 2)]
    b = [large.add_request(PROMPTS[i], GREEDY) for i in (1, 3, 4)]
    tokens: dict[tuple[str, str], list[int]] = {}
    for _ in range(200):
        if not (small.has_unfinished_requests() or large.has_unfinished_requests()):
            break
        for name, llm in (("small", small), ("large", large)):
            if llm.has_unfinished_requests():
                for out in llm.step():
                    tokens[(name, out.request_id)] = out.token_ids
    assert [tokens[("small", r)] for r in a] == [expected[0], expected[2]]
    assert [tokens[("large", r)] for r in b] == [expected[1], expected[3], expected[4]]
    small.close()
    assert [o.token_ids for o in large.generate(PROMPTS[:2], GREEDY)] == expected[:2]
    large.close()
    # the model outlives both engines (it was handed in) and serves a third
    assert all(is_registered(n) for n in model.attention_layer_names)
    with LLM(model, **SMALL) as third:
        assert third.generate(PROMPTS[3], GREEDY)[0].token_ids == expected[3]


def test_an_open_compiled_engine_keeps_start_up_out_of_collections_and_the_last_to_close_gives_it_back(saved):
    """A full collection over a traced and compiled model took 0.24-0.28 s on an H100 host (gemma-3-1b),
    a stall in whichever serving step met one: an open compiled engine keeps what its start-up left
    alive frozen (gc.freeze). Engines nest: the last one to close unfreezes, and what the closed ones
    left in reference cycles is collected then."""
    path, expected, _ = saved["llama"]
    assert gc.get_freeze_count() == 0
    first = LLM(str(path), **SMALL, compile=True, piece_compiler="eager")
    frozen = gc.get_freeze_count()
    assert frozen > 0
    second = LLM(str(path), **SMALL, compile=True, piece_compiler="eager")
    assert gc.get_freeze_count() > frozen
    first_backend = weakref.ref(first.runtime.backend)
    first.close()
    assert gc.get_freeze_count() > 0  # the second engine still serves
    assert [o.token_ids for o in second.generate(PROMPTS[:2], GREEDY)] == expected[:2]
    second.close()
    assert gc.get_freeze_count() == 0
    del first, second
    gc.collect()
    assert first_backend() is None


def test_two_engines_on_two_different_models_live_side_by_side(saved):
    (llama_path, llama_expected, _), (qwen_path, qwen_expected, _) = saved["llama"], saved["qwen3"]
    llama, qwen = LLM(str(llama_path), **SMALL), LLM(str(qwen_path), **SMALL)
    for _ in range(2):
        assert [o.token_ids for o in llama.generate(PROMPTS[:3], GREEDY)] == llama_expected[:3]
        assert [o.token_ids for o in qwen.generate(PROMPTS[:3], GREEDY)] == qwen_expected[:3]
    llama.close()
    qwen.close()


def test_startup_timeline_is_reported_and_its_phases_add_up_to_the_total(saved):
    path, _, _ = saved["llama"]
    with LLM(str(path), **SMALL, compile=True, piece_compiler="eager") as llm:
        startup = llm.stats()["startup"]
    names = [p["name"] for p in startup["phases"]]
    assert names[:2] == ["load", "tokenizer"] and "setup" in names and "compile" in names and "kv pool" in names
    assert all(p["seconds"] >= 0 for p in startup["phases"])
    total, phases = startup["total_seconds"], startup["phases_seconds"]
    assert phases == pytest.approx(sum(p["seconds"] for p in startup["phases"]))
    assert 0.9 * total <= phases <= total, startup


def test_an_eager_cpu_engine_warms_up_at_start_up_not_in_the_first_request(saved):
    """The kernels' lazy set-up (the first forward, the sampler) runs in start-up's warm-up phases,
    a small prefill then a decode, and leaves no request or KV block behind."""
    path, _, _ = saved["llama"]
    with LLM(str(path), **SMALL) as llm:
        stats = llm.stats()
    assert [p["name"] for p in stats["startup"]["phases"]].count("warm-up") == 2
    assert stats["steps"] == 0 and stats["kv_blocks_free"] == stats["kv_blocks"] - 1


def test_a_prompt_of_exactly_max_model_len_gets_its_one_token(saved):
    path, _, hf = saved["llama"]
    prompt = [1] + [(7 * i) % 90 + 3 for i in range(31)]
    with LLM(str(path), **{**SMALL, "max_model_len": 32}) as llm:
        out = llm.generate(prompt, SamplingParams(max_tokens=5, ignore_eos=True))[0]
    assert out.token_ids == _greedy(hf, prompt, 1) and out.finish_reason == "length"


def test_seeded_sampling_is_the_same_alone_in_any_batch_and_across_preemption(saved):
    path, _, _ = saved["llama"]
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=100 + i, ignore_eos=True)
              for i in range(len(PROMPTS))]
    with LLM(str(path), **SMALL) as llm:
        alone = [llm.generate(p, sp)[0].token_ids for p, sp in zip(PROMPTS, params)]
        batched = [o.token_ids for o in llm.generate(PROMPTS, params)]
        reordered = [o.token_ids for o in llm.generate(PROMPTS[::-1], params[::-1])][::-1]
    assert batched == alone and reordered == alone
    assert len({t for tokens in alone for t in tokens}) > len(PROMPTS)  # it does sample
    with LLM(str(path), **{**SMALL, "max_num_batched_tokens": 32, "num_gpu_blocks": 18}) as tight:
        outputs = tight.generate(PROMPTS, params)
        assert tight.stats()["preemptions"] > 0
    assert [o.token_ids for o in outputs] == alone


def test_ptxas_is_pinned_to_torchs_own_before_anything_compiles(tmp_path, monkeypatch):
    """Triton's cache key hashes the ptxas version: a process must use the one Inductor would switch
    to, from its start, or warm starts miss the cache (engine.worker.compile_cache)."""
    from engine.worker import compile_cache
    monkeypatch.delenv("TRITON_PTXAS_PATH", raising=False)
    assert compile_cache.pin_ptxas(tmp_path) is None and "TRITON_PTXAS_PATH" not in os.environ  # none bundled
    ptxas = tmp_path / "bin" / "ptxas"
    ptxas.parent.mkdir()
    ptxas.write_text("#!/bin/sh\n")
    assert compile_cache.pin_ptxas(tmp_path) is None  # not executable: left alone, as Inductor does
    ptxas.chmod(0o755)
    assert compile_cache.pin_ptxas(tmp_path) == str(ptxas) == os.environ["TRITON_PTXAS_PATH"]
    monkeypatch.setenv("TRITON_PTXAS_PATH", "/users/own/ptxas")
    assert compile_cache.pin_ptxas(tmp_path) == "/users/own/ptxas"


def test_compile_cache_is_the_compile_folder_of_the_one_cache_root(tmp_path, monkeypatch):
    from engine.worker import compile_cache
    monkeypatch.delenv("INFER_GRAPHS_CACHE_DIR", raising=False)
    monkeypatch.delenv("INFER_GRAPHS_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache.compile_cache_dir() == models.cache_root() / "compile" == tmp_path / "xdg/infer_graphs/compile"
    monkeypatch.setenv("INFER_GRAPHS_CACHE", str(tmp_path / "root"))
    assert compile_cache.compile_cache_dir() == tmp_path / "root" / "compile"
    assert models.cache_root() == tmp_path / "root"


def test_compile_cache_directory_respects_the_users_choice_and_clears_only_itself(tmp_path, monkeypatch):
    from engine.worker import compile_cache
    # the deprecated variable names the compile directory itself, as it always did, with a warning
    monkeypatch.setenv("INFER_GRAPHS_CACHE_DIR", str(tmp_path / "ours"))
    with pytest.warns(FutureWarning, match="INFER_GRAPHS_CACHE_DIR is deprecated: set INFER_GRAPHS_CACHE"):
        assert compile_cache.compile_cache_dir() == tmp_path / "ours"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "users_triton"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("TRITON_PTXAS_PATH", str(tmp_path / "users_ptxas"))
    with pytest.warns(FutureWarning):
        chosen = compile_cache.configure_compile_cache()
    assert chosen == {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "ours" / "inductor"),
                      "TRITON_CACHE_DIR": str(tmp_path / "users_triton"),
                      "TRITON_PTXAS_PATH": str(tmp_path / "users_ptxas")}
    (tmp_path / "ours" / "inductor").mkdir(parents=True)
    (tmp_path / "users_triton").mkdir()
    with pytest.warns(FutureWarning):
        assert compile_cache.clear_compile_cache() == tmp_path / "ours"
    assert not (tmp_path / "ours").exists() and (tmp_path / "users_triton").exists()
