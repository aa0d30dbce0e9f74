"""The knockout suite (bench/knockout.py): every kernel kind it leaves out names a kernel that exists,
and leaving one out replaces exactly that kernel by a launcher that launches nothing."""
from __future__ import annotations

import importlib

import pytest
import torch

from bench import knockout


@pytest.mark.parametrize("kind", sorted(knockout.KINDS))
def test_every_kind_names_a_triton_kernel_of_ours(kind):
    module, name = knockout.KINDS[kind]
    kernel = getattr(importlib.import_module(module), name)
    assert callable(getattr(kernel, "__getitem__", None)), f"{module}.{name} is not a Triton kernel"


def test_knocking_out_replaces_only_the_named_kinds(monkeypatch):
    modules = {kind: importlib.import_module(module) for kind, (module, _) in knockout.KINDS.items()}
    for kind, (_, name) in knockout.KINDS.items():  # restored after the test
        monkeypatch.setattr(modules[kind], name, getattr(modules[kind], name))
    before = {kind: getattr(modules[kind], name) for kind, (_, name) in knockout.KINDS.items()}
    knockout.knock_out(knockout.variant_kinds("norm+attention"))
    for kind, (_, name) in knockout.KINDS.items():
        now = getattr(modules[kind], name)
        if kind in ("norm", "attention"):
            assert isinstance(now, knockout._LaunchNothing)
            assert now[(1, 2, 3)](torch.zeros(1), 1, BLOCK=16) is None
        else:
            assert now is before[kind]


def test_variants_are_known_kinds_and_a_bad_kind_is_named():
    for variant in knockout.VARIANTS:
        assert set(knockout.variant_kinds(variant)) <= set(knockout.KINDS)
    with pytest.raises(ValueError, match="'softmax'"):
        knockout.knock_out(["softmax"])
