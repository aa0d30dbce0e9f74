"""sample_verify alone on the CPU: us per call (median of 2000) and the aten ops it dispatches, for B greedy
verify chunks of 1 + 4 tokens over a 4096-token vocabulary. Run from a checkout's root:
PYTHONPATH=. python bench/results/cpu-2026-12-07/verify-sampling/sample_verify_micro.py"""
import collections
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine.params import SamplingParams
from engine.request import Request
from engine.sample.sampler import Sampler
from engine.spec.sampling import VerifyLayout, sample_verify

V, K = 4096, 4


class Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    for batch in (1, 8, 32):
        requests = [Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=8)) for i in range(batch)]
        proposals = [tuple(torch.randint(0, V, (K,)).tolist()) for _ in range(batch)]
        logits = torch.randn(batch * (K + 1), V)
        layout = VerifyLayout(requests, proposals, K + 1, None)
        sampler = Sampler.__new__(Sampler)  # greedy verify chunks never reach the Sampler
        times = []
        for _ in range(2000):
            start = time.perf_counter()
            sample_verify(sampler, logits, layout)
            times.append(time.perf_counter() - start)
        with Count() as count:
            sample_verify(sampler, logits, layout)
        views = sum(n for op, n in count.ops.items() if any(v in op for v in ("view", "slice", "select.int",
                                                                               "unsqueeze", "expand", "alias")))
        print(f"batch {batch}: {statistics.median(times) * 1e6:.1f} us, {sum(count.ops.values())} aten ops "
              f"({views} of them views)")


if __name__ == "__main__":
    main()
