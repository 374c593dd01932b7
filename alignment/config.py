"""Typed alignment configs, one per algorithm, validated before any actor starts; every problem is
reported at once in a single `ConfigError`. Defaults are sized for the tiny arithmetic demo on a
CPU; the comments say where a default comes from."""

from __future__ import annotations

from dataclasses import dataclass

from raypai.config import parse_config
from raypai.errors import ConfigError

# how the rollout samples: raypai's own decoding loop (finished rows leave the batch, behaviour
# log-probs from the sampling pass), transformers' `generate` (for a model the loop cannot drive) or
# vLLM (`pip install 'raypai[vllm]'`, for GPU clusters; weights pushed into it after each update)
ROLLOUT_ENGINES = ("raypai", "hf", "vllm")
# engines whose replicas can read the trainer's own parameters in place (live shared parameters,
# `raypai.alignment.sync`); vLLM keeps its own repacked copy, so its replicas take a copy per update
LIVE_ENGINES = ("raypai", "hf")


def _positive(cfg, names, problems):
    for n in names:
        if getattr(cfg, n) <= 0:
            problems.append(f"{type(cfg).__name__}.{n} must be > 0 (got {getattr(cfg, n)})")
    if getattr(cfg, "truncation", "refuse") not in ("refuse", "truncate"):
        problems.append(
            f"{type(cfg).__name__}.truncation must be 'refuse' or 'truncate' (got {cfg.truncation!r}): "
            "what happens to an example longer than max_length"
        )
    if getattr(cfg, "max_length", 0) < 0:
        problems.append(f"{type(cfg).__name__}.max_length must be ≥ 0 (got {cfg.max_length}); 0 = the model's context")
    engine = getattr(cfg, "rollout_engine", "raypai")
    if engine not in ROLLOUT_ENGINES:
        problems.append(
            f"{type(cfg).__name__}.rollout_engine {engine!r} is unknown; choose one of "
            f"{', '.join(ROLLOUT_ENGINES)} ('hf' = transformers' generate, for models raypai's loop cannot drive; "
            "'vllm' = vLLM, installed with raypai[vllm])"
        )
    if getattr(cfg, "compile_rollout", False) and engine != "raypai":
        problems.append(
            f"{type(cfg).__name__}.compile_rollout compiles raypai's own decoding step; it does not "
            f"apply to rollout_engine {engine!r} (set rollout_engine='raypai' or compile_rollout=False)"
        )
    gpus = getattr(cfg, "gpus", 0)
    if not 0 <= gpus <= 1:
        problems.append(
            f"{type(cfg).__name__}.gpus must be in [0, 1] (got {gpus:g}): the roles of a run share one "
            "GPU and take turns on it (0 runs them on CPUs)"
        )
    zero = getattr(cfg, "zero_stage", 0)
    if zero not in (0, 1, 2):
        problems.append(
            f"{type(cfg).__name__}.zero_stage must be 0, 1 or 2 (got {zero}): each role holds a whole "
            "model, ZeRO-3 parameter sharding needs several trainer ranks"
        )


@dataclass(frozen=True)
class SFTConfig:
    """Supervised fine-tuning: mean NLL of the response tokens only (prompt tokens are masked)."""

    steps: int = 200
    batch_size: int = 16
    lr: float = 1e-3
    zero_stage: int = 0
    seed: int = 0
    log_every: int = 20
    max_length: int = 0  # tokens per example; 0 = the model's context length
    truncation: str = "refuse"  # refuse (DataError naming the example) | truncate (cut, counted)
    ptx_coef: float = 0.0  # weight of the pretraining LM loss mixed in when pretraining blocks are given
    # share of one GPU for the run's roles (they take turns on it; `raypai.alignment.placement`); 0 = CPUs
    gpus: float = 0.0

    def validate(self):
        p = []
        _positive(self, ("steps", "batch_size", "lr"), p)
        if p:
            raise ConfigError(p, what="SFT config")
        return self


@dataclass(frozen=True)
class RewardModelConfig:
    """Bradley–Terry reward model on the SFT model with a scalar head."""

    steps: int = 300
    batch_size: int = 32
    lr: float = 5e-4  # full fine-tune of the SFT model; 2e-3 overfit the tiny models (held-out pairs 0.6 vs 0.8-0.9)
    margin: float = 0.0  # m in −log σ(r_w − r_l − m) (Llama 2 §3.2.2); 0 = plain Bradley–Terry
    seed: int = 0
    max_length: int = 0
    truncation: str = "refuse"

    def validate(self):
        p = []
        _positive(self, ("steps", "batch_size", "lr"), p)
        if p:
            raise ConfigError(p, what="reward model config")
        return self


