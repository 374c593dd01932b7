"""Losses and advantages as pure functions on tensors (no devices, no configs, no distributed)."""

from raypai.alignment.losses.dpo import DPO_LOSSES, ChosenRejected, DPOOutput, dpo_loss
from raypai.alignment.losses.grpo import AGGREGATIONS, aggregate, grpo_advantages, grpo_loss, k3_kl
from raypai.alignment.losses.ppo import (
    clipped_surrogate,
    clipped_value_loss,
    gae,
    kl_penalized_rewards,
    masked_mean,
    masked_whiten,
    ppo_targets,
)
from raypai.alignment.losses.reward import bradley_terry_loss

__all__ = [
    "dpo_loss",
    "DPO_LOSSES",
    "ChosenRejected",
    "DPOOutput",
    "grpo_advantages",
    "grpo_loss",
    "k3_kl",
    "aggregate",
    "AGGREGATIONS",
    "gae",
    "clipped_value_loss",
    "kl_penalized_rewards",
    "bradley_terry_loss",
    "clipped_surrogate",
    "masked_mean",
    "masked_whiten",
    "ppo_targets",
]
