"""Role actors: thin shells that build a model/engine and call pure functions. `Trainer` is every
trained model (policy, critic, reward model), updated with an objective from `losses/`.

The names below load on first use (PEP 562): a role's process imports its own module only, so the
Reward actor of plain Python reward functions does not import torch."""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Reference": "reference",
    "Reward": "reward",
    "Rollout": "rollout",
    "Trainer": "trainer",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'raypai.alignment.roles' has no attribute {name!r}")
    return getattr(importlib.import_module(f"raypai.alignment.roles.{_EXPORTS[name]}"), name)
