"""Typed configs for pretraining, validated once (`PretrainConfig.validate`) with every problem
reported together in one ConfigError. Defaults are for the tiny CPU models of tests and the demo."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from raypai.config import parse_config
from raypai.errors import ConfigError
from raypai.train.schedule import SCHEDULES


@dataclass(frozen=True)
class ModelConfig:
    """A Llama-architecture decoder. `vocab_size` comes from the tokenizer when 0."""

    layers: int = 2
    hidden: int = 128
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 344
    max_positions: int = 256
    vocab_size: int = 0
    init_from: str = ""  # a local HF checkpoint folder to start from instead of random weights

    def problems(self) -> list[str]:
        p = []
        for name in ("layers", "hidden", "heads", "kv_heads", "intermediate", "max_positions"):
            if getattr(self, name) < 1:
                p.append(f"model.{name} must be ≥ 1 (got {getattr(self, name)})")
        if self.heads >= 1 and self.hidden % self.heads:
            p.append(f"model.hidden ({self.hidden}) must be divisible by model.heads ({self.heads})")
        if self.kv_heads >= 1 and self.heads % self.kv_heads:
            p.append(
                f"model.heads ({self.heads}) must be divisible by model.kv_heads ({self.kv_heads}) "
                "for grouped-query attention"
            )
        return p


@dataclass(frozen=True)
class PretrainConfig:
    """Everything a run needs besides its data. `docs/train.md` has the field reference."""

    model: ModelConfig = field(default_factory=ModelConfig)
    steps: int = 200
    lr: float = 3e-3  # peak; tiny models tolerate a high lr (GPT-3 Table 2.1 scales lr up as models shrink)
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    schedule: str = "cosine"
    micro_batch: int = 8  # blocks per worker per micro-step
    grad_accum: int = 1
    grad_clip: float = 1.0
    weight_decay: float = 0.01  # AdamW betas (0.9, 0.95) as in GPT-3 / LLaMA
    zero_stage: int = 2
    strategy: str = "manual"  # "auto": pick ZeRO stage / micro-batch / accumulation from a memory budget
    memory_budget_gb: float = 4.0  # per worker, for strategy="auto" and the fit check
    workers: int = 2
    cpus_per_worker: float = 1.0
    use_gpu: bool = False
    threads_per_worker: int = 1
    eval_every: int = 50
    eval_blocks: int = 32
    checkpoint_every: int = 50
    async_checkpoint: bool = True
    max_failures: int = 1
    seed: int = 0
    log_every: int = 10
    peak_flops_per_worker: float = 0.0  # 0: measured at start with a matmul probe
    straggler_ratio: float = 1.5
    deepspeed_config: dict = field(default_factory=dict)  # merged over the generated one
    resume_from: str = ""  # a checkpoint folder of an earlier run to continue from

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.grad_accum * self.workers

    def validate(self) -> "PretrainConfig":
        p = list(self.model.problems())
        for name in (
            "steps",
            "micro_batch",
            "grad_accum",
            "workers",
            "threads_per_worker",
            "eval_every",
            "checkpoint_every",
            "log_every",
        ):
            if getattr(self, name) < 1:
                p.append(f"{name} must be ≥ 1 (got {getattr(self, name)})")
        if not 0 < self.lr < 1:
            p.append(f"lr must be in (0, 1) (got {self.lr})")
        if self.schedule not in SCHEDULES:
            p.append(f"schedule {self.schedule!r} is unknown; use one of {', '.join(SCHEDULES)}")
        if self.zero_stage not in (0, 1, 2, 3):
            p.append(f"zero_stage must be 0, 1, 2 or 3 (got {self.zero_stage})")
        if self.strategy not in ("manual", "auto"):
            p.append(f"strategy {self.strategy!r} is unknown; use 'manual' or 'auto'")
        if self.warmup_steps < 0 or self.warmup_steps >= self.steps:
            p.append(f"warmup_steps must be in [0, steps) (got {self.warmup_steps} with steps={self.steps})")
        if self.max_failures < 0:
            p.append(f"max_failures must be ≥ 0 (got {self.max_failures})")
        if not 0 <= self.min_lr_ratio <= 1:
            p.append(f"min_lr_ratio must be in [0, 1] (got {self.min_lr_ratio})")
        if self.grad_clip < 0 or self.weight_decay < 0:
            p.append(f"grad_clip and weight_decay must be ≥ 0 (got {self.grad_clip}, {self.weight_decay}); 0 disables")
        if self.memory_budget_gb <= 0 or self.cpus_per_worker <= 0:
            p.append(
                f"memory_budget_gb and cpus_per_worker must be > 0 (got {self.memory_budget_gb}, "
                f"{self.cpus_per_worker})"
            )
        if self.straggler_ratio <= 1:
            p.append(f"straggler_ratio must be > 1 (got {self.straggler_ratio}): it is a slowdown factor")
        if self.eval_blocks < 1:
            p.append(f"eval_blocks must be ≥ 1 (got {self.eval_blocks})")
        if not isinstance(self.deepspeed_config, dict):
            p.append("deepspeed_config must be a dict of DeepSpeed config keys (merged over the generated one)")
        if p:
            raise ConfigError(p, what="pretrain config")
        return self

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "PretrainConfig":
        """A validated config from a plain mapping (`model:` holds the ModelConfig fields); unknown
        options, wrong types and invalid values together in one ConfigError (raypai.config)."""
        return parse_config(cls, d, what="pretrain config")

    @classmethod
    def load(cls, path: str) -> "PretrainConfig":
        """A validated config from a YAML or JSON file (`model:` holds the ModelConfig fields)."""
        import yaml

        try:
            raw = yaml.safe_load(open(path).read()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError([f"config file {path}: cannot be read ({exc})"], what="pretrain config") from exc
        if not isinstance(raw, dict):
            raise ConfigError(
                [f"config file {path}: expected a mapping of options, got {type(raw).__name__}"], what="pretrain config"
            )
        return cls.from_dict(raw)
