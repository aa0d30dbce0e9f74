"""`infer_op`: how this package registers its torch ops (torch.ops.infer.*), at a third of the
dispatcher cost of `torch.library.custom_op`.

Compiled pieces call each op through the dispatcher on every step that runs without a graph (past the
largest bucket, or cudagraph_mode NONE): ~8 ops a layer. `torch.library.custom_op` wraps its kernel in
Python that runs on every call (an aliasing check of the outputs, the autograd and in-place wrappers):
on the 2-core CPU machine a call with nothing to do costs 3.8 us (an op mutating an argument) or 4.8 us
(one returning a tensor), against 1.2 / 2.0 us for the same op defined on a `torch.library.Library`
with a CompositeExplicitAutograd kernel (tests/test_op_registry.py times both), and 0.05 us for a plain
Python call. The schema is inferred from the annotations exactly as `custom_op` infers it, the fake
implementation is registered the same way, and Dynamo / Inductor see the same OpOverload.

Differences from `custom_op` a caller can see: outputs are not checked for aliasing their inputs (the
ops here allocate theirs), and on tensors that require grad the op runs with autograd's "not
implemented" fallback, whose outputs only fail at backward (these ops are for inference).
"""
from __future__ import annotations

from typing import Any, Callable

import torch

NAMESPACE = "infer"
_LIBRARY = torch.library.Library(NAMESPACE, "FRAGMENT")


class InferOp:
    """torch.ops.infer.<name>, callable, with `register_fake` as `custom_op`'s object has it."""

    def __init__(self, name: str, fn: Callable[..., Any]) -> None:
        self.name = name
        self.qualname = f"{NAMESPACE}::{name}"
        self._fn = fn
        self.__doc__ = fn.__doc__

    @property
    def op(self) -> Any:
        return getattr(getattr(torch.ops, NAMESPACE), self.name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.op(*args, **kwargs)

    def register_fake(self, fake: Callable[..., Any]) -> Callable[..., Any]:
        torch.library.register_fake(self.qualname, fake, lib=_LIBRARY)
        return fake


def infer_op(name: str, mutates_args: tuple[str, ...] = ()) -> Callable[[Callable[..., Any]], InferOp]:
    """Decorator: `fn` becomes torch.ops.infer.<name>, its schema inferred from its annotations
    (`mutates_args` names the arguments written in place, as for `custom_op`)."""

    def register(fn: Callable[..., Any]) -> InferOp:
        schema = torch.library.infer_schema(fn, mutates_args=mutates_args)
        _LIBRARY.define(name + schema)
        _LIBRARY.impl(name, fn, "CompositeExplicitAutograd")
        return InferOp(name, fn)

    return register
