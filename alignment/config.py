"""Typed alignment configs, one per algorithm, composed from shared parts and checked where they are
built: every problem is reported at once in a single `ConfigError`, before any actor starts.

Each setting is declared once, in the part it belongs to, with its check next to it:

    Schedule      steps                                   how long a run trains
    Batches       + batch_size, checkpoint_every          SFT, reward model, DPO: batches of examples
    RolloutLoop   + prompts_per_step, reward_model_weight, rollout_replicas, eval_every,
                    checkpoint_every, clip_eps            GRPO, PPO: sample, score, learn
    Optimisation  lr, seed, zero_stage
    Lengths       max_length, truncation
    Sampling      max_new_tokens, temperature, top_p, rollout_engine, compile_rollout,
                  rollout_tensor_parallel
    Resources     gpus
    Scale         ranks, reference_ranks, micro_batch, activation_checkpointing, offload_optimizer,
                  collective_timeout_s, memory_gb

An algorithm's config inherits the parts it uses and adds its own fields, so users still write one
flat mapping (`GRPOConfig(steps=3, lr=1e-3)`, `cfg.lr`, a YAML file of `steps: 3`). A dataclass lays
out its bases' fields from the last base to the first, so a config lists its parts last-first: the
fields then read steps, batch (or prompts) per step, optimiser, lengths, sampling, resources, own.
A field without a shared default (`steps`, `batch_size`, `prompts_per_step`, `reward_model_weight`)
gets it in each config, with the reason; any other per-algorithm default is an override there too.

Defaults are sized for the tiny arithmetic demo on a CPU; the comments say where a default comes from.
"""

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
# tokens sampled after a prompt: the only default of this setting inside raypai (the rollout and the
# `evaluate` step take theirs from here). Sized for the demo's answers: a number and the end of turn.
MAX_NEW_TOKENS = 6


class _Part:
    """What every part and config shares: the checks of each class in its bases run once, when it
    is built, and their problems come back together in one ConfigError."""

    def __post_init__(self):
        problems = [p for cls in reversed(type(self).__mro__) for p in vars(cls).get("_problems", _none)(self)]
        if problems:
            raise ConfigError(problems, what=type(self).__name__)

    def validate(self):
        """The config itself: it was checked when built (kept for callers that still call it)."""
        return self


def _none(_cfg) -> list[str]:
    return []


def _above_zero(cfg, names: dict[str, str]) -> list[str]:
    """Problems for the fields in `names` (field → what it means) that are ≤ 0."""
    return [
        f"{type(cfg).__name__}.{n} must be > 0 (got {getattr(cfg, n)}): {meaning}"
        for n, meaning in names.items()
        if getattr(cfg, n) <= 0
    ]


# ---- parts ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Schedule(_Part):
    """How long a run trains. No shared default: each algorithm's config sets its own."""

    steps: int

    def _problems(self) -> list[str]:
        return _above_zero(self, {"steps": "the number of optimizer steps"})


@dataclass(frozen=True)
class Batches(Schedule):
    """Steps over batches of examples (SFT, reward model, DPO). The batch size is the algorithm's."""

    batch_size: int
    checkpoint_every: int = 50  # steps between checkpoints, when the run is given a checkpoint_dir

    def _problems(self) -> list[str]:
        return _above_zero(
            self, {"batch_size": "examples per optimizer step", "checkpoint_every": "steps between checkpoints"}
        )


@dataclass(frozen=True)
class RolloutLoop(Schedule):
    """The loop of GRPO and PPO: per step, sample completions of `prompts_per_step` prompts, score
    them with the rewards (rule rewards plus a trained reward model weighted by `reward_model_weight`)
    and update with a clipped ratio; held-out reward every `eval_every` steps, a checkpoint every
    `checkpoint_every`. Prompts per step and the reward model's weight are the algorithm's."""

    prompts_per_step: int
    reward_model_weight: float
    rollout_replicas: int = 1  # rollout engines sampling side by side, each a share of the prompts
    eval_every: int = 10
    checkpoint_every: int = 10
    clip_eps: float = 0.2  # ε of the clipped ratio (Schulman et al. 2017)

    def _problems(self) -> list[str]:
        p = _above_zero(
            self,
            {
                "prompts_per_step": "prompts sampled per step",
                "rollout_replicas": "rollout engines",
                "eval_every": "steps between held-out evaluations",
                "checkpoint_every": "steps between checkpoints",
            },
        )
        if not 0 < self.clip_eps < 1:
            p.append(
                f"{type(self).__name__}.clip_eps must be in (0, 1) (got {self.clip_eps}): the ratio is clipped "
                "to [1 − ε, 1 + ε]"
            )
        if self.reward_model_weight < 0:
            p.append(
                f"{type(self).__name__}.reward_model_weight must be ≥ 0 (got {self.reward_model_weight}); "
                "0 = the rule rewards only"
            )
        return p


