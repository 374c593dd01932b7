"""Projections as the lean forwards (`raypai.alignment._lean`) apply them: one weight, or several
stored apart applied as one matrix product, with LoRA adapters (peft) either merged into the
weight (decoding) or applied as their own low-rank products beside the frozen base (training)."""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F


def _w(module) -> torch.Tensor:
    """A projection's weight as applied: LoRA adapters (peft) merged in (`raypai.alignment.lora`)."""
    if "peft" in sys.modules:
        from raypai.alignment.lora import merged_weight

        return merged_weight(module)
    return module.weight


def _lora_unready(model) -> list[str]:
    """LoRA layers the lean paths cannot apply as one merged weight (`raypai.alignment.lora.lean_ready`)."""
    if "peft" not in sys.modules:
        return []
    from raypai.alignment.lora import is_lora, lean_ready

    return [n for n, m in model.named_modules() if is_lora(m) and not lean_ready(m)]


def _adapter(module):
    """(A (r, in), B (out, r), scale) of a LoRA layer whose adapter is on, else None (one active
    adapter: what raypai's trainer attaches)."""
    if "peft" not in sys.modules:
        return None
    from raypai.alignment.lora import is_lora

    if not is_lora(module) or module.disable_adapters or module.merged:
        return None
    (name,) = [n for n in module.active_adapters if n in module.lora_A]
    return module.lora_A[name].weight, module.lora_B[name].weight, module.scaling[name]


def _base(module) -> torch.Tensor:
    """A projection's own (out, in) weight: a LoRA layer's frozen base."""
    return module.get_base_layer().weight if hasattr(module, "get_base_layer") else module.weight


class _Proj:
    """One projection, or several stored apart and applied as one (q/k/v, gate/up): y = x Wᵀ + b,
    the parts' weights concatenated (under autograd the concatenation's backward hands each its
    slice of the gradient). For LoRA layers with their adapter on, the adapted parts add
    s · (x Aᵀ) Bᵀ to their slices of the output (Hu et al. 2021, eq. 3), all parts in two matrix
    products (their A stacked, their B block-diagonal): the frozen base weight gets no gradient of
    its own and the adapters cost r, not the weight's size, in few kernels. `merged=True` (decoding,
    no autograd) folds the adapters into the weight once instead."""

    def __init__(self, *modules, merged: bool = False):
        weights = [_w(m) if merged else _base(m) for m in modules]
        self.weight = weights[0] if len(weights) == 1 else torch.cat(weights)
        biases = [m.bias for m in modules]
        self.bias = biases[0] if len(biases) == 1 or biases[0] is None else torch.cat(biases)
        self.lora = None
        adapters = [None if merged else _adapter(m) for m in modules]
        if any(a is not None for a in adapters):
            # a part without an adapter takes a zero block: (0 rows of A, out × 0 of B)
            a = [ad[0] if ad else w.new_zeros((0, w.shape[1])) for ad, w in zip(adapters, weights)]
            b = [ad[1] * ad[2] if ad else w.new_zeros((w.shape[0], 0)) for ad, w in zip(adapters, weights)]
            self.lora = (a[0], b[0]) if len(a) == 1 else (torch.cat(a), torch.block_diag(*b))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        if self.lora is None:
            return y
        return y + F.linear(F.linear(x, self.lora[0]), self.lora[1])
