"""Inductor's kernel-shape heuristics as this backend wants them, in effect only while it compiles.

Persistent reductions. Inductor keeps a whole row of an inner reduction in registers (a "persistent"
kernel: one pass, and the pointwise work before and after it fused in) only up to 1,024 elements; a
longer row gets a looped reduction, and the scheduler then leaves the normalize-and-scale after it to a
second kernel. A decoder layer's RMSNorms reduce over the hidden size (1,152 to 4,096 in the models
here), so at decode each norm was two kernels, and the residual add before it a third: on an H100, in
one captured llama-3.2-3b layer, `red_fused_add_mean_pow`, `poi_fused_add_mean_mul_rsqrt` and
`poi_fused_add` around every pair of matmuls, each a launch and a drain between two GEMVs. A row of
8,192 fp32 values is 32 registers per thread of a 256-thread block, so up to `persistent_limit`
elements per row the reduction is persistent.

The choice is not in Inductor's FX-graph cache key on every torch this supports (torch 2.11 hashes
its config, not its heuristics object), so `keyed_by` puts it there through the config: a post-grad
custom pass that changes nothing and whose uuid names the limit, chained to a user's own pass.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch


def _choices_class() -> type:
    from torch._inductor.choices import InductorChoices
    from torch._inductor.runtime.hints import ReductionHint
    from torch._inductor.virtualized import V

    class PersistentRowChoices(InductorChoices):
        limit = 0

        @classmethod
        def should_use_persistent_reduction(cls, features: Any, cooperative_reduction: bool) -> bool:
            if InductorChoices.should_use_persistent_reduction(features, cooperative_reduction):
                return True
            if cooperative_reduction or features.get_reduction_hint() != ReductionHint.INNER:
                return False
            return V.graph.sizevars.statically_known_leq(features.reduction_numel, cls.limit)

    return PersistentRowChoices


def _key_pass(limit: int, chained: Any) -> Any:
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class HeuristicsKey(CustomGraphPass):
        """Changes nothing; its uuid puts the heuristics into Inductor's cache key."""

        def __call__(self, graph: torch.fx.Graph) -> None:
            if chained is not None:
                chained(graph)

        def uuid(self) -> str:
            own = f"infer_graphs.persistent_limit={limit}"
            return own if chained is None else f"{own}|{chained.uuid()}"

    return HeuristicsKey()


@contextlib.contextmanager
def persistent_reductions(limit: int) -> Iterator[None]:
    """Inside the block Inductor makes inner reductions of up to `limit` elements per row persistent
    (0: Inductor's own rule, nothing changed)."""
    if limit <= 0:
        yield
        return
    from torch._inductor import config as inductor_config
    from torch._inductor.custom_graph_pass import CustomGraphPass
    from torch._inductor.virtualized import V

    user_pass = inductor_config.post_grad_custom_post_pass
    if user_pass is not None and not isinstance(user_pass, CustomGraphPass):
        yield  # a pass with no uuid already keeps Inductor's cache off; leave it alone
        return
    choices = _choices_class()
    choices.limit = limit
    with inductor_config.patch({"post_grad_custom_post_pass": _key_pass(limit, user_pass)}), \
            V.set_choices_handler(choices()):
        yield