@dataclass(frozen=True)
class Optimisation(_Part):
    """The trained model's optimiser (AdamW through DeepSpeed) and the run's seed."""

    lr: float = 5e-4  # full fine-tunes of the tiny demo models; the reward model overfit at 2e-3
    seed: int = 0
    zero_stage: int = 0

    def _problems(self) -> list[str]:
        p = _above_zero(self, {"lr": "the learning rate"})
        if self.zero_stage not in (0, 1, 2, 3):
            p.append(
                f"{type(self).__name__}.zero_stage must be 0, 1, 2 or 3 (got {self.zero_stage}): what the trained "
                "role's ranks shard (1: optimizer state, 2: + gradients, 3: + parameters; docs/scaling.md)"
            )
        return p


@dataclass(frozen=True)
class LoRASpec:
    """The adapters a LoRA trainer holds (`raypai.alignment.lora`): rank, α (scale α / r), dropout
    and the targeted projections (() = every linear projection of the decoder blocks)."""

    r: int
    alpha: float
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ()

    @property
    def scale(self) -> float:
        return self.alpha / self.r


# The adapters' learning rate as a multiple of full fine-tuning's: LoRA's best learning rate is about
# ten times full fine-tuning's across model sizes (Schulman et al. 2025, "LoRA Without Regret").
LORA_LR_FACTOR = 10.0


@dataclass(frozen=True)
class Adapters(_Part):
    """LoRA (Hu et al. 2021) instead of full fine-tuning: `lora_r` > 0 trains rank-r adapters on the
    targeted projections (and a reward model's or critic's scalar head); the reference is the base
    with the adapters off, and the output is the merged model plus the adapter (docs/alignment.md,
    "LoRA")."""

    lora_r: int = 0  # 0 = full fine-tuning
    lora_alpha: float = 0.0  # α; 0 = 2 · lora_r (a scale α / r of 2)
    lora_dropout: float = 0.0  # on the adapters' input; RL updates run without dropout (docs)
    lora_target_modules: tuple[str, ...] = ()  # projection names (e.g. q_proj, v_proj); () = all of them
    lora_lr: float = 0.0  # the adapters' learning rate; 0 = LORA_LR_FACTOR × lr

    def _problems(self) -> list[str]:
        name, p = type(self).__name__, []
        if self.lora_r < 0:
            p.append(f"{name}.lora_r must be ≥ 0 (got {self.lora_r}); 0 = full fine-tuning, e.g. 16 for LoRA")
        if self.lora_alpha < 0:
            p.append(f"{name}.lora_alpha must be ≥ 0 (got {self.lora_alpha}); 0 = 2 · lora_r")
        if not 0 <= self.lora_dropout < 1:
            p.append(f"{name}.lora_dropout must be in [0, 1) (got {self.lora_dropout})")
        if self.lora_lr < 0:
            p.append(f"{name}.lora_lr must be ≥ 0 (got {self.lora_lr}); 0 = {LORA_LR_FACTOR:g} × lr")
        bad = [t for t in self.lora_target_modules if not isinstance(t, str) or not t]
        if bad:
            p.append(f"{name}.lora_target_modules must be module names such as 'q_proj' (got {bad})")
        if not self.lora_r and (self.lora_target_modules or self.lora_lr or self.lora_alpha or self.lora_dropout):
            p.append(f"{name}: lora_* options are set but lora_r is 0 (full fine-tuning); set lora_r (e.g. 16)")
        return p

    def lora(self) -> LoRASpec | None:
        """The adapters' spec, or None for full fine-tuning."""
        if not self.lora_r:
            return None
        alpha = self.lora_alpha or 2.0 * self.lora_r
        return LoRASpec(self.lora_r, alpha, self.lora_dropout, tuple(self.lora_target_modules))

    def lr_of(self, full: float) -> float:
        """The learning rate a trainer uses: `full` (the config's lr, or PPO's critic_lr) for full
        fine-tuning; with LoRA, lora_lr or LORA_LR_FACTOR × full."""
        if not self.lora_r:
            return full
        return self.lora_lr or LORA_LR_FACTOR * full


