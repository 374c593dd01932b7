"""GRPO (Shao et al. 2024, DeepSeekMath §4.1) and its loss-aggregation variants.

Advantages (§4.1.2, outcome supervision, eq. in the text): Â_i = (r_i − mean(r_group)) / (std(r_group) + ε),
the same for every token of completion i. Per-token objective (eq. 3): PPO's clipped ratio
(`raypai.alignment.losses.ppo.clipped_surrogate`) plus β times the k3 KL estimator (eq. 4;
Schulman 2020, "Approximating KL divergence"): KL ≈ e^(ref−π) − (ref−π) − 1.
Aggregation modes (the names TRL's `loss_type` uses):
  grpo    — mean over each sequence's tokens, then over sequences (eq. 3 as written)
  bnpo    — mean over all completion tokens of the batch
  dr_grpo — sum over tokens / (B · max_new_tokens) (Liu et al. 2025, "Understanding R1-Zero-like training", Dr. GRPO)
  dapo    — token-mean over the batch (Yu et al. 2025, DAPO eq. 8); within one batch it equals bnpo
"""

from __future__ import annotations

import torch

from raypai.alignment.losses.ppo import clipped_surrogate, masked_mean


def grpo_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-4, scale: bool = True) -> torch.Tensor:
    """rewards: (B,) laid out group by group (B = prompts × group_size). Returns (B,).
    A group whose rewards are all equal gets advantage 0 everywhere. `scale=False` is Dr. GRPO's
    mean-centering without the std division."""
    grouped = rewards.view(-1, group_size)  # (P, G)
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    if scale:
        centered = centered / (grouped.std(dim=1, keepdim=True, unbiased=True) + eps)
    return centered.reshape(-1)


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(π‖ref) from samples of π: exp(ref−π) − (ref−π) − 1 ≥ 0."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


AGGREGATIONS = ("grpo", "bnpo", "dr_grpo", "dapo")


def aggregate(
    per_token: torch.Tensor, mask: torch.Tensor, mode: str, max_new_tokens: int | None = None
) -> torch.Tensor:
    """Reduce a (B, T) per-token loss with a (B, T) 0/1 mask to a scalar. `max_new_tokens`: dr_grpo's
    constant length (the config's sampling limit); None = T."""
    mask = mask.to(per_token.dtype)
    if mode == "grpo":
        return ((per_token * mask).sum(1) / mask.sum(1).clamp(min=1)).mean()
    if mode in ("bnpo", "dapo"):
        return masked_mean(per_token, mask)
    if mode == "dr_grpo":
        return (per_token * mask).sum() / (per_token.shape[0] * (max_new_tokens or per_token.shape[1]))
    raise ValueError(f"unknown loss aggregation {mode!r}; choose one of {', '.join(AGGREGATIONS)}")


def grpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    beta: float = 0.0,
    aggregation: str = "grpo",
    max_new_tokens: int | None = None,
) -> tuple[torch.Tensor, dict]:
    """logp/old_logp/ref_logp/mask: (B, T) over completion tokens; advantages: (B,).
    Returns (scalar loss, {"clip_fraction", "kl"}) — the stats as detached 0-d tensors on the inputs'
    device (no host sync here; the caller turns them into floats for logging)."""
    per_token, clipped = clipped_surrogate(
        logp, old_logp, advantages.unsqueeze(1), clip_eps=clip_eps, clip_eps_high=clip_eps_high
    )  # (B, 1) advantage for every token
    kl = k3_kl(logp, ref_logp) if ref_logp is not None else torch.zeros_like(logp)
    if beta:
        per_token = per_token + beta * kl
    loss = aggregate(per_token, mask, aggregation, max_new_tokens)
    stats = {"clip_fraction": masked_mean(clipped.to(logp.dtype), mask).detach(), "kl": masked_mean(kl.detach(), mask)}
    return loss, stats
