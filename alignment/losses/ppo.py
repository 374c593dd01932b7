"""PPO for RLHF (Ouyang et al. 2022 §3.5; Schulman et al. 2017): KL-penalised token rewards, GAE,
the clipped policy surrogate and the clipped value loss. All tensors are (B, T) over the label
positions of a batch; `mask` is 1 on completion tokens."""

from __future__ import annotations

import torch


def clipped_surrogate(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO loss −min(ρ·Â, clip(ρ, 1−ε, 1+ε_high)·Â), ρ = exp(logp − old_logp)
    (Schulman et al. 2017, eq. 7; the asymmetric ε_high is DAPO's clip-higher, Yu et al. 2025 §3.1).
    `advantages` broadcasts: (B, 1) for one advantage per sequence, (B, T) per token.
    Returns (loss (B, T), clipped (B, T) bool: where the ratio left the trust region)."""
    hi = clip_eps if clip_eps_high is None else clip_eps_high
    ratio = torch.exp(logp - old_logp)
    per_token = -torch.min(ratio * advantages, torch.clamp(ratio, 1 - clip_eps, 1 + hi) * advantages)
    return per_token, (ratio < 1 - clip_eps) | (ratio > 1 + hi)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = mask.to(x.dtype)
    return (x * m).sum() / m.sum().clamp(min=1)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x − mean)/std over the masked entries (advantage normalisation, as in OpenAI's
    lm-human-preferences); zero outside the mask."""
    m = mask.to(x.dtype)
    mean = masked_mean(x, m)
    var = masked_mean((x - mean) ** 2, m)
    return (x - mean) * torch.rsqrt(var + eps) * m


def kl_penalized_rewards(
    score: torch.Tensor, logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor, kl_coef: float
) -> torch.Tensor:
    """Per-token rewards (B, T): −β·(logπ − logπ_ref) at every completion token (the k1 KL
    estimate), plus the sequence score (B,) at its last token (Stiennon et al. 2020, eq. 2;
    Ouyang et al. 2022, eq. 2)."""
    rewards = -kl_coef * (logp - ref_logp) * mask
    last = mask.long().cumsum(1).argmax(1)  # first index where the running count peaks = last completion token
    rewards[torch.arange(len(score), device=rewards.device), last] += score
    return rewards


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, lam: float = 0.95
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2016, eq. 16):
    δ_t = r_t + γ·V_{t+1} − V_t,  Â_t = δ_t + γλ·Â_{t+1}; returns R_t = Â_t + V_t.
    V after the last completion token is 0 (the episode ends). Returns (advantages, returns), (B, T)."""
    mask = mask.to(rewards.dtype)
    adv = torch.zeros_like(rewards)
    running = rewards.new_zeros(rewards.shape[0])  # on the inputs' device and dtype
    T = rewards.shape[1]
    for t in reversed(range(T)):
        cont = mask[:, t + 1] if t + 1 < T else torch.zeros_like(running)  # 1 while the episode goes on
        next_v = values[:, t + 1] * cont if t + 1 < T else torch.zeros_like(running)
        delta = rewards[:, t] + gamma * next_v - values[:, t]
        running = delta + gamma * lam * running * cont
        adv[:, t] = running * mask[:, t]
    return adv, (adv + values) * mask


def clipped_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, clip: float = 0.2
) -> torch.Tensor:
    """½·max((V − R)², (V_old + clip(V − V_old, ±c) − R)²), token-mean over the mask (the value
    clipping of OpenAI baselines' PPO2, used by InstructGPT-style RLHF)."""
    return masked_mean(clipped_value_terms(values, old_values, returns, clip), mask)


def clipped_value_terms(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float = 0.2
) -> torch.Tensor:
    """(B, T) per-token terms of `clipped_value_loss`, before the token-mean."""
    clipped = old_values + torch.clamp(values - old_values, -clip, clip)
    return 0.5 * torch.max((values - returns) ** 2, (clipped - returns) ** 2)


def ppo_targets(
    score: torch.Tensor,
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    kl_coef: float,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A PPO step's (whitened advantages, returns), both (B, T): the KL-penalised token rewards
    (`kl_penalized_rewards`) through GAE (`gae`), the advantages whitened over the completion tokens
    (`masked_whiten`). Deterministic, so the policy and the critic each compute it from the same inputs."""
    adv, returns = gae(kl_penalized_rewards(score, logp, ref_logp, mask, kl_coef), values, mask, gamma, lam)
    return masked_whiten(adv, mask), returns