@dataclass(frozen=True)
class Lengths(_Part):
    """How long an example may be, and what happens to a longer one."""

    max_length: int = 0  # tokens per example (prompt + max_new_tokens when sampling); 0 = the model's context
    truncation: str = "refuse"  # refuse (DataError naming the example) | truncate (cut, counted)

    def _problems(self) -> list[str]:
        p = []
        if self.truncation not in ("refuse", "truncate"):
            p.append(
                f"{type(self).__name__}.truncation must be 'refuse' or 'truncate' (got {self.truncation!r}): "
                "what happens to an example longer than max_length"
            )
        if self.max_length < 0:
            p.append(f"{type(self).__name__}.max_length must be ≥ 0 (got {self.max_length}); 0 = the model's context")
        return p


WEIGHT_TRANSPORTS = ("object_store", "collective")


@dataclass(frozen=True)
class Sampling(_Part):
    """How the rollout samples completions (online DPO, GRPO, PPO)."""

    max_new_tokens: int = MAX_NEW_TOKENS
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus sampling; 1 = the whole distribution
    rollout_engine: str = "raypai"  # ROLLOUT_ENGINES
    # torch.compile raypai's decoding step on CPUs: about half the time per token on small models,
    # after a compile of 10-30 s per batch shape in each rollout process (worth it for long runs)
    compile_rollout: bool = False
    # GPUs each rollout replica's vLLM engine shards the model over (vLLM's tensor_parallel_size, on one
    # node; `raypai.alignment.placement`): for a model one GPU cannot hold. 1 = a replica on one device
    rollout_tensor_parallel: int = 1
    # how rollout replicas on other nodes than the trainer's get its weights: "object_store" (one copy
    # there, a ZeRO-3 trainer's in buckets) or "collective" (broadcast over a process group of the
    # trainer and those replicas: gloo on CPUs, NCCL on GPUs; `raypai.alignment.sync_group`).
    # Same-node replicas always read shared memory
    weight_transport: str = "object_store"

    def _problems(self) -> list[str]:
        name = type(self).__name__
        p = _above_zero(
            self,
            {
                "max_new_tokens": "tokens sampled after each prompt",
                "rollout_tensor_parallel": "GPUs per rollout replica",
            },
        )
        if self.weight_transport not in WEIGHT_TRANSPORTS:
            p.append(
                f"{name}.weight_transport {self.weight_transport!r} is unknown; choose one of "
                f"{', '.join(WEIGHT_TRANSPORTS)}"
            )
        if self.weight_transport == "collective" and getattr(self, "lora_r", 0):
            p.append(
                f"{name}.weight_transport='collective' with LoRA: a LoRA run hands its replicas the adapters "
                "alone (a few MB) through the object store; leave weight_transport='object_store'"
            )
        tp, gpus = self.rollout_tensor_parallel, getattr(self, "gpus", 0)
        if tp > 1 and self.rollout_engine != "vllm":
            p.append(
                f"{name}.rollout_tensor_parallel={tp} shards the rollout's model over GPUs, which only vLLM does "
                f"(rollout_engine is {self.rollout_engine!r}): set rollout_engine='vllm' or rollout_tensor_parallel=1"
            )
        if tp > 1 and gpus < tp:
            p.append(
                f"{name}.rollout_tensor_parallel={tp} gives each rollout replica {tp} whole GPUs, but gpus={gpus:g}: "
                f"set gpus to at least {tp} (whole GPUs), or rollout_tensor_parallel=1"
            )
        elif tp > 1 and getattr(self, "placement", "") == "colocated" and gpus % tp:
            p.append(
                f"{name}.rollout_tensor_parallel={tp} with placement='colocated' puts each replica on an aligned "
                f"block of {tp} GPUs, which gpus={gpus:g} does not divide into: set gpus to a multiple of {tp}, or "
                "placement='separate'"
            )
        if self.temperature < 0:
            p.append(f"{name}.temperature must be ≥ 0 (got {self.temperature}); 0 = greedy")
        if not 0 < self.top_p <= 1:
            p.append(f"{name}.top_p must be in (0, 1] (got {self.top_p}); 1 = no nucleus cut")
        if self.rollout_engine not in ROLLOUT_ENGINES:
            p.append(
                f"{name}.rollout_engine {self.rollout_engine!r} is unknown; choose one of "
                f"{', '.join(ROLLOUT_ENGINES)} ('hf' = transformers' generate, for models raypai's loop cannot "
                "drive; 'vllm' = vLLM, installed with raypai[vllm])"
            )
        if self.compile_rollout and self.rollout_engine != "raypai":
            p.append(
                f"{name}.compile_rollout compiles raypai's own decoding step; it does not apply to "
                f"rollout_engine {self.rollout_engine!r} (set rollout_engine='raypai' or compile_rollout=False)"
            )
        return p


