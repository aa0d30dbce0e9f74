"""ServerProcess: a server a benchmark starts, on 127.0.0.1 and a free port, and stops with a drain."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import REPO_ROOT, repo_env

READY_TIMEOUT_S = 1800.0  # a GPU server compiles and captures before it is ready
_READY = re.compile(r"ready: .* at (http://[\d.]+:\d+)/v1")


class ServerProcess:
    """The server `model` names: a model directory or .gguf file -> `python -m engine serve`; a
    benchmark config -> `python -m bench.serving --serve` (its random weights). `flags`: more of serve's
    options; `env`: its environment (default this one; the repository goes first on PYTHONPATH either
    way). Started, its log read every `poll_s` until the ready line (`url`; `ready_s`: seconds from the
    start to that line, to within poll_s); a server that exits or outlasts `timeout_s` first raises,
    with its log's tail. `stop` sends SIGTERM (a drain) and says how it ended."""

    def __init__(self, model: str, flags: list[str], env: dict | None = None, poll_s: float = 0.2,
                 timeout_s: float = READY_TIMEOUT_S) -> None:
        self.log = Path(tempfile.mkstemp(prefix="bench-server-", suffix=".log")[1])
        if os.path.isdir(model) or model.endswith(".gguf"):
            cmd = ["-m", "engine", "serve", "--model", model]
        else:
            cmd = ["-m", "bench.serving", "--serve", "--model", model]
        start = time.monotonic()
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([sys.executable, *cmd, "--port", "0", *flags], stdout=log,
                                         stderr=subprocess.STDOUT, env=repo_env(env), cwd=REPO_ROOT)
        while not (match := _READY.search(self.log.read_text())):
            if self.proc.poll() is not None or time.monotonic() - start > timeout_s:
                self.stop()
                raise RuntimeError(f"the server did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(poll_s)
        self.ready_s = time.monotonic() - start
        self.url = match.group(1)

    def stop(self) -> dict[str, Any]:
        """SIGTERM, then a kill where the drain outlasts two minutes: its exit status, whether it logged
        "server stopped", and its log's path."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return {"exit_status": self.proc.returncode, "stopped_line": "server stopped" in self.log.read_text(),
                "log": str(self.log)}
