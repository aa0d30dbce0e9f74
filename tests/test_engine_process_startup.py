"""serve's engine process while it starts: the server's own start-up (imports, its tokenizer) runs while
the child starts, not after it is ready; whatever ends the start-up early (an error on the server's side,
Ctrl-C) stops the child, which ignores SIGINT, instead of leaving the server waiting for it forever."""
from __future__ import annotations

import functools
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from engine.entrypoints.server import build_llm
from engine.entrypoints.server.engine_process import EngineProcess
from tests.test_server import ROOT
from tests.tiny_tokenizer import save_tiny_llama_with_tokenizer

FIELDS = {"device": "cpu", "max_model_len": 64, "max_num_seqs": 2, "show_progress": False}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_llama_with_tokenizer(tmp_path_factory.mktemp("tiny-process-startup"))


def _engine_children() -> list:
    return [p for p in multiprocessing.active_children() if p.name == "engine"]


def _spawned_child(pid: int) -> psutil.Process | None:
    """The engine process (not multiprocessing's resource tracker, which the spawn starts first)."""
    return next((c for c in psutil.Process(pid).children() if "spawn_main" in " ".join(c.cmdline())), None)


def _gone(process: psutil.Process) -> bool:
    try:
        return process.status() == psutil.STATUS_ZOMBIE  # exited, not yet reaped by its new parent
    except psutil.NoSuchProcess:
        return True


def test_what_the_server_loads_meanwhile_runs_while_the_child_starts(model_dir):
    seen = []
    engine = EngineProcess(functools.partial(build_llm, str(model_dir), FIELDS),
                           meanwhile=lambda: seen.extend(p.is_alive() for p in _engine_children()))
    engine.start()
    try:
        assert seen == [True] and engine.llm.config.max_model_len == 64
    finally:
        engine.stop()


def test_an_error_meanwhile_stops_the_child_and_is_raised(model_dir):
    def fail() -> None:
        raise ImportError("no module named 'uvicorn'")

    with pytest.raises(ImportError, match="uvicorn"):
        EngineProcess(functools.partial(build_llm, str(model_dir), FIELDS), meanwhile=fail)
    assert _engine_children() == []


def test_sigint_while_the_engine_process_starts_stops_it_and_the_server_exits(model_dir, tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1"}
    log = tmp_path / "stderr.txt"
    with open(log, "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "engine", "serve", "--model", str(model_dir), "--port", "0",
                                 "--device", "cpu", "--max-model-len", "64", "--engine-process"],
                                cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        deadline = time.monotonic() + 60
        while not (child := _spawned_child(proc.pid)):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        time.sleep(0.5)  # the server is past the spawn; the child's interpreter and imports take seconds more
        assert "ready: serving" not in log.read_text()
        proc.send_signal(signal.SIGINT)  # the server only, as `kill -INT`; a Ctrl-C would reach both
        status = proc.wait(60)  # the child finishes starting, reads the stop, closes its engine
        assert status != 0 and _gone(child)
        assert "interrupted: stopping the engine process" in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_child_whose_server_is_gone_before_ready_closes_its_engine_and_exits_without_a_traceback(model_dir):
    """SIGTERM before `ready` ends the server at once; its child finds the pipe closed when it reports
    ready, and ends cleanly (exit 0) instead of dying on a BrokenPipeError."""
    import logging
    from engine.entrypoints.server.engine_process import _child_main
    ctx = multiprocessing.get_context("spawn")
    commands_r, commands_w = ctx.Pipe(duplex=False)
    outputs_r, outputs_w = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child_main, name="engine", args=(
        functools.partial(build_llm, str(model_dir), FIELDS), commands_r, outputs_w, (logging.INFO, None)))
    child.start()
    commands_r.close()
    outputs_w.close()
    outputs_r.close()  # the server is gone
    child.join(120)
    assert child.exitcode == 0