@dataclass(frozen=True)
class Resources(_Part):
    """Where the run's roles work."""

    # GPUs of the run: up to 1, the share of one GPU its roles take turns on (`raypai.alignment.placement`),
    # the trainer asleep (weights and optimizer state in host memory) while others work; more: that
    # many whole GPUs, on one node or several, laid out as `placement` says; 0 = CPUs
    gpus: float = 0.0
    # with gpus > 1: "colocated" (every role's ranks spread over all the GPUs, time-sharing them) or
    # "separate" (every rank of a GPU role on a GPU of its own)
    placement: str = "colocated"
    # the model roles' arithmetic: "bf16" (the trainer's forward under bf16 autocast over fp32 master
    # weights and optimizer state; the rollout and reference hold bf16 weights), "fp32", or "auto":
    # bf16 on GPUs and on CPUs with bf16 units (AVX-512 BF16, AMX), fp32 on other CPUs
    precision: str = "auto"

    @property
    def gpu_share(self) -> float:
        """How much of one GPU the run's roles share: `gpus` up to 1, a whole GPU beyond."""
        return min(self.gpus, 1.0)

    def _problems(self) -> list[str]:
        from raypai.alignment.placement import PLACEMENTS
        from raypai.alignment.roles._device import PRECISIONS

        name, p = type(self).__name__, []
        if self.gpus < 0 or (self.gpus > 1 and self.gpus != int(self.gpus)):
            p.append(
                f"{name}.gpus must be a share of one GPU in [0, 1] or a whole number of GPUs (got {self.gpus:g}): "
                "0 runs the roles on CPUs"
            )
        if self.placement not in PLACEMENTS:
            p.append(f"{name}.placement {self.placement!r} is unknown; choose one of {', '.join(PLACEMENTS)}")
        if self.precision not in PRECISIONS:
            p.append(
                f"{name}.precision {self.precision!r} is unknown; choose one of {', '.join(PRECISIONS)} "
                "('auto': bf16 where the device has bf16 units, else fp32)"
            )
        return p

    def dtype(self, model_dir: str | None = None) -> str:
        """The run's compute dtype for the model in `model_dir`, "bfloat16" or "float32"
        (`roles._device.run_dtype`: "auto" weighs the model's hidden size on a CPU)."""
        from raypai.alignment.roles._device import hidden_size, run_dtype

        return run_dtype(self.precision, self.gpus > 0, hidden_size(model_dir) if self.precision == "auto" else None)


