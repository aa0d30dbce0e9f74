"""The benchmarks' front end (bench.frontend, bench.tokenizer, bench.host): the engine holds a real
tokenizer, requests carry stop strings, and the host-time suite runs on a tiny model. CPU only, fast."""
from __future__ import annotations

import pytest

from bench.frontend import STOP_STRINGS, VARIANTS, TokenizerMissing, parse_variants, tokenizer_dir
from bench.measure import Report

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny_tok_dir(tmp_path_factory):
    from tests.tiny_tokenizer import save_tiny_tokenizer
    path = tmp_path_factory.mktemp("tok")
    assert save_tiny_tokenizer(path) >= 256  # covers tiny-llama's vocabulary
    return path


def test_variants_default_to_the_issue_table_and_none_means_plain_only():
    assert [v.name for v in parse_variants(None)] == ["plain", "tokenizer", "stop"]
    assert [(v.tokenizer, v.stop) for v in parse_variants(None)] == [(False, ()), (True, ()), (True, STOP_STRINGS)]
    assert len(STOP_STRINGS) == 2 and VARIANTS["stop"].row() == {"tokenizer": "on", "stop_strings": 2}
    assert [v.name for v in parse_variants(None, "none")] == ["plain"]
    assert [v.name for v in parse_variants("stop,plain")] == ["stop", "plain"]
    with pytest.raises(ValueError, match="unknown"):
        parse_variants("fast")
    with pytest.raises(ValueError, match="only the 'plain' variant"):
        parse_variants("tokenizer", "none")


def test_a_missing_tokenizer_directory_says_how_to_make_it(tmp_path, monkeypatch, capsys):
    import bench.frontend
    assert tokenizer_dir("none") is None
    with pytest.raises(TokenizerMissing, match=r"python -m bench tokenizer --out .*nowhere"):
        tokenizer_dir(str(tmp_path / "nowhere"))
    monkeypatch.setattr(bench.frontend, "DEFAULT_TOKENIZER_DIR", tmp_path / "absent")
    from bench.__main__ import main
    assert main(["e2e", "--model", "tiny-llama", "--out", str(tmp_path)]) == 2  # before any engine starts
    err = capsys.readouterr().err
    assert "python -m bench tokenizer" in err and "--tokenizer none" in err


def test_the_tokenizer_step_writes_a_plain_directory_that_loads_and_matches_its_source(tiny_tok_dir, tmp_path):
    import json

    from bench.__main__ import main
    from bench.frontend import load_tokenizer
    from bench.tokenizer import INFO_FILE
    out = tmp_path / "written"
    assert main(["tokenizer", "--source", str(tiny_tok_dir), "--out", str(out)]) == 0
    info = json.loads((out / INFO_FILE).read_text())
    assert (out / "tokenizer.json").is_file() and info["bytes"] == sum(info["files"].values()) > 0
    assert info["covers"] == ["tiny-gemma3", "tiny-llama"]  # 384 tokens: not the real models' vocabularies
    tok = load_tokenizer(out, vocab_size=256)
    assert tok.decode(tok("Café 🙂")["input_ids"], skip_special_tokens=True) == "Café 🙂"
    with pytest.raises(ValueError, match="fewer than the model's vocabulary"):
        load_tokenizer(out, vocab_size=262144)


def test_null_forward_config_keeps_the_vocabulary_and_the_kinds_of_attention_layers():
    import models
    from bench.configs import GEMMA_3_1B, LLAMA_3_2_3B
    from bench.host import null_forward_config
    gemma, llama = null_forward_config(GEMMA_3_1B), null_forward_config(LLAMA_3_2_3B)
    assert gemma["vocab_size"] == 262144 and llama["vocab_size"] == 128256
    assert gemma["hidden_size"] == llama["hidden_size"] == 64 and llama["num_hidden_layers"] == 1
    assert gemma["layer_types"] == ["sliding_attention", "full_attention"] and "layer_types" not in llama
    small = {**gemma, "vocab_size": 512}  # the same model, a vocabulary the test can afford
    net = models.from_config(small, dtype=__import__("torch").float32, device="cpu", seed=0)
    assert [str(t) for t in net.config.layer_types] == ["sliding_attention", "full_attention"]


def test_serving_requests_carry_stop_strings_on_a_share_and_only_with_a_tokenizer():
    from bench import serving
    from bench.workload import with_stops
    s = serving.sizes_for(False, 8, None)
    specs, _ = serving.make("continuous_batching", s, 256, stop=STOP_STRINGS)
    with_stop = [r for r in specs if r.stop]
    assert len(with_stop) == round(serving.STOP_SHARE * len(specs)) and all(r.stop == STOP_STRINGS for r in with_stop)
    again, _ = serving.make("continuous_batching", s, 256, stop=STOP_STRINGS)
    assert again == specs  # seeded: the same requests carry them every run
    plain, _ = serving.make("continuous_batching", s, 256)
    assert not any(r.stop for r in plain) and [r.prompt_ids for r in plain] == [r.prompt_ids for r in specs]
    assert with_stops(plain, STOP_STRINGS, 1.0) == [r.__class__(**{**r.__dict__, "stop": STOP_STRINGS}) for r in plain]