@dataclass(frozen=True)
class DPOConfig:
    """DPO (offline pairs) or online DPO (`online=True`: pairs from the policy's own ranked samples)."""

    steps: int = 100
    batch_size: int = 8
    lr: float = 5e-4
    beta: float = 0.1  # Rafailov et al. 2023 and TRL's default
    loss_type: str = "sigmoid"  # sigmoid | ipo | hinge
    label_smoothing: float = 0.0  # ε of cDPO (sigmoid only): assumed probability that a label is flipped
    online: bool = False  # online DPO: sample `num_samples` per prompt, rank with Reward, best vs worst
    num_samples: int = 4
    temperature: float = 1.0
    max_new_tokens: int = 6
    zero_stage: int = 0
    seed: int = 0
    rollout_engine: str = "raypai"  # online DPO's sampler: "raypai" | "hf" | "vllm"
    compile_rollout: bool = False  # torch.compile raypai's decoding step (CPU); see GRPOConfig
    max_length: int = 0
    truncation: str = "refuse"
    # share of one GPU for the run's roles (they take turns on it; `raypai.alignment.placement`); 0 = CPUs
    gpus: float = 0.0

    def validate(self):
        from raypai.alignment.losses import DPO_LOSSES  # here: building a config (a pipeline definition) needs no torch

        p = []
        _positive(self, ("steps", "batch_size", "lr", "beta"), p)
        if self.loss_type not in DPO_LOSSES:
            p.append(f"DPOConfig.loss_type {self.loss_type!r} is unknown; choose one of {', '.join(DPO_LOSSES)}")
        if not 0 <= self.label_smoothing < 0.5:
            p.append(
                f"DPOConfig.label_smoothing must be in [0, 0.5) (got {self.label_smoothing}): "
                "at 0.5 chosen and rejected are indistinguishable"
            )
        if self.online and self.num_samples < 2:
            p.append(
                f"DPOConfig.num_samples must be ≥ 2 for online DPO (got {self.num_samples}): "
                "a pair needs two completions"
            )
        if p:
            raise ConfigError(p, what="DPO config")
        return self


@dataclass(frozen=True)
class GRPOConfig:
    """GRPO (Shao et al. 2024); defaults follow TRL's GRPOConfig where one exists."""

    steps: int = 30
    prompts_per_step: int = 8
    group_size: int = 8
    lr: float = 5e-4
    clip_eps: float = 0.2  # ε of the clipped ratio
    clip_eps_high: float | None = None  # DAPO's clip-higher upper bound (None = ε); e.g. 0.28
    beta: float = 0.0  # k3 KL coefficient; TRL's current default is 0.0, DeepSeekMath used 0.04
    aggregation: str = "dapo"  # grpo | bnpo | dr_grpo | dapo (token-mean, TRL's current default)
    inner_iterations: int = 1  # μ: updates per batch of rollouts, with the old log-probs kept fixed
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 6
    eval_every: int = 10
    checkpoint_every: int = 10
    zero_stage: int = 0
    seed: int = 0
    rollout_replicas: int = 1
    rollout_engine: str = "raypai"  # "raypai" | "hf" | "vllm" (ROLLOUT_ENGINES)
    # torch.compile raypai's decoding step on CPUs: about half the time per token on small models,
    # after a compile of 10-30 s per batch shape in each rollout process (worth it for long runs)
    compile_rollout: bool = False
    reward_model_weight: float = 0.0  # weight of a trained reward model next to the rule reward
    # generate the next batch while this one trains: one step off-policy, ratio against the sampling weights
    async_rollout: bool = False
    max_length: int = 0  # prompt + max_new_tokens must fit; 0 = the model's context length
    truncation: str = "refuse"
    # torch threads of the trainer and of the rollout. 0 = placement's choice: synchronous runs
    # colocate the roles in one bundle and each phase (rollout, then update) owns all its CPUs;
    # async runs give each role its own bundle and 1 thread, as they work at the same time.
    train_threads: int = 0
    rollout_threads: int = 0
    # GPUs of a synchronous run: 0 = every role on CPUs; g in (0, 1] = the trainer, rollout replicas
    # and (with beta > 0) the reference share g of one GPU and take turns on it, the trainer asleep
    # (weights and optimizer state in host memory) while the rollout samples
    gpus: float = 0.0

    def validate(self):
        from raypai.alignment.losses import AGGREGATIONS  # as DPOConfig.validate

        p = []
        _positive(
            self,
            (
                "steps",
                "prompts_per_step",
                "lr",
                "inner_iterations",
                "max_new_tokens",
                "eval_every",
                "checkpoint_every",
                "rollout_replicas",
            ),
            p,
        )
        if self.gpus and self.async_rollout:
            p.append(
                "GRPOConfig.gpus with async_rollout=True is not supported: async rollout samples while the "
                "trainer updates, so the two cannot take turns on one GPU; use async_rollout=False on a GPU"
            )
        for name in ("train_threads", "rollout_threads"):
            if getattr(self, name) < 0:
                p.append(f"GRPOConfig.{name} must be ≥ 0 (got {getattr(self, name)}); 0 = placement's choice")
        if self.group_size <= 1:
            p.append(
                f"GRPOConfig.group_size must be > 1 (got {self.group_size}): with one sample per prompt "
                "every advantage is 0"
            )
        if self.aggregation not in AGGREGATIONS:
            p.append(f"GRPOConfig.aggregation {self.aggregation!r} is unknown; choose one of {', '.join(AGGREGATIONS)}")
        if not 0 < self.clip_eps < 1:
            p.append(f"GRPOConfig.clip_eps must be in (0, 1) (got {self.clip_eps})")
        if self.clip_eps_high is not None and self.clip_eps_high < self.clip_eps:
            p.append(
                f"GRPOConfig.clip_eps_high ({self.clip_eps_high}) must be ≥ clip_eps ({self.clip_eps}): "
                "it only widens the upper side of the trust region"
            )
        if self.beta < 0:
            p.append(f"GRPOConfig.beta must be ≥ 0 (got {self.beta})")
        if p:
            raise ConfigError(p, what="GRPO config")
        return self


