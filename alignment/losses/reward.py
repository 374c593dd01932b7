"""Reward-model loss (Bradley–Terry; Ouyang et al. 2022 eq. 1, margin as in Llama 2 §3.2.2):
L = −log σ(r_w − r_l − m)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | float = 0.0):
    """chosen, rejected: (B,) scalar rewards. Returns (loss, accuracy)."""
    loss = -F.logsigmoid(chosen - rejected - margin).mean()
    return loss, (chosen > rejected).to(chosen.dtype).mean()  # in the rewards' dtype and device