@dataclass(frozen=True)
class Scale(_Part):
    """How a run's model roles spread over ranks (docs/scaling.md). A trained role (the policy, PPO's
    critic, a reward model being trained) is `ranks` data-parallel ranks, one DeepSpeed engine across
    them at the config's ZeRO stage; the frozen reference is `reference_ranks` ranks, each scoring a
    share of the rows (`reference_zero3`: each holding a ZeRO-3 partition of its weights, not a copy),
    and the reward (rule functions and a reward model) `reward_ranks`, likewise.
    Defaults: one rank each, what one machine needs."""

    ranks: int = 1
    reference_ranks: int = 1
    # the reference's ranks hold a ZeRO-3 partition of its weights each (DeepSpeed inference), not a copy
    reference_zero3: bool = False
    reward_ranks: int = 1
    # rows per forward/backward on a rank: its share of a step's batch runs in micro-batches of this
    # many rows, the gradients accumulated over them (the same update); 0 = the whole share at once
    micro_batch: int = 0
    activation_checkpointing: bool = False  # recompute the blocks' activations in the backward pass
    offload_optimizer: bool = False  # ZeRO-Offload: the optimizer state and step in host memory (ZeRO ≥ 1)
    # a collective that waits longer than this fails: a dead or stuck rank ends the run, naming the rank
    collective_timeout_s: float = 60.0
    # memory per rank that the plan checks against (GB); 0 = the device's (a GPU's, or host RAM / ranks)
    memory_gb: float = 0.0

    def _problems(self) -> list[str]:
        name = type(self).__name__
        p = _above_zero(
            self,
            {
                "ranks": "data-parallel ranks of each trained role",
                "reference_ranks": "ranks of the frozen reference",
                "reward_ranks": "ranks scoring the rewards",
                "collective_timeout_s": "seconds a collective may wait for a rank",
            },
        )
        if self.micro_batch < 0 or self.memory_gb < 0:
            p.append(
                f"{name}.micro_batch and memory_gb must be ≥ 0 (got {self.micro_batch}, {self.memory_gb}); "
                "0 = the rank's whole share / the device's memory"
            )
        stage = getattr(self, "zero_stage", 0)
        if self.offload_optimizer and stage < 1:
            p.append(
                f"{name}.offload_optimizer needs zero_stage ≥ 1 (got {stage}): ZeRO-Offload moves the sharded "
                "optimizer state to the host"
            )
        if stage == 3 and getattr(self, "lora_r", 0):
            p.append(
                f"{name}: LoRA with zero_stage 3 is not supported: the base is frozen and the adapters are small, "
                "so ZeRO-2 (or more ranks) already shards what trains; use zero_stage ≤ 2 with lora_r"
            )
        return p


# ---- one config per algorithm (bases last-first: see the module docstring) ----------------------
@dataclass(frozen=True)
class SFTConfig(Scale, Resources, Lengths, Adapters, Optimisation, Batches):
    """Supervised fine-tuning: mean NLL of the response tokens only (prompt tokens are masked)."""

    steps: int = 200
    batch_size: int = 16
    # SFT's own: it starts from a base model; the algorithms after it refine the SFT model with
    # Optimisation's smaller 5e-4
    lr: float = 1e-3
    log_every: int = 20
    ptx_coef: float = 0.0  # weight of the pretraining LM loss mixed in when pretraining blocks are given

    def _problems(self) -> list[str]:
        return _above_zero(self, {"log_every": "steps between logged metrics"})


@dataclass(frozen=True)
class RewardModelConfig(Scale, Resources, Lengths, Adapters, Optimisation, Batches):
    """Bradley–Terry reward model on the SFT model with a scalar head."""

    steps: int = 300
    batch_size: int = 32
    margin: float = 0.0  # m in −log σ(r_w − r_l − m) (Llama 2 §3.2.2); 0 = plain Bradley–Terry


@dataclass(frozen=True)
class DPOConfig(Scale, Resources, Sampling, Lengths, Adapters, Optimisation, Batches):
    """DPO (offline pairs) or online DPO (`online=True`: pairs from the policy's own ranked samples;
    the sampling fields apply to online DPO only)."""

    steps: int = 100
    batch_size: int = 8
    beta: float = 0.1  # Rafailov et al. 2023 and TRL's default
    loss_type: str = "sigmoid"  # sigmoid | ipo | hinge
    label_smoothing: float = 0.0  # ε of cDPO (sigmoid only): assumed probability that a label is flipped
    online: bool = False  # online DPO: sample `num_samples` per prompt, rank with Reward, best vs worst
    num_samples: int = 4

    def _problems(self) -> list[str]:
        from raypai.alignment.losses import DPO_LOSSES  # here, not at import: importing configs needs no torch

        p = _above_zero(self, {"beta": "the strength of the implicit KL to the reference"})
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
        return p


