"""BackendStats: counters of one backend instance, so tests and benchmarks can assert structure."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class BackendStats:
    graphs_compiled: int = 0          # Dynamo graphs received (1 per trace; more means recompiles)
    compile_seconds: float = 0.0      # split + piece compilation, all graphs
    graphs_loaded: int = 0            # graphs read back from saved artifacts (no trace, no compile)
    load_seconds: float = 0.0
    pieces: int = 0                   # all pieces of all graphs
    compute_pieces: int = 0
    splitting_pieces: int = 0
    piece_compilations: int = 0       # Inductor compilations: identical compute pieces share one
    capture_seconds: dict[int, float] = field(default_factory=dict)  # token count -> seconds
    graph_pool_bytes: int = 0         # pool growth caused by this backend's captures
    piece_captures: int = 0
    piece_warm_ups: int = 0           # runs outside a capture before one (compile_backend/piecewise.py)
    piece_replays: int = 0
    replay_steps: int = 0             # PIECEWISE steps served by graphs
    fallback_steps: int = 0           # PIECEWISE steps on CUDA with no graph for their size
    graphless_steps: int = 0          # NONE mode, or PIECEWISE on CPU / with cudagraphs=False
    full_steps: int = 0               # FULL mode: the pieces run through, under the caller's capture

    @property
    def captured_sizes(self) -> list[int]:
        return sorted(self.capture_seconds)
