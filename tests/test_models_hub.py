"""Hub ids ("org/name") resolve through huggingface_hub's cache, with no network call when the files
are there. The cache is written by huggingface_hub itself: `hf_hub_download` from a hub endpoint
served on 127.0.0.1 by this file (the two requests a download makes: HEAD for the commit and the
ETag, GET for the bytes), so it holds what a real download leaves (refs/<branch or tag>, blobs/,
snapshots/<commit>/ of symlinks). Nothing here reaches the network: every test runs with socket
connections refused (the fixture's downloads happen before)."""
from __future__ import annotations

import hashlib
import http.server
import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import transformers
import huggingface_hub
from huggingface_hub import constants
from huggingface_hub.file_download import repo_folder_name

import models
from engine import LLM, SamplingParams

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
REPO = "tiny-org/tiny-llama"
MAIN, V2 = "a" * 40, "b" * 40  # commit hashes, as refs/ files hold them


def _refuse(*args, **kwargs):
    raise AssertionError("a network connection was attempted")


def _loopback_only(connect, address_at: int = 0):
    def guarded(*args, **kwargs):
        host = args[address_at][0]
        if host not in ("127.0.0.1", "localhost"):
            raise AssertionError(f"a connection to {host} was attempted")
        return connect(*args, **kwargs)
    return guarded


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    monkeypatch.setattr(socket.socket, "connect", _refuse)
    monkeypatch.setattr(socket, "create_connection", _refuse)


class LocalHub:
    """A hub endpoint on 127.0.0.1 serving files by repo and commit: enough of the hub's HTTP interface
    for `huggingface_hub.hf_hub_download` (`HEAD|GET /<repo>/resolve/<revision>/<file>`; X-Repo-Commit
    and ETag headers). Anything else (the API routes) is a 404."""

    def __init__(self) -> None:
        self.files: dict[tuple[str, str], dict[str, bytes]] = {}  # (repo, commit) -> file -> bytes
        self.refs: dict[tuple[str, str], str] = {}                 # (repo, branch or tag) -> commit
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_HEAD(self) -> None:
                self._reply(with_body=False)

            def do_GET(self) -> None:
                self._reply(with_body=True)

            def _reply(self, with_body: bool) -> None:
                parts = self.path.split("?")[0].strip("/").split("/")
                data = commit = None
                if len(parts) >= 5 and parts[2] == "resolve":
                    repo = "/".join(parts[:2])
                    commit = hub.refs.get((repo, parts[3]), parts[3])
                    data = hub.files.get((repo, commit), {}).get("/".join(parts[4:]))
                if data is None:
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("X-Repo-Commit", commit)
                self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if with_body:
                    self.wfile.write(data)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def publish(self, repo: str, commit: str, folder: Path, refs: tuple[str, ...] = ()) -> None:
        self.files[(repo, commit)] = {p.relative_to(folder).as_posix(): p.read_bytes()
                                      for p in folder.rglob("*") if p.is_file()}
        for ref in refs:
            self.refs[(repo, ref)] = commit

    def download(self, repo: str, revision: str, cache: Path, files: tuple[str, ...] | None = None) -> None:
        """What a user's first use does: huggingface_hub fetches each file into `cache`."""
        commit = self.refs.get((repo, revision), revision)
        with pytest.MonkeyPatch.context() as patch:
            # only this hub is reached (huggingface_hub's side requests to its own ENDPOINT, such as
            # its agent registry, fail here, and it carries on without them)
            patch.setattr(socket, "create_connection", _loopback_only(socket.create_connection))
            patch.setattr(socket.socket, "connect", _loopback_only(socket.socket.connect, address_at=1))
            for name in files or sorted(self.files[(repo, commit)]):
                huggingface_hub.hf_hub_download(repo, name, revision=revision, cache_dir=cache,
                                                endpoint=self.endpoint)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def local_hub():
    hub = LocalHub()
    yield hub
    hub.close()


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory, local_hub) -> Path:
    """A hub cache holding REPO at two commits, as huggingface_hub downloaded them: main -> MAIN (seed
    0), the tag v2 -> V2 (seed 1)."""
    cache = tmp_path_factory.mktemp("hub")
    for ref, commit, seed in (("main", MAIN, 0), ("v2", V2, 1)):
        torch.manual_seed(seed)
        folder = tmp_path_factory.mktemp(f"upload-{ref}")
        transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).save_pretrained(folder)
        local_hub.publish(REPO, commit, folder, refs=(ref,))
        local_hub.download(REPO, ref, cache)
    repo = cache / repo_folder_name(repo_id=REPO, repo_type="model")
    assert (repo / "refs" / "v2").read_text() == V2 and (repo / "snapshots" / MAIN / "config.json").is_symlink()
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


@pytest.fixture(scope="module")
def config_only_cache(tmp_path_factory, local_hub, hub_cache) -> Path:
    """A hub cache where a model's config.json alone was downloaded (what AutoConfig leaves)."""
    cache = tmp_path_factory.mktemp("hub-config-only")
    local_hub.publish("tiny-org/config-only", MAIN, hub_cache / repo_folder_name(repo_id=REPO, repo_type="model")
                      / "snapshots" / MAIN, refs=("main",))
    local_hub.download("tiny-org/config-only", "main", cache, files=("config.json",))
    return cache


def test_a_snapshot_without_its_weights_is_not_taken_for_a_model(offline_hub, config_only_cache, monkeypatch):
    """AutoConfig leaves a snapshot with config.json only; offline, that is a missing model."""
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(config_only_cache))
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
    shutil.copytree(hub_cache, home / "hub", symlinks=True)  # the snapshots' relative links to blobs/ stay links
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(Path(__file__).parents[1])}
    env.pop("HF_HUB_CACHE", None)
    code = f"import models; print(models.resolve_model_path({REPO!r}))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(home / "hub" / repo_folder_name(repo_id=REPO, repo_type="model")
                                     / "snapshots" / MAIN)
