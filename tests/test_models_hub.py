"""Hub ids ("org/name") resolve through huggingface_hub's cache, with no network call when the files
are there. The cache is laid out as huggingface_hub lays it out (models--org--name/refs/<branch>,
snapshots/<commit>/...; the folder name from huggingface_hub's own function); nothing here reaches
the network: every test runs with socket connections refused."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from huggingface_hub import constants
from huggingface_hub.file_download import repo_folder_name

import models
from engine import LLM, SamplingParams

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
REPO = "tiny-org/tiny-llama"
MAIN, V2 = "a" * 40, "b" * 40  # commit hashes, as refs/ files hold them


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a network connection was attempted")
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory) -> Path:
    """A hub cache holding REPO at two commits: main -> MAIN (seed 0), the tag v2 -> V2 (seed 1)."""
    cache = tmp_path_factory.mktemp("hub")
    repo = cache / repo_folder_name(repo_id=REPO, repo_type="model")
    for ref, commit, seed in (("main", MAIN, 0), ("v2", V2, 1)):
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
        model.save_pretrained(repo / "snapshots" / commit)
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return cache


@pytest.fixture
def offline_hub(hub_cache, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hub_cache


def _snapshot(cache: Path, commit: str) -> str:
    return str(cache / repo_folder_name(repo_id=REPO, repo_type="model") / "snapshots" / commit)


def test_a_cached_hub_id_resolves_to_its_snapshot_and_revision_picks_another(offline_hub):
    assert models.resolve_model_path(REPO) == _snapshot(offline_hub, MAIN)
    assert models.resolve_model_path(REPO, revision="v2") == _snapshot(offline_hub, V2)
    assert models.resolve_model_path(REPO, revision=V2) == _snapshot(offline_hub, V2)


def test_a_cached_hub_id_needs_no_network_even_when_online(hub_cache, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_cache))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    assert models.resolve_model_path(REPO) == _snapshot(hub_cache, MAIN)  # no_network would have raised


def test_from_pretrained_loads_a_hub_id_at_a_revision(offline_hub):
    main = models.from_pretrained(REPO, dtype=torch.float32)
    v2 = models.from_pretrained(REPO, dtype=torch.float32, revision="v2")
    reference = models.from_pretrained(_snapshot(offline_hub, V2), dtype=torch.float32)
    name = "model.embed_tokens.weight"
    assert torch.equal(v2.state_dict()[name], reference.state_dict()[name])
    assert not torch.equal(main.state_dict()[name], v2.state_dict()[name])


def test_llm_takes_a_hub_id_and_keeps_it_as_its_name(offline_hub):
    with LLM(REPO, device="cpu", compile=False, max_model_len=32, max_num_seqs=2, block_size=4) as llm:
        out = llm.generate([[1, 2, 3]], sampling_params=SamplingParams(max_tokens=3, ignore_eos=True))[0]
        assert len(out.token_ids) == 3 and llm.config.model == REPO


def test_a_missing_hub_model_is_one_error_naming_the_id_and_the_cache(offline_hub):
    with pytest.raises(models.ModelPathError, match=r"'tiny-org/absent' is not a local path, and not in the "
                       rf"Hugging Face cache {offline_hub} with HF_HUB_OFFLINE set"):
        models.from_pretrained("tiny-org/absent")
    with pytest.raises(models.ModelPathError, match=r"'tiny-org/tiny-llama' at revision 'v9'"):
        models.resolve_model_path(REPO, revision="v9")


def test_a_snapshot_without_its_weights_is_not_taken_for_a_model(offline_hub, tmp_path, monkeypatch):
    """AutoConfig leaves a snapshot with config.json only; offline, that is a missing model."""
    cache = tmp_path / "hub"
    repo = cache / repo_folder_name(repo_id="tiny-org/config-only", repo_type="model")
    (repo / "snapshots" / MAIN).mkdir(parents=True)
    (repo / "snapshots" / MAIN / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(MAIN)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    with pytest.raises(models.ModelPathError, match="'tiny-org/config-only' is not a local path"):
        models.resolve_model_path("tiny-org/config-only")


def test_a_local_directory_wins_over_a_hub_id_of_the_same_spelling(offline_hub, tmp_path, monkeypatch):
    local = tmp_path / "tiny-org" / "tiny-llama"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).save_pretrained(local)
    monkeypatch.chdir(tmp_path)
    assert models.resolve_model_path(REPO) == REPO  # the relative path, as given
    with pytest.raises(models.ModelPathError, match="revision='v2' is for hub ids"):
        models.resolve_model_path(REPO, revision="v2")


def test_hf_home_and_hf_hub_offline_from_the_environment_are_honoured(hub_cache, tmp_path):
    """A fresh process: huggingface_hub reads HF_HOME when imported (the hub cache is HF_HOME/hub)."""
    home = tmp_path / "hf_home"
    shutil.copytree(hub_cache, home / "hub")  # a copy: huggingface_hub resolves symlinks in the cache path
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(Path(__file__).parents[1])}
    env.pop("HF_HUB_CACHE", None)
    code = f"import models; print(models.resolve_model_path({REPO!r}))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(home / "hub" / repo_folder_name(repo_id=REPO, repo_type="model")
                                     / "snapshots" / MAIN)
