"""Every public function of raypai.alignment.losses keeps its inputs' device and dtype, in every
output tensor and every variant (each DPO loss type, each GRPO aggregation).

A tensor a pure function allocates on the default device and dtype (the CPU, float32) breaks on a
GPU or silently changes precision. The `meta` device stands in for a GPU (mixing a CPU tensor into
a meta computation raises), float64 for a non-default dtype. The case table must name every
function in `losses.__all__`: a new loss without a case fails `test_every_function_has_a_case`.
(tests/alignment/test_losses.py checks the values; this file checks placement only.)
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

from raypai.alignment import losses as L

B, T = 4, 5


def _cases(t, mask):
    """name -> [(variant, thunk)]: each public function called on tensors from `t(*shape)`."""
    lp, old, ref, values = t(B, T), t(B, T), t(B, T), t(B, T)
    cr = lambda: L.ChosenRejected(t(B), t(B))  # noqa: E731
    return {
        "dpo_loss": [
            (
                kind,
                lambda kind=kind: L.dpo_loss(
                    cr(),
                    cr(),
                    beta=0.1,
                    loss_type=kind,
                    label_smoothing=0.1,
                    lengths=L.ChosenRejected(t(B).abs() + 1, t(B).abs() + 1),
                ),
            )
            for kind in L.DPO_LOSSES
        ],
        "bradley_terry_loss": [
            ("margin float", lambda: L.bradley_terry_loss(t(B), t(B), margin=0.5)),
            ("margin tensor", lambda: L.bradley_terry_loss(t(B), t(B), margin=t(B))),
        ],
        "grpo_advantages": [
            ("scaled", lambda: L.grpo_advantages(t(B), 2)),
            ("unscaled", lambda: L.grpo_advantages(t(B), 2, scale=False)),
        ],
        "k3_kl": [("", lambda: L.k3_kl(lp, ref))],
        "aggregate": [
            (mode, lambda mode=mode: L.aggregate(lp, mask, mode, max_new_tokens=T)) for mode in L.AGGREGATIONS
        ],
        "grpo_loss": [
            (
                f"{mode} ref={r is not None}",
                lambda mode=mode, r=r: L.grpo_loss(
                    lp,
                    old,
                    r,
                    t(B),
                    mask,
                    clip_eps=0.2,
                    clip_eps_high=0.28,
                    beta=0.04,
                    aggregation=mode,
                    max_new_tokens=T,
                ),
            )
            for mode in L.AGGREGATIONS
            for r in (ref, None)
        ],
        "clipped_surrogate": [("", lambda: L.clipped_surrogate(lp, old, t(B, T), clip_eps=0.2))],
        "masked_mean": [("", lambda: L.masked_mean(lp, mask))],
        "masked_whiten": [("", lambda: L.masked_whiten(lp, mask))],
        "kl_penalized_rewards": [("", lambda: L.kl_penalized_rewards(t(B), lp, ref, mask, 0.05))],
        "gae": [("", lambda: L.gae(t(B, T), values, mask, 1.0, 0.95))],
        "clipped_value_loss": [("", lambda: L.clipped_value_loss(values, t(B, T), t(B, T), mask, 0.2))],
        "ppo_targets": [("", lambda: L.ppo_targets(t(B), lp, ref, values, mask, kl_coef=0.05, gamma=1.0, lam=0.95))],
    }


def _functions() -> set[str]:
    return {n for n in L.__all__ if inspect.isfunction(getattr(L, n))}


def _tensors(out):
    """Every tensor inside an output: tuples, lists, dicts and dataclasses (DPOOutput) opened up."""
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, tuple | list):
        for x in out:
            yield from _tensors(x)
    elif isinstance(out, dict):
        for x in out.values():
            yield from _tensors(x)
    elif dataclasses.is_dataclass(out):
        for f in dataclasses.fields(out):
            yield from _tensors(getattr(out, f.name))


def test_every_function_has_a_case():
    cases = _cases(lambda *s: torch.zeros(*s), torch.ones(B, T))
    assert set(cases) == _functions()


@pytest.mark.parametrize("device, dtype", [("meta", torch.float32), ("meta", torch.float64), ("cpu", torch.float64)])
def test_losses_and_advantages_stay_on_the_inputs_device_and_dtype(device, dtype):
    gen = torch.Generator().manual_seed(0)
    t = lambda *shape: torch.randn(*shape, dtype=dtype, generator=gen).to(device)  # noqa: E731
    mask = torch.ones(B, T, dtype=dtype).to(device)
    wrong = []
    for name, variants in _cases(t, mask).items():
        for variant, call in variants:
            tensors = list(_tensors(call()))
            assert tensors, f"{name} {variant} returned no tensor"
            # floating outputs keep the inputs' dtype; masks (bool) only need the device
            wrong += [
                f"{name} {variant}: output {i} on {x.device.type}/{x.dtype}"
                for i, x in enumerate(tensors)
                if x.device.type != device or (x.is_floating_point() and x.dtype != dtype)
            ]
    assert not wrong, "\n".join(wrong)
