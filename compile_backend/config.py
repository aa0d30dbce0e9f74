"""BackendConfig: the one validated configuration of the infer_graphs backend, and capture-size helpers.

Validation happens at construction so a typo fails where it was written, naming the field and the
allowed values, instead of surfacing as a silent eager fallback at the first step.
"""
from __future__ import annotations

import bisect
import re
from dataclasses import dataclass, fields
from typing import Sequence

PIECE_COMPILERS = ("inductor", "eager")
DEFAULT_MAX_CAPTURE_SIZE = 512
_OP_NAME = re.compile(r"^[A-Za-z_]\w*::[A-Za-z_]\w*(\.[A-Za-z_]\w*)?$")


def default_capture_sizes(max_capture_size: int = DEFAULT_MAX_CAPTURE_SIZE) -> tuple[int, ...]:
    """THE default token counts to capture, for the backend and the engine (its prefill graph sizes)
    alike: 1, 2, 4..32 by 4, 48..256 by 16, 288..1024 by 32, 1152.. by 128, and always
    `max_capture_size` itself: an off-stride maximum that is not captured silently sends the largest
    steps to eager. Dense where a padded token costs most, coarse where padding is a small fraction;
    few sizes, because every size is a capture at start-up (48 up to 1024)."""
    if isinstance(max_capture_size, bool) or not isinstance(max_capture_size, int) or max_capture_size < 1:
        raise ValueError(f"max_capture_size must be an int >= 1, got {max_capture_size!r}")
    sizes = [1, 2, *range(4, 33, 4), *range(48, 257, 16), *range(288, 1025, 32),
             *range(1152, max_capture_size + 1, 128)]
    kept = {s for s in sizes if s <= max_capture_size}
    kept.add(max_capture_size)
    return tuple(sorted(kept))


@dataclass(frozen=True)
class BackendConfig:
    """How the backend splits, compiles and captures.

    splitting_ops:    ops that end a piece and run eagerly between graphs ("ns::name" or
                      "ns::name.overload"); empty means one piece (the whole graph).
    piece_compiler:   "inductor" (fused kernels) or "eager" (the traced FX pieces as they are).
    capture_sizes:    token counts that get a CUDA graph per piece; None -> default_capture_sizes.
    max_capture_size: largest captured token count; must equal max(capture_sizes) if both are given.
    cudagraphs:       False runs PIECEWISE steps through the compiled pieces without graphs.
    debug_checks:     on every replay, check that each piece input lives at its captured address; and
                      keep Inductor's runtime asserts (sizes, strides, alignment of each piece's inputs
                      and of each custom op's results) in the compiled code, which is otherwise
                      compiled without them (compile_backend/backend.py says why).
    pdl:              Inductor's kernels use programmatic dependent launch on Hopper and newer GPUs
                      (custom_ops/pdl.py says why; INFER_GRAPHS_PDL=0 also turns it off).
    warm_up_every_size: run each piece once outside the capture before every size's capture, not only
                      before its first one and before sizes that can load new Triton code
                      (compile_backend/piecewise.py): for a piece whose first call at a new shape
                      does work a capture cannot hold (an autotuner keyed on the token count).
    """

    splitting_ops: tuple[str, ...] = ("infer::attention",)
    piece_compiler: str = "inductor"
    capture_sizes: tuple[int, ...] | None = None
    max_capture_size: int | None = None
    cudagraphs: bool = True
    debug_checks: bool = False
    pdl: bool = True
    warm_up_every_size: bool = False

    def __post_init__(self) -> None:
        ops = self.splitting_ops
        if isinstance(ops, str) or not isinstance(ops, Sequence):
            raise TypeError(
                "BackendConfig.splitting_ops must be a sequence of op names such as "
                f"('infer::attention',), got {ops!r}")
        for op in ops:
            if not isinstance(op, str) or not _OP_NAME.match(op):
                raise ValueError(
                    f"BackendConfig.splitting_ops: {op!r} is not an op name of the form "
                    "'namespace::name' or 'namespace::name.overload'")
        object.__setattr__(self, "splitting_ops", tuple(dict.fromkeys(ops)))

        if self.piece_compiler not in PIECE_COMPILERS:
            raise ValueError(
                f"BackendConfig.piece_compiler must be one of {PIECE_COMPILERS}, got {self.piece_compiler!r}")
        for name in ("cudagraphs", "debug_checks", "pdl", "warm_up_every_size"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"BackendConfig.{name} must be a bool, got {getattr(self, name)!r}")

        max_size = self.max_capture_size
        if max_size is not None and (isinstance(max_size, bool) or not isinstance(max_size, int) or max_size < 1):
            raise ValueError(f"BackendConfig.max_capture_size must be an int >= 1, got {max_size!r}")
        if self.capture_sizes is None:
            sizes = default_capture_sizes(max_size or DEFAULT_MAX_CAPTURE_SIZE)
        else:
            if isinstance(self.capture_sizes, (str, bytes)) or not isinstance(self.capture_sizes, Sequence):
                raise TypeError(f"BackendConfig.capture_sizes must be a sequence of ints, got {self.capture_sizes!r}")
            bad = [s for s in self.capture_sizes if isinstance(s, bool) or not isinstance(s, int) or s < 1]
            if bad or not self.capture_sizes:
                raise ValueError(
                    f"BackendConfig.capture_sizes must be a non-empty sequence of ints >= 1, got "
                    f"{self.capture_sizes!r}" + (f" (bad: {bad})" if bad else ""))
            sizes = tuple(sorted(set(self.capture_sizes)))
            if max_size is not None and max_size != sizes[-1]:
                raise ValueError(
                    f"BackendConfig.max_capture_size ({max_size}) must equal the largest of capture_sizes "
                    f"({sizes[-1]}): the largest size must always be captured")
        object.__setattr__(self, "capture_sizes", sizes)
        object.__setattr__(self, "max_capture_size", sizes[-1])

    def replace(self, **changes: object) -> BackendConfig:
        """A copy with some fields changed (validated again)."""
        unknown = set(changes) - {f.name for f in fields(self)}
        if unknown:
            raise TypeError(f"BackendConfig has no field(s) {sorted(unknown)}")
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        if "capture_sizes" in changes and "max_capture_size" not in changes:
            values["max_capture_size"] = None
        if "max_capture_size" in changes and "capture_sizes" not in changes:
            values["capture_sizes"] = None
        values.update(changes)
        return BackendConfig(**values)


_DEFAULT_CONFIG = BackendConfig()


def pad_to_capture_size(num_tokens: int, config: BackendConfig | None = None) -> int | None:
    """The smallest capture size >= num_tokens, or None when num_tokens exceeds the largest one
    (such a step runs without graphs: callers pick RuntimeMode.NONE for it)."""
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
    sizes = (config or _DEFAULT_CONFIG).capture_sizes
    i = bisect.bisect_left(sizes, num_tokens)
    return sizes[i] if i < len(sizes) else None