def _spy_llm(monkeypatch):
    """engine.LLM, recording the tokenizer each engine holds and the SamplingParams each generate gets."""
    import engine
    seen = []

    class SpyLLM(engine.LLM):
        def __init__(self, model, tokenizer=None, **fields):
            super().__init__(model, tokenizer=tokenizer, **fields)
            seen.append(("engine", tokenizer))

        def generate(self, prompts, params=None):
            outs = super().generate(prompts, params)
            seen.append(("generate", self.tokenizer, params.stop, [o.text for o in outs]))
            return outs
    monkeypatch.setattr(engine, "LLM", SpyLLM)
    return seen


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the CPU run of the suite")
def test_host_suite_runs_a_null_forward_with_each_front_end_variant(tiny_tok_dir, tmp_path, monkeypatch):
    from bench import host
    seen = _spy_llm(monkeypatch)
    monkeypatch.setenv(host.PROFILE_ENV, str(tmp_path / "prof"))
    report = host.run("tiny-llama", batches="3", prompt_len=6, output_len=4, tokenizer=str(tiny_tok_dir), repeats=1)
    # BENCH_HOST_PROFILE: one profiled generate per engine, its last variant, the step loop's functions in it
    profiles = sorted(p.name for p in (tmp_path / "prof").glob("*.txt"))
    assert profiles == ["host-tiny-llama-inline-plain.txt", "host-tiny-llama-inline-stop.txt"]
    assert "step_loop.py" in (tmp_path / "prof" / profiles[1]).read_text()
    rows = [(r["batch"], r["tokenizer"], r["stop_strings"]) for r in report.rows]
    assert rows == [(3, "off", 0), (3, "on", 0), (3, "on", 2)]
    for r in report.rows:
        assert r["ms_per_step"] > 0 and r["us_per_request"] == pytest.approx(r["ms_per_step"] * 1e3 / 3)
        assert r["steady_steps"] >= 1 and r["graph_replay_ms"] is None  # no graphs on the CPU
        assert r["host_speed_us"] > 0  # the host's pace beside each row
    assert report.meta["null_model"] == {"hidden_size": 64, "num_hidden_layers": 1, "vocab_size": 256}
    # one engine without a tokenizer, then one holding it; the stop variant's params carry both strings
    engines = [tok for kind, tok, *_ in seen if kind == "engine"]
    assert engines[0] is None and engines[1] is not None and len(engines) == 2
    calls = [(tok is not None, stop, texts) for kind, tok, *rest in seen if kind == "generate"
             for stop, texts in [rest]]
    assert len(calls) == 3 * 2 + 2  # a warm-up and a measured call per variant, a profiled one per engine
    assert {(has_tok, stop) for has_tok, stop, _ in calls} == {(False, ()), (True, ()), (True, STOP_STRINGS)}
    assert all(any(texts) == has_tok for has_tok, _, texts in calls)  # text only where the engine detokenizes
    md = report.markdown()
    assert "| batch | tokenizer | stop_strings | frontend | ms_per_step | us_per_request |" in md
    assert [r["frontend"] for r in report.rows] == ["-", "inline", "inline"]  # the CPU's default front end
    assert any("null forward" in n for n in report.notes)
    paths = report.write(str(tmp_path))
    assert Report.load(paths[0]).rows == report.rows


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the CPU run of the suite")
def test_host_suite_rows_per_front_end(tiny_tok_dir, monkeypatch):
    """--frontends process,inline: one engine per front end, each row named by the engine it ran on."""
    import engine
    from bench import host
    fronts = []

    class SpyLLM(engine.LLM):
        def __init__(self, model, tokenizer=None, **fields):
            super().__init__(model, tokenizer=tokenizer, **fields)
            fronts.append(self.stats()["frontend_process"])
    monkeypatch.setattr(engine, "LLM", SpyLLM)
    report = host.run("tiny-llama", batches="2", prompt_len=6, output_len=4, tokenizer=str(tiny_tok_dir), repeats=1,
                      variants="stop", frontends="process,inline")
    assert fronts == [True, False]
    assert [(r["stop_strings"], r["frontend"]) for r in report.rows] == [(2, "process"), (2, "inline")]
    assert all(r["ms_per_step"] > 0 for r in report.rows)
    with pytest.raises(ValueError, match="--frontends"):
        host.parse_frontends("thread", on_cuda=False)
