"""raypai.alignment: SFT, reward model, DPO, online DPO, GRPO and PPO with the model roles
(policy trainer, rollout, reference, reward, critic) as Ray actors; the maths in `losses/`."""

from raypai.alignment.config import DPOConfig, GRPOConfig, PPOConfig, RewardModelConfig, SFTConfig
from raypai.alignment.dpo import run_dpo
from raypai.alignment.grpo import run_grpo
from raypai.alignment.ppo import run_ppo
from raypai.alignment.reward_model import train_reward_model
from raypai.alignment.sft import run_sft

__all__ = ["SFTConfig", "RewardModelConfig", "DPOConfig", "GRPOConfig", "PPOConfig", "run_sft", "train_reward_model",
           "run_dpo", "run_grpo", "run_ppo"]
