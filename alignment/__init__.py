"""raypai.alignment: SFT, reward model, DPO, online DPO, GRPO and PPO with the model roles
(policy trainer, rollout, reference, reward, critic) as Ray actors; the maths in `losses/`.

The names below load on first use (PEP 562): importing the package does not import torch."""

from __future__ import annotations

import importlib

_EXPORTS = {
    **dict.fromkeys(
        ("SFTConfig", "RewardModelConfig", "DPOConfig", "GRPOConfig", "PPOConfig"), "raypai.alignment.config"
    ),
    "run_sft": "raypai.alignment.sft",
    "train_reward_model": "raypai.alignment.reward_model",
    "run_dpo": "raypai.alignment.dpo",
    "run_grpo": "raypai.alignment.grpo",
    "run_ppo": "raypai.alignment.ppo",
    "run_online_dpo": "raypai.alignment.online_dpo",
    "ALGORITHMS": "raypai.alignment.algorithms",
    "Trainer": "raypai.alignment.roles.trainer",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'raypai.alignment' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