@dataclass(frozen=True)
class GRPOConfig(Scale, Resources, Sampling, Lengths, Adapters, Optimisation, RolloutLoop):
    """GRPO (Shao et al. 2024); defaults follow TRL's GRPOConfig where one exists."""

    steps: int = 30
    prompts_per_step: int = 8
    reward_model_weight: float = 0.0  # a trained reward model (when given) adds to the rule reward only when asked
    group_size: int = 8
    clip_eps_high: float | None = None  # DAPO's clip-higher upper bound (None = ε); e.g. 0.28
    beta: float = 0.0  # k3 KL coefficient; TRL's current default is 0.0, DeepSeekMath used 0.04
    aggregation: str = "dapo"  # grpo | bnpo | dr_grpo | dapo (token-mean, TRL's current default)
    inner_iterations: int = 1  # μ: updates per batch of rollouts, with the old log-probs kept fixed
    # generate the next batch while this one trains: one step off-policy, ratio against the sampling weights
    async_rollout: bool = False
    # torch threads of the trainer and of the rollout. 0 = placement's choice: synchronous runs
    # colocate the roles in one bundle and each phase (rollout, then update) owns all its CPUs;
    # async runs give each role its own bundle and 1 thread, as they work at the same time.
    train_threads: int = 0
    rollout_threads: int = 0

    def _problems(self) -> list[str]:
        from raypai.alignment.losses import AGGREGATIONS  # as in DPOConfig

        p = _above_zero(self, {"inner_iterations": "updates per batch of rollouts"})
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
        if self.clip_eps_high is not None and self.clip_eps_high < self.clip_eps:
            p.append(
                f"GRPOConfig.clip_eps_high ({self.clip_eps_high}) must be ≥ clip_eps ({self.clip_eps}): "
                "it only widens the upper side of the trust region"
            )
        if self.beta < 0:
            p.append(f"GRPOConfig.beta must be ≥ 0 (got {self.beta}); 0 = no KL term (and no reference model)")
        return p


@dataclass(frozen=True)
class PPOConfig(Scale, Resources, Sampling, Lengths, Adapters, Optimisation, RolloutLoop):
    """RLHF PPO (Ouyang et al. 2022): defaults follow InstructGPT-style setups scaled to a tiny model."""

    steps: int = 30
    prompts_per_step: int = 16
    reward_model_weight: float = 1.0  # RLHF's reward is the trained reward model (when given)
    critic_lr: float = 1e-3
    value_clip: float = 0.2  # value clip around the rollout-time values (PPO2)
    kl_coef: float = 0.05  # β of the per-token KL penalty in the reward
    gamma: float = 1.0  # no discount inside one completion, as in RLHF practice
    lam: float = 0.95  # GAE λ
    ppo_epochs: int = 2  # μ: updates per batch of rollouts

    def _problems(self) -> list[str]:
        p = _above_zero(
            self,
            {
                "critic_lr": "the critic's learning rate",
                "ppo_epochs": "updates per batch of rollouts",
                "value_clip": "the clip around the rollout-time values",
            },
        )
        if not 0 <= self.gamma <= 1 or not 0 <= self.lam <= 1:
            p.append(
                f"PPOConfig.gamma and lam must be in [0, 1] (got {self.gamma}, {self.lam}): they are discount "
                "factors of GAE"
            )
        if self.kl_coef < 0:
            p.append(f"PPOConfig.kl_coef must be ≥ 0 (got {self.kl_coef}); 0 = no KL penalty")
        return p


def from_dict(algo: str, values: dict):
    """The checked config of `algo` (a name in `raypai.alignment.algorithms.ALGORITHMS`) from a plain
    dict (a YAML/JSON file's content), read by the core's `parse_config`: unknown options (with the
    close match), wrong types and invalid values reported together; numbers written as text ("3e-3",
    which YAML 1.1 leaves a string) read as numbers. The values an algorithm implies (online DPO:
    online=True) are set on top."""
    from raypai.alignment.algorithms import get  # the registry imports this module

    entry = get(algo, what="alignment config")
    values = {**values, **entry.implies}
    return parse_config(entry.config, values, what=f"{algo} config ({entry.config.__name__})")
