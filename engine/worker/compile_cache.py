"""Where compiled artifacts persist across processes, and how to clear them.

Directory: `compile/` under the project's one cache root (`models.cache_root()`: `$INFER_GRAPHS_CACHE`,
else `$XDG_CACHE_HOME/infer_graphs`, else `~/.cache/infer_graphs`); the deprecated
`$INFER_GRAPHS_CACHE_DIR` still names the compile directory itself, with a warning. Inductor's FX-graph / AOTAutograd caches go to `<dir>/inductor`
(TORCHINDUCTOR_CACHE_DIR) and Triton's kernel binaries to `<dir>/triton` (TRITON_CACHE_DIR), each only
if the user has not set that variable. Torch's own default puts Inductor's cache under /tmp, which a
reboot or a fresh container empties: here a second start-up finds its kernels.

The engine's own graph store, `<dir>/graphs` (engine/worker/warm_start.py: the compiled graph of a
model and configuration, loaded by a warm start without Dynamo or Inductor), has its own key; the
sampler's argmax choices are `<dir>/argmax.json`.

Staleness of Inductor's and Triton's caches: nothing here keys them; the keys are their own, and they
already cover what can change. Inductor's FX-graph key (torch/_inductor/codecache.py, FxGraphHashDetails)
hashes the graph's code and every input's shape, dtype and stride (so a changed model config is a
different key: its sizes are constants of the traced graph; weights are inputs, not constants), the
hash of torch's own source files (`torch_key`), the Triton, CUDA/HIP versions and the device, and
the Inductor config. Triton's key hashes the kernel source, its specialization, the Triton version
and the target GPU. A stale artifact is never reused.

One more thing must hold for Triton's key to repeat across processes: the ptxas it compiles with
(the key hashes ptxas's version). Inductor points TRITON_PTXAS_PATH at torch's own ptxas, for the
whole process, when it loads a kernel in-process, which it does only when its compile workers are
not ready yet: a race that worker start-up speed decides. Our own kernels compiled after it got one
key, in a process that won the race the other key, and a warm start recompiled all of them (on an
H100, gemma-3-1b's prefill kernels alone: 12-18 s). `configure_compile_cache` sets the variable as
Inductor would, once, before anything compiles, unless the user set it.

Clear it with `python -m engine.worker.compile_cache --clear` (or delete the directory).
"""
from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

from models.paths import cache_root, deprecated_compile_cache_dir

PTXAS_ENV = "TRITON_PTXAS_PATH"


def compile_cache_dir() -> Path:
    return deprecated_compile_cache_dir() or cache_root() / "compile"


def configure_compile_cache() -> dict[str, str]:
    """Point Inductor and Triton at the cache directory unless the user chose their own; the
    directories in effect, and the ptxas Triton compiles with when one is pinned (see the module's
    docstring). Call before the first compile (Inductor reads its variable once)."""
    root = compile_cache_dir()
    chosen = {}
    for env, sub in (("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("TRITON_CACHE_DIR", "triton")):
        if not os.environ.get(env):
            os.environ[env] = str(root / sub)
        chosen[env] = os.environ[env]
    ptxas = pin_ptxas()
    if ptxas is not None:
        chosen[PTXAS_ENV] = ptxas
    return chosen


def pin_ptxas(torch_dir: Path | None = None) -> str | None:
    """TRITON_PTXAS_PATH as Inductor sets it in-process (torch's bundled `bin/ptxas`, when it is an
    executable file), unless the user set it; the path in effect, or None where there is none."""
    if os.environ.get(PTXAS_ENV):
        return os.environ[PTXAS_ENV]
    if torch_dir is None:
        import torch
        torch_dir = Path(torch.__file__).parent
    ptxas = torch_dir / "bin" / "ptxas"
    if ptxas.is_file() and os.access(ptxas, os.X_OK):
        os.environ[PTXAS_ENV] = str(ptxas)
        return str(ptxas)
    return None


def clear_compile_cache() -> Path:
    """Delete this project's cache directory (never a directory the user set through TORCHINDUCTOR_CACHE_DIR
    or TRITON_CACHE_DIR). Takes effect for the next process: one running keeps what it loaded."""
    root = compile_cache_dir()
    shutil.rmtree(root, ignore_errors=True)
    return root


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m engine.worker.compile_cache", description=__doc__.split("\n")[0])
    parser.add_argument("--clear", action="store_true", help="delete the compile cache directory")
    args = parser.parse_args(argv)
    if args.clear:
        print(f"removed {clear_compile_cache()}")
    else:
        print(compile_cache_dir())


if __name__ == "__main__":
    main()
