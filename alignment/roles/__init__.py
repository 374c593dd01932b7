"""Role actors: thin shells that build a model/engine and call pure functions."""

from raypai.alignment.roles.critic import Critic
from raypai.alignment.roles.policy import PolicyTrainer
from raypai.alignment.roles.reference import Reference
from raypai.alignment.roles.reward import Reward
from raypai.alignment.roles.rollout import Rollout

__all__ = ["PolicyTrainer", "Rollout", "Reference", "Reward", "Critic"]
