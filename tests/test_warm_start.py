"""Warm start (engine/worker/warm_start.py): a second start-up with the same compile cache runs the
saved graph without Dynamo; a changed configuration misses and says which field changed; a damaged
entry is recompiled and reported, never loaded half. CPU, tiny random Llama, each test with its own
cache directory."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

import models
from engine import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

CONFIG = dict(vocab_size=96, max_position_embeddings=128, hidden_size=64, intermediate_size=96,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, bos_token_id=1,
              eos_token_id=2, pad_token_id=0)
ENGINE = dict(device="cpu", block_size=4, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=8,
              show_progress=False, compile=True)
PROMPTS = [[1, 5, 9, 13], [1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]]
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
REPO = Path(__file__).resolve().parents[1]


def _model():
    return models.from_config(transformers.LlamaConfig(**CONFIG), dtype=torch.float32, device="cpu", seed=3)


def _run(cache_dir: Path, **changes) -> tuple[dict, list[list[int]]]:
    """(the engine's start-up stats, its greedy tokens), the engine closed."""
    with LLM(_model(), **{**ENGINE, **changes}) as llm:
        tokens = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
        return llm.stats()["startup"], tokens


def _inductor_dirs() -> dict[str, str]:
    """Inductor's and Triton's caches stay the user's (a rerun does not pay gcc again), while the graph
    store is each test's own: what is checked is whether a start-up traces and compiles."""
    from engine.worker.compile_cache import compile_cache_dir
    return {name: os.environ.get(name) or str(compile_cache_dir() / sub)
            for name, sub in (("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("TRITON_CACHE_DIR", "triton"))}


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    for name, value in _inductor_dirs().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("INFER_GRAPHS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("INFER_GRAPHS_COMPILE_CACHE", "1")  # tests/conftest.py turns it off by default
    monkeypatch.delenv("INFER_GRAPHS_CACHE_DIR", raising=False)
    return tmp_path / "cache"


def _entries(cache_dir: Path) -> list[Path]:
    root = cache_dir / "compile" / "graphs"
    return sorted(p for p in root.iterdir() if not p.name.startswith(".")) if root.is_dir() else []


def test_second_engine_loads_the_saved_graph_and_a_changed_config_misses_naming_the_field(cache_dir):
    cold, cold_tokens = _run(cache_dir, piece_compiler="eager")
    assert cold["compile_cache"] == "miss: no entry in the cache"
    assert cold["dynamo_traced"] is True
    assert cold["compile_cache_saved"].startswith("saved ")
    assert len(_entries(cache_dir)) == 1

    warm, warm_tokens = _run(cache_dir, piece_compiler="eager")
    assert warm["compile_cache"] == "hit" and warm["dynamo_traced"] is False
    assert "compile" not in [p["name"] for p in warm["phases"]]  # nothing traced at the first step
    assert warm_tokens == cold_tokens

    changed, changed_tokens = _run(cache_dir, piece_compiler="eager", max_num_seqs=2)
    assert changed["compile_cache"].startswith("miss: changed ")
    assert "engine.max_num_seqs: 4 -> 2" in changed["compile_cache"]
    assert changed["dynamo_traced"] is True
    assert changed_tokens == cold_tokens
    assert len(_entries(cache_dir)) == 2


def test_kv_pool_and_front_end_settings_keep_the_key_and_compile_settings_change_it():
    """A user who changes only how much memory the KV pool takes or where text is decoded keeps the
    warm start; anything the compiled graph depends on gives a new key."""
    from engine.config import EngineConfig
    from engine.worker.warm_start import key_fields, key_of
    model = _model()
    base = dict(device="cpu", max_model_len=64, max_num_seqs=4)
    key = key_of(key_fields(model, EngineConfig(**base)))
    for same in (dict(gpu_memory_utilization=0.5), dict(kv_memory_fraction=0.5), dict(num_gpu_blocks=40),
                 dict(frontend_process=False), dict(max_waiting_requests=3), dict(enable_prefix_caching=False),
                 dict(async_scheduling=False), dict(seed=7)):
        assert key_of(key_fields(model, EngineConfig(**base, **same))) == key, same
    for other in (dict(max_num_seqs=2), dict(max_num_batched_tokens=512), dict(block_size=32),
                  dict(dtype="bfloat16"), dict(piece_compiler="eager")):
        assert key_of(key_fields(model, EngineConfig(**{**base, **other}))) != key, other


def test_a_truncated_artifact_is_reported_removed_and_recompiled(cache_dir):
    _, expected = _run(cache_dir, piece_compiler="eager")
    (entry,) = _entries(cache_dir)
    artifact = next((entry / "graph0").glob("a0.*"))
    artifact.write_bytes(artifact.read_bytes()[:100])

    stats, tokens = _run(cache_dir, piece_compiler="eager")
    assert stats["compile_cache"].startswith(f"miss: entry {entry.name} unusable, removed")
    assert "truncated" in stats["compile_cache"]
    assert stats["dynamo_traced"] is True
    assert tokens == expected
    (rewritten,) = _entries(cache_dir)  # the same key, written again
    assert rewritten.name == entry.name

    again, tokens = _run(cache_dir, piece_compiler="eager")
    assert again["compile_cache"] == "hit" and tokens == expected


def test_the_switch_turns_the_store_off(cache_dir, monkeypatch):
    monkeypatch.setenv("INFER_GRAPHS_COMPILE_CACHE", "0")
    stats, _ = _run(cache_dir, piece_compiler="eager")
    assert stats["compile_cache"] == "off: INFER_GRAPHS_COMPILE_CACHE=0" and stats["dynamo_traced"] is True
    assert not _entries(cache_dir)


def _refuse_dynamo(*args):
    raise AssertionError("Dynamo's compiled code was called after the trace")


@pytest.mark.parametrize("store", ["0", "1"])
def test_after_the_trace_the_engine_calls_its_graph_without_dynamo(cache_dir, monkeypatch, store):
    """Dynamo's guards cost host time on every step outside a CUDA graph: once the one graph is traced,
    the engine calls it as a warm start does, with the store on or off, and generates what eager does."""
    monkeypatch.setenv("INFER_GRAPHS_COMPILE_CACHE", store)
    with LLM(_model(), **{**ENGINE, "piece_compiler": "eager"}) as llm:
        compiled = llm.runtime.compiled
        assert compiled.dynamo_traced and compiled.direct is not None
        compiled.forward = _refuse_dynamo
        tokens = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    with LLM(_model(), **{**ENGINE, "compile": False}) as eager:
        assert tokens == [o.token_ids for o in eager.generate(PROMPTS, GREEDY)]


def test_a_graph_whose_inputs_cannot_be_found_again_stays_behind_dynamo(cache_dir, monkeypatch, caplog):
    from engine.worker import warm_start
    monkeypatch.setenv("INFER_GRAPHS_COMPILE_CACHE", "0")

    def refuse(self, example_inputs):
        raise ValueError("graph input 3 is a stand-in the engine cannot find")
    monkeypatch.setattr(warm_start.InputBinder, "describe", refuse)
    with caplog.at_level("INFO", logger="engine"), LLM(_model(), **{**ENGINE, "piece_compiler": "eager"}) as llm:
        assert llm.runtime.compiled.direct is None
        tokens = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert "Dynamo keeps calling the traced graph (graph input 3 is a stand-in" in caplog.text
    with LLM(_model(), **{**ENGINE, "compile": False}) as eager:
        assert tokens == [o.token_ids for o in eager.generate(PROMPTS, GREEDY)]


def test_an_unreadable_graph_file_with_a_matching_manifest_is_a_miss_too(cache_dir):
    _, expected = _run(cache_dir, piece_compiler="eager")
    (entry,) = _entries(cache_dir)
    graph = entry / "graph0" / "graph.pkl"
    graph.write_bytes(b"not a pickle")
    manifest = json.loads((entry / "graph0" / "manifest.json").read_text())
    import hashlib
    manifest["graph.pkl"] = {"bytes": graph.stat().st_size, "sha256": hashlib.sha256(graph.read_bytes()).hexdigest()}
    (entry / "graph0" / "manifest.json").write_text(json.dumps(manifest))

    stats, tokens = _run(cache_dir, piece_compiler="eager")
    assert "graph.pkl: cannot be read" in stats["compile_cache"]
    assert stats["dynamo_traced"] is True and tokens == expected


_CHILD = """
import json, sys, torch, transformers, models
from engine import LLM, SamplingParams
torch.set_num_threads(1)
config = json.loads(sys.argv[1])
engine = config["engine"]
model = models.from_config(transformers.LlamaConfig(**config["model"]), dtype=getattr(torch, engine.get("dtype", "float32")),
                           device=engine["device"], seed=3)
with LLM(model, **engine) as llm:
    tokens = [o.token_ids for o in llm.generate(config["prompts"], SamplingParams(max_tokens=8, ignore_eos=True))]
    print(json.dumps({"startup": llm.stats()["startup"], "tokens": tokens}))
"""


def _child(cache_dir: Path, engine: dict = ENGINE) -> dict:
    env = {**os.environ, **_inductor_dirs(), "PYTHONPATH": str(REPO)}
    env["INFER_GRAPHS_CACHE"] = str(cache_dir)
    env["INFER_GRAPHS_COMPILE_CACHE"] = "1"
    env.pop("INFER_GRAPHS_CACHE_DIR", None)
    arg = json.dumps({"model": CONFIG, "engine": engine, "prompts": PROMPTS})
    proc = subprocess.run([sys.executable, "-c", _CHILD, arg], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_fresh_process_with_the_same_cache_skips_dynamo_and_inductor_and_generates_the_same(cache_dir):
    """Inductor pieces, as the engine compiles them by default: compiled here, loaded by a new process."""
    cold, cold_tokens = _run(cache_dir)
    assert cold["compile_cache"] == "miss: no entry in the cache"
    assert cold["dynamo_traced"] is True
    assert cold["compile_cache_saved"].startswith("saved ")
    warm = _child(cache_dir)
    assert warm["startup"]["compile_cache"] == "hit"
    assert warm["startup"]["dynamo_traced"] is False
    assert warm["tokens"] == cold_tokens


_IMPORT_THREAD_CHILD = """
import sys, threading, torch, transformers, models
from engine import LLM, SamplingParams
torch.set_num_threads(1)
first_import = {}

class Watch:  # notes which thread imports torch._dynamo first
    def find_spec(self, name, path=None, target=None):
        if name == "torch._dynamo" and name not in first_import:
            first_import[name] = threading.current_thread().name
        return None

sys.meta_path.insert(0, Watch())
engine = dict(device="cpu", block_size=4, max_model_len=64, max_num_seqs=4, show_progress=False)
model = models.from_config(transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
    num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1), dtype=torch.float32, device="cpu", seed=3)
with LLM(model, compile=False, **engine) as llm:
    eager = llm.generate([[1, 5, 9]], SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids
assert "torch._dynamo" not in sys.modules, "an eager engine imported torch._dynamo"
with LLM(model, compile=True, **engine) as llm:
    compiled = llm.generate([[1, 5, 9]], SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids
    wait = llm.stats()["startup"]["compile_imports_wait_s"]
assert compiled == eager, (compiled, eager)
assert first_import["torch._dynamo"] == "infer-graphs-compile-imports", first_import
assert isinstance(wait, float) and wait >= 0
print("IMPORT-THREAD-OK")
"""


def test_a_compiling_engine_imports_dynamo_on_its_own_thread_and_an_eager_one_never_does(cache_dir):
    """Dynamo and Inductor (over a second of imports) load on a thread from the engine's start, beside the
    weights and the tokenizer, not on the start-up's path; an engine that compiles nothing never
    imports them."""
    env = {**os.environ, **_inductor_dirs(), "PYTHONPATH": str(REPO), "INFER_GRAPHS_CACHE": str(cache_dir)}
    proc = subprocess.run([sys.executable, "-c", _IMPORT_THREAD_CHILD], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=240)
    assert "IMPORT-THREAD-OK" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_warm_start_with_graphs_loads_the_saved_graph_and_generates_the_same(tmp_path):
    """On CUDA with decode and prefill graphs (bf16): the warm process loads the pieces and captures
    its graphs from them; greedy tokens equal the cold process's."""
    engine = dict(device="cuda", dtype="bfloat16", block_size=16, max_model_len=128, max_num_seqs=4,
                  max_num_batched_tokens=64, show_progress=False)
    cold = _child(tmp_path / "cache", engine)
    warm = _child(tmp_path / "cache", engine)
    assert cold["startup"]["compile_cache"].startswith("miss")
    assert cold["startup"]["compile_cache_saved"].startswith("saved ")
    assert warm["startup"]["compile_cache"] == "hit" and warm["startup"]["dynamo_traced"] is False
    assert warm["tokens"] == cold["tokens"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_argmax_choice_is_timed_once_and_then_read_from_the_file(tmp_path):
    from engine.sample.argmax import RowArgmax
    logits = torch.randn(4, 128256, device="cuda", dtype=torch.bfloat16)
    first = RowArgmax(tmp_path / "argmax.json")
    first.choose(logits)
    assert first.timed == 2  # bfloat16 and float32
    second = RowArgmax(tmp_path / "argmax.json")
    second.choose(logits)
    assert second.timed == 0
    for dtype in (torch.bfloat16, torch.float32):
        x = logits.to(dtype)
        assert torch.equal(second(x), x.argmax(dim=-1))
