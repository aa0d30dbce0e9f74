"""The sampler's argmax over a vocabulary row: torch's one-pass reduction, a chunked one, or one Triton
launch (custom_ops.triton_argmax), whichever the device runs fastest, chosen by timing all three once
per vocabulary size and dtype.

On an H100 (torch 2.11) torch's argmax of one 128,256-wide row (Llama 3's vocabulary) took about
26 us of GPU time: the row is reduced by few blocks. Cut into 256 runs it is one wide reduction and
two tiny ones, half the time. For 151,936 and 262,144 (Qwen3, Gemma 3) torch's own reduction is
already the faster of those two (timed in graph replays), so neither choice fits every vocabulary. The Triton kernel spreads a row over about two
programs per SM and merges the chunks in the same launch, for the launch- and occupancy-bound case
(torch: 8.9 us for one 262,144-wide bf16 row); whether it wins for a vocabulary is what the timing
decides. The timing is of one row, and the kept method serves every batch size. All three give the
same token: the lowest index among equal maxima, and the first NaN where a row has one; a method
whose token differs from torch's on the timed row is not timed. Off CUDA it is always torch's.

The choice is timed once per GPU model, vocabulary, dtype and torch / Triton version, and kept in a
small JSON file (`choices_file`, the compile cache's `argmax.json`): later start-ups read it instead of
timing (a remembered method is still checked against torch's token on the row). Delete the file to
time again.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Callable

import torch


logger = logging.getLogger("engine")

ARGMAX_CHUNKS = 256
_TIMED_CALLS = 20


def chunked_argmax(x: torch.Tensor, chunks: int | None = None) -> torch.Tensor:
    """`x.argmax(dim=-1)` for [N, V] x in two reductions: each row cut into `chunks` equal runs (by
    default the largest power of two up to ARGMAX_CHUNKS dividing V), every run's maximum and its first
    index, then the first run holding the row's maximum. A V with no such divisor of at least 16 gets
    plain argmax."""
    n, vocab = x.shape
    if chunks is None:
        chunks = min(ARGMAX_CHUNKS, vocab & -vocab)
    if chunks < 16 or vocab % chunks:
        return x.argmax(dim=-1)
    width = vocab // chunks
    values, within = x.view(n, chunks, width).max(dim=-1)  # ties: the first index, as argmax
    best = values.argmax(dim=-1, keepdim=True)              # a NaN run wins, as in argmax
    return (best * width + within.gather(-1, best)).squeeze(-1)


def _plain_argmax(x: torch.Tensor) -> torch.Tensor:
    return x.argmax(dim=-1)


def _gpu_us_per_call(fn, x: torch.Tensor) -> float:
    """GPU time of one call: the calls queue behind a sleeping kernel, so the host's launch rate does
    not pace them and the events measure the device alone."""
    for _ in range(3):
        fn(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(x.device)
    torch.cuda._sleep(2_000_000)
    start.record()
    for _ in range(_TIMED_CALLS):
        fn(x)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / _TIMED_CALLS


def _candidates(dtype: torch.dtype) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    from custom_ops.triton_argmax import ROW_ARGMAX_DTYPES, row_argmax  # Triton: imported on CUDA only
    methods = {"torch's": _plain_argmax, "chunked": chunked_argmax}
    if dtype in ROW_ARGMAX_DTYPES:
        methods["triton"] = row_argmax
    return methods


class RowArgmax:
    """argmax(dim=-1) of [N, V] rows by the fastest method for (V, dtype) on this device; `choose` times
    them (on CUDA; elsewhere torch's). Unchosen shapes and CPU tensors use torch's, so nothing here ever
    syncs a step."""

    def __init__(self, choices_file: Path | None = None) -> None:
        """`choices_file`: where the timed choices persist across processes (None: time every time)."""
        self._methods: dict[tuple[int, torch.dtype], Callable[[torch.Tensor], torch.Tensor]] = {}
        self.choices_file = choices_file
        self.timed = 0  # choices timed by this instance (the others came from choices_file)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        method = self._methods.get((x.shape[-1], x.dtype)) if x.is_cuda else None
        return (method or _plain_argmax)(x)

    def choose(self, logits: torch.Tensor) -> bool:
        """Time the methods on one row of `logits` (real values: a warm-up step's) and keep the fastest
        for its vocabulary size and dtype, and for float32 (the sampled path's dtype). True unless
        torch's argmax is kept for `logits`' own."""
        for dtype in dict.fromkeys((logits.dtype, torch.float32)):
            row = logits[:1].to(dtype)
            key = (row.shape[-1], dtype)
            if key in self._methods:
                continue
            fastest = _plain_argmax
            if row.is_cuda:
                methods, expected = _candidates(dtype), row.argmax(dim=-1)
                saved_key = _choice_key(row)
                name = self._saved().get(saved_key)
                if name in methods and torch.equal(methods[name](row), expected):
                    logger.info("sampler: argmax over %d %s logits: %s (as timed before, %s)", key[0],
                                str(dtype).removeprefix("torch."), name, self.choices_file)
                else:
                    with torch.cuda.device(row.device):
                        us = {name: _gpu_us_per_call(fn, row) for name, fn in methods.items()
                              if torch.equal(fn(row), expected)}
                    name = min(us, key=us.get)
                    self.timed += 1
                    logger.info("sampler: argmax over %d %s logits, us per row: %s: %s", key[0],
                                str(dtype).removeprefix("torch."), ", ".join(f"{n} {t:.1f}" for n, t in us.items()), name)
                    self._save(saved_key, name)
                fastest = methods[name]
            self._methods[key] = fastest
        return self._methods[(logits.shape[-1], logits.dtype)] is not _plain_argmax

    def _saved(self) -> dict[str, str]:
        return _read_choices(self.choices_file) if self.choices_file is not None else {}

    def _save(self, key: str, name: str) -> None:
        if self.choices_file is not None:
            _write_choices(self.choices_file, {**_read_choices(self.choices_file), key: name})


def _choice_key(row: torch.Tensor) -> str:
    """What the timing depends on: the GPU, the vocabulary, the dtype, and the code timed."""
    from importlib import metadata
    try:
        triton = metadata.version("triton")
    except metadata.PackageNotFoundError:
        triton = "none"
    props = torch.cuda.get_device_properties(row.device)
    return (f"{props.name} sm_{props.major}{props.minor} | vocab {row.shape[-1]} | {str(row.dtype).removeprefix('torch.')}"
            f" | torch {torch.__version__} | triton {triton}")


def _read_choices(path: Path) -> dict[str, str]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, str)} if isinstance(data, dict) else {}


def _write_choices(path: Path, choices: dict[str, str]) -> None:
    """Atomically (another start-up may read it meanwhile); a cache that cannot be written is skipped."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(choices, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError as exc:
        logger.info("sampler: argmax choice not saved (%s)", exc)

