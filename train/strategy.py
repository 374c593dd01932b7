"""`strategy="auto"`: estimate per-worker memory and pick ZeRO stage, micro-batch, accumulation.

Model states (Rajbhandari et al. 2020, ZeRO §3, Fig. 1), Ψ parameters, N data-parallel workers:
weights wΨ, gradients gΨ, optimizer states KΨ bytes. Mixed precision (bf16 on GPU): w = g = 2,
K = 12 (fp32 master weights, Adam m and v). fp32 on CPU: w = g = 4, K = 8 (Adam m and v), plus the
fp32 partition DeepSpeed's ZeRO-1/2 optimizer keeps (4Ψ/N; its ZeRO-3 optimizer steps fp32
partitions in place, no copy). ZeRO-1 divides K by N, ZeRO-2 also g, ZeRO-3 also w.
Activations per layer ≈ s·b·h·(34 + 5·a·s/h) bytes in 16-bit without recomputation (Korthikanti
et al. 2022, eq. 2), doubled in fp32; plus the logits and their gradient, 2·b·s·V fp32 values.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from raypai.errors import TrainError
from raypai.train.config import PretrainConfig

GB = 1024**3


@dataclass(frozen=True)
class MemoryEstimate:
    zero_stage: int
    micro_batch: int
    grad_accum: int
    params_gb: float
    grads_gb: float
    optimizer_gb: float
    activations_gb: float

    @property
    def total_gb(self) -> float:
        return self.params_gb + self.grads_gb + self.optimizer_gb + self.activations_gb

    def as_dict(self) -> dict:
        return {**asdict(self), "total_gb": self.total_gb}

    def describe(self) -> str:
        return (
            f"≈ {self.total_gb:.3f} GB/worker (weights {self.params_gb:.3f}, grads {self.grads_gb:.3f}, "
            f"optimizer {self.optimizer_gb:.3f}, activations {self.activations_gb:.3f})"
        )


@dataclass(frozen=True)
class ModelShape:
    """The architecture the activation estimate needs. Read from the model actually trained
    (`ModelShape.of(model.config)`): with `model.init_from` that is the folder's config.json, whatever
    `cfg.model` says."""

    layers: int
    hidden: int
    heads: int
    vocab: int

    @classmethod
    def of(cls, hf_config) -> "ModelShape":
        return cls(
            hf_config.num_hidden_layers, hf_config.hidden_size, hf_config.num_attention_heads, hf_config.vocab_size
        )

    @classmethod
    def from_config(cls, cfg: PretrainConfig) -> "ModelShape":
        m = cfg.model
        return cls(m.layers, m.hidden, m.heads, max(m.vocab_size, 1))


def model_state_bytes(n_params: int, workers: int, stage: int, mixed_precision: bool) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes per worker, ZeRO §3."""
    w, g, k = (2.0, 2.0, 12.0) if mixed_precision else (4.0, 4.0, 8.0)
    if not mixed_precision and stage in (1, 2):
        k += 4.0  # DeepSpeed's fp32 partition copy: 4Ψ/N after the division below
    weights, grads, optim = w * n_params, g * n_params, k * n_params
    if stage >= 1:
        optim /= workers
    if stage >= 2:
        grads /= workers
    if stage >= 3:
        weights /= workers
    return weights, grads, optim


def activation_bytes(
    *, layers: int, hidden: int, heads: int, vocab: int, seq_len: int, micro_batch: int, mixed_precision: bool
) -> float:
    """Activations kept for the backward pass of one micro-batch (Korthikanti et al. 2022, eq. 2)."""
    per_layer = seq_len * micro_batch * hidden * (34 + 5 * heads * seq_len / hidden)
    per_layer *= 1 if mixed_precision else 2
    logits = 2 * 4.0 * micro_batch * seq_len * vocab  # fp32 logits and their gradient (B, T, V)
    return layers * per_layer + logits


def estimate(
    n_params: int, cfg: PretrainConfig, seq_len: int, stage: int, micro_batch: int, shape: ModelShape | None = None
) -> MemoryEstimate:
    """Per-worker bytes at this stage and micro-batch; `shape` defaults to `cfg.model`'s."""
    m = shape or ModelShape.from_config(cfg)
    weights, grads, optim = model_state_bytes(n_params, cfg.workers, stage, cfg.use_gpu)
    act = activation_bytes(
        layers=m.layers,
        hidden=m.hidden,
        heads=m.heads,
        vocab=m.vocab,
        seq_len=seq_len,
        micro_batch=micro_batch,
        mixed_precision=cfg.use_gpu,
    )
    return MemoryEstimate(stage, micro_batch, 1, weights / GB, grads / GB, optim / GB, act / GB)


def _micro_batches(target: int) -> list[int]:
    out = [target]
    while out[-1] > 1:
        out.append(out[-1] // 2)
    return out


def choose(
    n_params: int, cfg: PretrainConfig, seq_len: int, shape: ModelShape | None = None
) -> tuple[PretrainConfig, MemoryEstimate]:
    """The largest micro-batch (at most the requested blocks per step) that fits `memory_budget_gb`,
    at the lowest ZeRO stage that makes it fit; gradient accumulation keeps the global batch.

    Larger micro-batches keep the matmuls efficient, while ZeRO-1/2 cost no extra communication
    over plain data parallelism (ZeRO §7: reduce-scatter + all-gather = one all-reduce's volume),
    so a higher stage 1/2 is preferred to a smaller micro-batch. ZeRO-3 moves 1.5× the data (it
    gathers every module's weights in the forward and again in the backward) and is tried last, on
    GPUs and CPUs alike."""
    target = cfg.micro_batch * cfg.grad_accum
    candidates = [(stage, mb) for mb in _micro_batches(target) for stage in (0, 1, 2)]
    candidates += [(3, mb) for mb in _micro_batches(target)]
    for stage, mb in candidates:
        est = estimate(n_params, cfg, seq_len, stage, mb, shape)
        if est.total_gb <= cfg.memory_budget_gb:
            accum = -(-target // mb)
            return replace(cfg, zero_stage=stage, micro_batch=mb, grad_accum=accum), replace(est, grad_accum=accum)
    last_stage = candidates[-1][0]
    smallest = estimate(n_params, cfg, seq_len, last_stage, 1, shape)
    raise TrainError(
        f"the model ({n_params / 1e6:.1f}M parameters, sequence {seq_len}) does not fit "
        f"memory_budget_gb={cfg.memory_budget_gb} per worker even at ZeRO-{last_stage} with micro-batch 1 "
        f"({smallest.describe()}); use a smaller model, more workers, or a larger memory_budget_gb"
    )


def check_fits(n_params: int, cfg: PretrainConfig, seq_len: int, shape: ModelShape | None = None) -> MemoryEstimate:
    """The estimate of a manual config, or a TrainError naming what to change."""
    est = estimate(n_params, cfg, seq_len, cfg.zero_stage, cfg.micro_batch, shape)
    if est.total_gb > cfg.memory_budget_gb:
        raise TrainError(
            f"this config needs {est.describe()} but memory_budget_gb={cfg.memory_budget_gb}; lower micro_batch "
            "(and raise grad_accum), raise zero_stage, or set strategy='auto'"
        )
    return est
