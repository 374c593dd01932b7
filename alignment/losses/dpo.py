"""Direct Preference Optimization and its variants.

Inputs are summed log-probabilities of each full response, shape (B,).
  sigmoid (Rafailov et al. 2023, eq. 7):  −log σ(β·h),  h = (π_c − π_r) − (ref_c − ref_r)
  cDPO / label smoothing ε (Mitchell 2023): −(1−ε)·log σ(β·h) − ε·log σ(−β·h)
  IPO (Azar et al. 2023, eq. 17):         (h̄ − 1/(2β))², h̄ from each response's *per-token mean* log-ratio:
      h̄ = (π_c − ref_c)/n_c − (π_r − ref_r)/n_r  (n = response tokens). Summed log-ratios would make the
      target margin 1/(2β) grow harder to meet with length; the averaged form is what the IPO authors'
      experiments used (as TRL's implementation records, having confirmed it with them).
  hinge (SLiC, Zhao et al. 2023):         max(0, 1 − β·h)
Implicit rewards: β·(π − ref) for chosen and rejected.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class ChosenRejected:
    chosen: torch.Tensor  # (B,) summed log-probs of the chosen responses
    rejected: torch.Tensor  # (B,)


@dataclass(frozen=True)
class DPOOutput:
    loss: torch.Tensor  # scalar, mean over the batch
    chosen_rewards: torch.Tensor  # (B,)
    rejected_rewards: torch.Tensor  # (B,)

    @property
    def accuracy(self) -> float:
        return (self.chosen_rewards > self.rejected_rewards).float().mean().item()

    @property
    def margin(self) -> float:
        return (self.chosen_rewards - self.rejected_rewards).mean().item()


def _sigmoid(h, beta, label_smoothing):
    return -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)


def _ipo(h, beta, label_smoothing):
    return (h - 1 / (2 * beta)) ** 2


def _hinge(h, beta, label_smoothing):
    return torch.relu(1 - beta * h)


DPO_LOSSES = {"sigmoid": _sigmoid, "ipo": _ipo, "hinge": _hinge}


def dpo_loss(
    policy: ChosenRejected,
    ref: ChosenRejected,
    *,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    lengths: ChosenRejected | None = None,
) -> DPOOutput:
    """`lengths`: response token counts (B,) of chosen and rejected; required by IPO."""
    if loss_type not in DPO_LOSSES:
        raise ValueError(f"unknown DPO loss {loss_type!r}; choose one of {', '.join(DPO_LOSSES)}")
    if loss_type == "ipo":
        if lengths is None:
            raise ValueError("the IPO loss needs the response lengths (lengths=ChosenRejected(n_chosen, n_rejected))")
        h = (policy.chosen - ref.chosen) / lengths.chosen - (policy.rejected - ref.rejected) / lengths.rejected
    else:
        h = (policy.chosen - policy.rejected) - (ref.chosen - ref.rejected)
    losses = DPO_LOSSES[loss_type](h, beta, label_smoothing)
    return DPOOutput(
        losses.mean(), beta * (policy.chosen - ref.chosen).detach(), beta * (policy.rejected - ref.rejected).detach()
    )
