"""Loading: config formats of transformers 4.x and 5.x, sharded checkpoints, dtypes, and the errors a
user gets for a bad path, an unknown architecture, or a missing / unexpected / misshapen weight."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import models
from tests.hf_helpers import random_hf_model

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            initializer_range=0.5)  # large enough that rope and norms visibly move the logits


# Half-precision logit tolerance: a few ulps at the logit scale of these tiny models (~5-15).
TOL = {torch.bfloat16: 0.15, torch.float16: 0.03}


def _save_hf(config: transformers.PretrainedConfig, path: Path, **save_kwargs) -> transformers.PreTrainedModel:
    hf = random_hf_model(config, seed=5, embed_std=None)
    hf.save_pretrained(path, **save_kwargs)
    return hf


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("llama")
    _save_hf(transformers.LlamaConfig(**TINY, tie_word_embeddings=False), path)
    return path


def _copy_with(src: Path, dst: Path, edit_state=None, edit_config=None) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    state = load_file(str(src / "model.safetensors"))
    if edit_config:
        edit_config(config)
    if edit_state:
        edit_state(state)
    (dst / "config.json").write_text(json.dumps(config))
    save_file(state, str(dst / "model.safetensors"))
    return dst


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.compute_logits(model(ids, torch.arange(len(ids))))


# ----------------------------------------------------------------------------- errors

def test_missing_path_raises_model_path_error(tmp_path):
    with pytest.raises(models.ModelPathError, match="does not exist"):
        models.from_pretrained(tmp_path / "nowhere")


def test_directory_without_config_raises_model_path_error(tmp_path):
    with pytest.raises(models.ModelPathError, match="no config.json"):
        models.from_pretrained(tmp_path)


def test_plain_file_that_is_not_gguf_raises_model_path_error(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"\0" * 16)
    with pytest.raises(models.ModelPathError, match="HF-format directory"):
        models.from_pretrained(tmp_path / "weights.bin")


def test_invalid_config_json_raises_model_path_error(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(models.ModelPathError, match="not valid JSON"):
        models.from_pretrained(tmp_path)


def test_directory_without_safetensors_raises_model_path_error(llama_dir, tmp_path):
    (tmp_path / "config.json").write_text((llama_dir / "config.json").read_text())
    with pytest.raises(models.ModelPathError, match="no model.safetensors"):
        models.from_pretrained(tmp_path)


def test_corrupt_safetensors_raises_model_path_error(llama_dir, tmp_path):
    (tmp_path / "config.json").write_text((llama_dir / "config.json").read_text())
    (tmp_path / "model.safetensors").write_bytes(b"garbage, not a safetensors header")
    with pytest.raises(models.ModelPathError, match="cannot read checkpoint shard"):
        models.from_pretrained(tmp_path)


def test_unknown_architecture_lists_supported_ones(llama_dir, tmp_path):
    def to_mistral(config):
        config["architectures"] = ["MistralForCausalLM"]
        config["model_type"] = "mistral"
    path = _copy_with(llama_dir, tmp_path / "m", edit_config=to_mistral)
    with pytest.raises(models.UnknownArchitectureError) as info:
        models.from_pretrained(path)
    message = str(info.value)
    assert "MistralForCausalLM" in message
    assert all(name in message for name in models.SUPPORTED_ARCHITECTURES)
    with pytest.raises(models.UnknownArchitectureError, match="MistralForCausalLM"):
        models.from_config(json.loads((path / "config.json").read_text()))


def test_missing_weight_is_named(llama_dir, tmp_path):
    name = "model.layers.1.self_attn.k_proj.weight"
    path = _copy_with(llama_dir, tmp_path / "m", edit_state=lambda s: s.pop(name))
    with pytest.raises(models.MissingWeightError, match=name.replace(".", r"\.")):
        models.from_pretrained(path)


def test_untied_checkpoint_without_lm_head_is_a_missing_weight(llama_dir, tmp_path):
    path = _copy_with(llama_dir, tmp_path / "m", edit_state=lambda s: s.pop("lm_head.weight"))
    with pytest.raises(models.MissingWeightError, match=r"lm_head\.weight"):
        models.from_pretrained(path)


def test_unexpected_weight_is_named(llama_dir, tmp_path):
    def add(state):
        state["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(3, 3)
    path = _copy_with(llama_dir, tmp_path / "m", edit_state=add)
    with pytest.raises(models.UnexpectedWeightError, match=r"model\.layers\.0\.mlp\.extra_proj\.weight"):
        models.from_pretrained(path)


def test_misshapen_weight_names_it_and_both_shapes(llama_dir, tmp_path):
    name = "model.layers.0.mlp.up_proj.weight"  # a slice of our fused gate_up_proj: (48, 32)
    path = _copy_with(llama_dir, tmp_path / "m", edit_state=lambda s: s.__setitem__(name, torch.zeros(40, 32)))
    with pytest.raises(models.WeightShapeError) as info:
        models.from_pretrained(path)
    assert name in str(info.value) and "(40, 32)" in str(info.value) and "(48, 32)" in str(info.value)


def test_weight_stored_twice_is_refused(llama_dir):
    """Two shards holding one name would silently overwrite each other; the loader names it instead."""
    state = load_file(str(llama_dir / "model.safetensors"))
    name = "model.layers.0.self_attn.q_proj.weight"
    model = models.from_config(json.loads((llama_dir / "config.json").read_text()))
    with pytest.raises(models.UnexpectedWeightError, match=r"q_proj\.weight.*more than once"):
        models.load_weights(model, [*state.items(), (name, state[name])])


def test_rope_scaling_without_a_required_field_names_it():
    config = transformers.LlamaConfig(**TINY).to_dict()
    config.pop("rope_parameters", None)
    config["rope_theta"] = 10000.0
    config["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 16}
    with pytest.raises(models.UnsupportedConfigError, match="'low_freq_factor', 'high_freq_factor'"):
        models.from_config(config)


def test_errors_share_one_base_class():
    for cls in (models.ModelPathError, models.UnknownArchitectureError, models.UnsupportedConfigError,
                models.MissingWeightError, models.UnexpectedWeightError, models.WeightShapeError):
        assert issubclass(cls, models.ModelLoadError)


def test_unsupported_rope_type_is_refused():
    config = transformers.LlamaConfig(**TINY, rope_parameters=dict(rope_type="yarn", factor=2.0,
                                                                   rope_theta=10000.0))
    with pytest.raises(models.UnsupportedConfigError, match="yarn"):
        models.from_config(config)


def test_bidirectional_gemma_is_refused():
    config = transformers.Gemma3TextConfig(**TINY, head_dim=8, use_bidirectional_attention=True)
    with pytest.raises(models.UnsupportedConfigError, match="use_bidirectional_attention"):
        models.from_config(config)


# ----------------------------------------------------------------------------- formats

def test_sharded_checkpoint_loads_like_single_file(llama_dir, tmp_path):
    hf = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    ids = torch.randint(0, 96, (7,))
    torch.testing.assert_close(_logits(models.from_pretrained(tmp_path), ids),
                               _logits(models.from_pretrained(llama_dir), ids), atol=0, rtol=0)


def _as_transformers4(config: dict) -> None:
    """Rewrite a 5.x config.json the way transformers 4.x wrote it."""
    params = config.pop("rope_parameters")
    config["torch_dtype"] = config.pop("dtype", "float32")
    if "full_attention" in params:  # Gemma 3
        full, local = dict(params["full_attention"]), params["sliding_attention"]
        config["rope_theta"] = full.pop("rope_theta")
        config["rope_local_base_freq"] = local["rope_theta"]
        config["rope_scaling"] = None if full.get("rope_type") == "default" else full
        pattern = config.pop("layer_types").index("full_attention") + 1
        config["sliding_window_pattern"] = pattern
    else:
        params = dict(params)
        config["rope_theta"] = params.pop("rope_theta")
        config["rope_scaling"] = None if params.get("rope_type") == "default" else {
            "type" if params["rope_type"] == "llama3" else "rope_type": params.pop("rope_type"), **params}


@pytest.mark.parametrize("arch", ["llama3_scaled", "gemma3_linear"])
def test_transformers4_config_format_gives_same_logits_as_transformers(arch, tmp_path):
    if arch == "llama3_scaled":
        config = transformers.LlamaConfig(**TINY, rope_parameters=dict(
            rope_type="llama3", rope_theta=50000.0, factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=8), eos_token_id=[2, 5])
    else:
        config = transformers.Gemma3TextConfig(
            **{**TINY, "num_hidden_layers": 3}, head_dim=8, sliding_window=3, sliding_window_pattern=3,
            rope_parameters={"full_attention": dict(rope_type="linear", factor=2.0, rope_theta=30000.0),
                             "sliding_attention": dict(rope_type="default", rope_theta=500.0)})
    hf = _save_hf(config, tmp_path / "v5")
    path = _copy_with(tmp_path / "v5", tmp_path / "v4", edit_config=_as_transformers4)
    assert "rope_parameters" not in json.loads((path / "config.json").read_text())
    ours = models.from_pretrained(path)
    ids = torch.randint(0, 96, (20,))
    with torch.no_grad():
        expected = hf(ids[None]).logits[0]
    torch.testing.assert_close(_logits(ours, ids), expected, atol=1e-4, rtol=0)
    assert ours.config == models.from_pretrained(tmp_path / "v5").config
    if arch == "llama3_scaled":
        assert ours.config.eos_token_ids == (2, 5)


def test_from_config_accepts_config_json_dict_and_object():
    config = transformers.Qwen3Config(**TINY, head_dim=16, eos_token_id=7)
    from_dict = models.from_config(config.to_dict())
    from_object = models.from_config(config)
    assert from_dict.config == from_object.config
    assert from_object.config.architecture == "Qwen3ForCausalLM"
    assert from_object.config.eos_token_ids == (7,)
    assert from_object.config.head_dim == 16


def test_two_instances_get_distinct_attention_layer_names():
    config = transformers.LlamaConfig(**TINY)
    a, b = models.from_config(config), models.from_config(config)
    assert len(a.attention_layer_names) == len(b.attention_layer_names) == 2
    assert not set(a.attention_layer_names) & set(b.attention_layer_names)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_half_precision_matches_transformers_in_same_dtype(arch, dtype, tmp_path):
    """Weights are cast on load, activations stay in that dtype, and the logits are those of
    transformers run in the same dtype up to rounding."""
    if arch == "llama":
        config = transformers.LlamaConfig(**TINY)
    else:
        config = transformers.Gemma3TextConfig(**TINY, head_dim=8, sliding_window=3, sliding_window_pattern=2)
    _save_hf(config, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=dtype, attn_implementation="eager")
    ours = models.from_pretrained(tmp_path, dtype=dtype)
    assert ours.config.dtype == dtype
    assert all(p.dtype == dtype for p in ours.parameters())
    ids = torch.randint(0, 96, (12,))
    with torch.no_grad():
        expected = hf(ids[None]).logits[0].float()
    got = _logits(ours, ids)
    assert got.dtype == dtype
    # The two round at the same places except inside attention (the reference op accumulates in
    # float32, transformers' eager path rounds scores and probabilities to the dtype).
    torch.testing.assert_close(got.float(), expected, atol=TOL[dtype], rtol=0)


def test_eos_ids_are_the_union_of_config_and_generation_config(llama_dir, tmp_path):
    """An instruct checkpoint lists its end-of-turn token only in generation_config.json."""
    config = json.loads((llama_dir / "config.json").read_text())
    config_eos = config.get("eos_token_id") or 2
    config_eos = config_eos if isinstance(config_eos, list) else [config_eos]
    path = _copy_with(llama_dir, tmp_path / "instruct")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [config_eos[0], 7, 9]}))
    assert models.from_pretrained(path).config.eos_token_ids == (*config_eos, 7, 9)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": "seven"}))
    with pytest.raises(models.ModelPathError, match="generation_config.json"):
        models.from_pretrained(path)
