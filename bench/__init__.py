"""Benchmarks: measured medians next to their physical floor and next to the peers, same process."""
from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def repo_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """This environment (or `env`) with the repository first on PYTHONPATH: a child process (a server,
    a probe) imports this tree's packages, installed or not."""
    env = os.environ if env is None else env
    return {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))}