@dataclass(frozen=True)
class PPOConfig:
    """RLHF PPO (Ouyang et al. 2022): defaults follow InstructGPT-style setups scaled to a tiny model."""

    steps: int = 30
    prompts_per_step: int = 16
    lr: float = 5e-4
    critic_lr: float = 1e-3
    clip_eps: float = 0.2  # policy ratio clip (Schulman et al. 2017)
    value_clip: float = 0.2  # value clip around the rollout-time values (PPO2)
    kl_coef: float = 0.05  # β of the per-token KL penalty in the reward
    gamma: float = 1.0  # no discount inside one completion, as in RLHF practice
    lam: float = 0.95  # GAE λ
    ppo_epochs: int = 2  # μ: updates per batch of rollouts
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 6
    eval_every: int = 10
    checkpoint_every: int = 10
    zero_stage: int = 0
    seed: int = 0
    rollout_replicas: int = 1
    rollout_engine: str = "raypai"  # "raypai" | "hf" | "vllm" (ROLLOUT_ENGINES)
    compile_rollout: bool = False  # torch.compile raypai's decoding step (CPU); see GRPOConfig
    reward_model_weight: float = 1.0  # weight of the trained reward model (when given) next to the rule reward
    max_length: int = 0
    truncation: str = "refuse"
    # share of one GPU for the run's roles (they take turns on it; `raypai.alignment.placement`); 0 = CPUs
    gpus: float = 0.0

    def validate(self):
        p = []
        _positive(
            self,
            (
                "steps",
                "prompts_per_step",
                "lr",
                "critic_lr",
                "ppo_epochs",
                "max_new_tokens",
                "eval_every",
                "checkpoint_every",
                "rollout_replicas",
                "value_clip",
            ),
            p,
        )
        if not 0 < self.clip_eps < 1:
            p.append(f"PPOConfig.clip_eps must be in (0, 1) (got {self.clip_eps})")
        if not 0 <= self.gamma <= 1 or not 0 <= self.lam <= 1:
            p.append(
                f"PPOConfig.gamma and lam must be in [0, 1] (got {self.gamma}, {self.lam}): they are discount "
                "factors of GAE"
            )
        if self.kl_coef < 0:
            p.append(f"PPOConfig.kl_coef must be ≥ 0 (got {self.kl_coef})")
        if p:
            raise ConfigError(p, what="PPO config")
        return self


CONFIGS = {
    "sft": SFTConfig,
    "reward_model": RewardModelConfig,
    "dpo": DPOConfig,
    "online_dpo": DPOConfig,
    "grpo": GRPOConfig,
    "ppo": PPOConfig,
}


def from_dict(algo: str, values: dict):
    """The validated config of `algo` from a plain dict (a YAML/JSON file's content), read by the
    core's `parse_config`: unknown options (with the close match), wrong types and invalid values
    reported together; numbers written as text ("3e-3", which YAML 1.1 leaves a string) read as numbers."""
    if algo not in CONFIGS:
        raise ConfigError([f"unknown algorithm {algo!r}; choose one of {', '.join(CONFIGS)}"], what="alignment config")
    if algo == "online_dpo":
        values = {**values, "online": True}
    return parse_config(CONFIGS[algo], values, what=f"{algo} config ({CONFIGS[algo].__name__})")
