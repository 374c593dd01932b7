"""Objectives: what one optimizer step of a trainer role minimises, one per algorithm and model.

A trainer role (`raypai.alignment.roles.trainer.Trainer`) knows placement, devices and DeepSpeed;
it knows no algorithm. Each step it is handed an objective from here and the step's inputs:

    batch = objective.assemble(*inputs, held=...)   # host tensors; None: nothing to learn this step
    out = objective.loss(model, batch)              # Loss(total, normaliser, stats)
    (out.total / out.normaliser).backward()

`model` is the role's forward passes, with gradients (`Model`). `Loss.total` is the loss summed
over the batch's units (response tokens, sequences, pairs) and `Loss.normaliser` counts those
units, so a batch split across data-parallel ranks or micro-batches sums to the same update: the
role divides each share's total by the normaliser summed over all shares (`units(batch)` gives it
from the batch alone, before any forward pass, for micro-batches; an objective without it runs a
rank's share in one pass). Every tensor of an assembled batch has its rows first, so a share is a
slice of rows (`roles._ranks.share`): whatever couples rows (GRPO's group-normalised advantages,
DPO's pairs, PPO's GAE) is computed in `assemble`, on the whole batch. `assemble` takes what Ray hands the role — the rollout replicas' outputs, the Reward actor's
scores, rows of data held on the role — so no batch goes through the driver.

Objectives are frozen dataclasses: picklable, compared by value, and a new algorithm is a new one
here (and its driver), with no change to the roles.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from raypai.alignment.losses.dpo import ChosenRejected, dpo_loss
from raypai.alignment.losses.grpo import AGGREGATIONS, grpo_advantages, k3_kl
from raypai.alignment.losses.ppo import clipped_surrogate, clipped_value_terms, masked_mean, ppo_targets
from raypai.alignment.losses.reward import bradley_terry_loss


class Model(Protocol):
    """The forward passes a trainer role gives an objective (training mode, with gradients)."""

    def logprobs(self, batch: dict, where: torch.Tensor | None = None) -> torch.Tensor:
        """(B, T−1) log p of each next token; with `where`, only those positions (0 elsewhere)."""

    def values(self, batch: dict) -> torch.Tensor:
        """(B, T−1) value of the state before each label position (a token-value head)."""

    def scores(self, batch: dict) -> torch.Tensor:
        """(B,) scalar score of each sequence (a sequence-score head)."""


@dataclass
class Loss:
    total: torch.Tensor  # 0-d: the loss summed over the batch's units
    normaliser: torch.Tensor | float  # how many units (the step minimises total / normaliser)
    stats: dict = field(default_factory=dict)  # name → 0-d tensor or float, for logging


def aggregate_sum(
    per_token: torch.Tensor, mask: torch.Tensor, mode: str, max_new_tokens: int | None = None
) -> tuple[torch.Tensor, torch.Tensor | float]:
    """(sum, normaliser) of a (B, T) per-token loss under GRPO's aggregation `mode`
    (`losses.grpo.aggregate` is sum / normaliser): grpo, a mean per sequence summed over the B
    sequences, over B; bnpo/dapo, the sum over tokens, over the token count; dr_grpo, the sum over
    tokens, over B · max_new_tokens."""
    mask = mask.to(per_token.dtype)
    summed = per_token * mask
    if mode == "grpo":
        return (summed.sum(1) / mask.sum(1).clamp(min=1)).sum(), per_token.shape[0]
    if mode in ("bnpo", "dapo"):
        return summed.sum(), mask.sum()
    if mode == "dr_grpo":
        return summed.sum(), per_token.shape[0] * (max_new_tokens or per_token.shape[1])
    raise ValueError(f"unknown loss aggregation {mode!r}; choose one of {', '.join(AGGREGATIONS)}")


def _on(mask: torch.Tensor, x: torch.Tensor | None) -> torch.Tensor | None:
    """x where the mask is set, 0 elsewhere (where the policy's own log-probs are 0 as well, so the
    ratio there is exp(0) and not exp(−old): padding labels can be very unlikely)."""
    return None if x is None else torch.where(mask > 0, x, torch.zeros_like(x))


def _entropy(lp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # −mean log π of the sampled tokens: a Monte-Carlo estimate of the per-token entropy
    return -masked_mean(lp.detach(), mask)


@dataclass(frozen=True)
class SFT:
    """Negative log-likelihood of the response tokens; with pretraining blocks (`ptx`) plus
    ptx_coef × their language-modelling loss (InstructGPT's "PPO-ptx" mix, Ouyang et al. 2022
    eq. 2, used here to keep SFT from erasing what pretraining learned)."""

    ptx_coef: float = 0.0

    def assemble(self, batch: dict, ptx: torch.Tensor | None = None, *, held: dict | None = None) -> dict:
        out = {"seq": batch}
        if ptx is not None and self.ptx_coef > 0:
            out["ptx"] = {"input_ids": ptx, "attention_mask": torch.ones_like(ptx)}
        return out

    def units(self, batch: dict) -> torch.Tensor:
        return batch["seq"]["response_mask"].sum()

    def loss(self, model: Model, batch: dict) -> Loss:
        seq = batch["seq"]
        m = seq["response_mask"]
        nll = -(model.logprobs(seq, m) * m).sum()
        n = m.sum()
        stats = {"loss": (nll / n).detach()}
        if "ptx" in batch:
            lm = -model.logprobs(batch["ptx"]).mean()
            nll = nll + self.ptx_coef * lm * n
            stats["ptx_loss"] = lm.detach()
        return Loss(nll, n, stats)


@dataclass(frozen=True)
class DPO:
    """DPO on (chosen, rejected) pairs with their reference log-probs (`losses.dpo.dpo_loss`).
    `assemble` takes the pairs' tensors, or the rows `idx` of the pairs held on the role
    (`Trainer.hold("pairs", (chosen, rejected, ref_chosen, ref_rejected))`)."""

    beta: float = 0.1
    loss_type: str = "sigmoid"
    label_smoothing: float = 0.0

    def assemble(self, *inputs, held: dict | None = None) -> dict:
        if len(inputs) == 1:  # rows of the held pairs
            from raypai.alignment._tensors import select_rows

            chosen, rejected, ref_c, ref_r = held["pairs"]
            idx = torch.as_tensor(inputs[0])
            inputs = (select_rows(chosen, idx), select_rows(rejected, idx), ref_c[idx], ref_r[idx])
        chosen, rejected, ref_c, ref_r = inputs
        return {"chosen": chosen, "rejected": rejected, "ref_chosen": ref_c, "ref_rejected": ref_r}

    def units(self, batch: dict) -> int:
        return batch["chosen"]["input_ids"].shape[0]

    def loss(self, model: Model, batch: dict) -> Loss:
        from raypai.alignment._tensors import sequence_logprob, stack_right_padded

        chosen, rejected = batch["chosen"], batch["rejected"]
        # one forward over chosen and rejected rows together (right padding leaves each row's
        # log-probs as they are alone): half the forward/backward calls of two separate passes
        both = stack_right_padded(chosen, rejected)
        seq = sequence_logprob(model.logprobs(both, both["response_mask"]), both["response_mask"])
        n = chosen["input_ids"].shape[0]
        lengths = ChosenRejected(chosen["response_mask"].sum(1), rejected["response_mask"].sum(1))
        out = dpo_loss(
            ChosenRejected(seq[:n], seq[n:]),
            ChosenRejected(batch["ref_chosen"], batch["ref_rejected"]),
            beta=self.beta,
            loss_type=self.loss_type,
            label_smoothing=self.label_smoothing,
            lengths=lengths,
        )
        # dpo_loss is the mean over the n pairs: their sum is n times it
        return Loss(out.loss * n, n, {"accuracy": out.accuracy, "margin": out.margin})


@dataclass(frozen=True)
class OnlineDPO:
    """DPO on online DPO's pairs of a generation as Ray hands it over: per group of samples of one
    prompt the best-scored is chosen and the worst rejected (`_loop.ranked_pairs` of the rollout's
    outputs and the Reward actor's scores), the Reference's log-probs of the same pairs beside
    them. No pairs (every group tied): nothing to learn, no update."""

    dpo: DPO = DPO()

    def assemble(self, scores: dict, ref: tuple | None, sampled: dict, *outs: dict, held: dict | None = None):
        from raypai.alignment._loop import ranked_pairs

        pairs = ranked_pairs(scores, sampled, *outs)
        if pairs is None:
            return None
        return self.dpo.assemble(*pairs, *ref)

    def units(self, batch: dict) -> int:
        return self.dpo.units(batch)

    def loss(self, model: Model, batch: dict) -> Loss:
        out = self.dpo.loss(model, batch)
        out.stats["pairs"] = float(batch["chosen"]["input_ids"].shape[0])
        return out


@dataclass(frozen=True)
class GRPO:
    """GRPO's clipped, KL-regularised policy loss (`losses.grpo`, Shao et al. 2024 eq. 3) with
    group-normalised advantages of the Reward actor's scores. `old_lp` None: μ = 1, the ratio is
    taken against the policy's own detached log-probs (ratio 1, the plain policy gradient)."""

    group_size: int = 8
    clip_eps: float = 0.2
    clip_eps_high: float | None = None
    beta: float = 0.0
    aggregation: str = "dapo"
    max_new_tokens: int | None = None  # dr_grpo's constant normaliser

    def assemble(
        self,
        scores: dict,
        sampled: dict,
        *outs: dict,
        old_lp: torch.Tensor | None = None,
        ref_lp: torch.Tensor | None = None,
        held: dict | None = None,
    ) -> dict:
        from raypai.alignment._loop import handed_over, to_tensor

        advantages = grpo_advantages(to_tensor(scores["total"]), self.group_size)
        return {"seq": handed_over(sampled, outs), "advantages": advantages, "old_lp": old_lp, "ref_lp": ref_lp}

    def units(self, batch: dict):
        m = batch["seq"]["response_mask"]
        return aggregate_sum(torch.zeros_like(m, dtype=torch.float32), m, self.aggregation, self.max_new_tokens)[1]

    def loss(self, model: Model, batch: dict) -> Loss:
        seq = batch["seq"]
        m = seq["response_mask"]
        lp = model.logprobs(seq, m)
        old = lp.detach() if batch["old_lp"] is None else _on(m, batch["old_lp"])
        ref = _on(m, batch["ref_lp"])
        per_token, clipped = clipped_surrogate(
            lp, old, batch["advantages"].unsqueeze(1), clip_eps=self.clip_eps, clip_eps_high=self.clip_eps_high
        )  # (B, 1): one advantage for every token of a completion
        kl = k3_kl(lp, ref) if ref is not None else torch.zeros_like(lp)
        if self.beta:
            per_token = per_token + self.beta * kl
        total, n = aggregate_sum(per_token, m, self.aggregation, self.max_new_tokens)
        stats = {
            "clip_fraction": masked_mean(clipped.to(lp.dtype), m).detach(),
            "kl": masked_mean(kl.detach(), m),
            "entropy": _entropy(lp, m),
        }
        return Loss(total, n, stats)


def _ppo_inputs(scores, old_lp, ref_lp, values, sampled, outs, targets: dict):
    from raypai.alignment._loop import handed_over, to_tensor

    seq = handed_over(sampled, outs)
    adv, returns = ppo_targets(to_tensor(scores["total"]), old_lp, ref_lp, values, seq["response_mask"], **targets)
    return seq, adv, returns


@dataclass(frozen=True)
class PPOPolicy:
    """PPO's clipped surrogate (Schulman et al. 2017) with per-token GAE advantages computed from
    the Reward actor's scores, the rollout's and reference's log-probs and the critic's values
    (`losses.ppo_targets`; both trainers compute them from the same inputs), token-mean."""

    clip_eps: float = 0.2
    kl_coef: float = 0.05
    gamma: float = 1.0
    lam: float = 0.95

    def assemble(self, scores, old_lp, ref_lp, values, sampled, *outs, held: dict | None = None) -> dict:
        targets = {"kl_coef": self.kl_coef, "gamma": self.gamma, "lam": self.lam}
        seq, adv, _ = _ppo_inputs(scores, old_lp, ref_lp, values, sampled, outs, targets)
        return {"seq": seq, "old_lp": old_lp, "advantages": adv}

    def units(self, batch: dict) -> torch.Tensor:
        return batch["seq"]["response_mask"].sum()

    def loss(self, model: Model, batch: dict) -> Loss:
        seq = batch["seq"]
        m = seq["response_mask"]
        lp = model.logprobs(seq, m)
        per_token, clipped = clipped_surrogate(lp, _on(m, batch["old_lp"]), batch["advantages"], clip_eps=self.clip_eps)
        stats = {"clip_fraction": masked_mean(clipped.float(), m).detach(), "entropy": _entropy(lp, m)}
        return Loss((per_token * m).sum(), m.sum(), stats)


@dataclass(frozen=True)
class PPOValue:
    """The critic's clipped value loss (`losses.ppo.clipped_value_loss`, PPO2's value clipping)
    against the GAE returns of the same inputs as the policy's advantages, token-mean. `assemble`
    with one ready batch ({"seq", "old_values", "returns"}) takes it as it is."""

    clip: float = 0.2
    kl_coef: float = 0.05
    gamma: float = 1.0
    lam: float = 0.95

    def assemble(self, *inputs, held: dict | None = None) -> dict:
        if len(inputs) == 1:
            return inputs[0]
        scores, old_lp, ref_lp, values, sampled, *outs = inputs
        targets = {"kl_coef": self.kl_coef, "gamma": self.gamma, "lam": self.lam}
        seq, _, returns = _ppo_inputs(scores, old_lp, ref_lp, values, sampled, outs, targets)
        return {"seq": seq, "old_values": values, "returns": returns}

    def units(self, batch: dict) -> torch.Tensor:
        return batch["seq"]["response_mask"].sum()

    def loss(self, model: Model, batch: dict) -> Loss:
        seq = batch["seq"]
        m = seq["response_mask"]
        per_token = clipped_value_terms(model.values(seq), batch["old_values"], batch["returns"], self.clip)
        return Loss((per_token * m).sum(), m.sum())


@dataclass(frozen=True)
class BradleyTerry:
    """The reward model's loss on preference pairs (`losses.reward.bradley_terry_loss`; Ouyang et
    al. 2022 eq. 1, margin as Llama 2 §3.2.2). `assemble` takes rows `idx` of the pairs held on the
    role (`Trainer.hold("pairs", (chosen, rejected))`) or the two batches."""

    margin: float = 0.0

    def assemble(self, *inputs, held: dict | None = None) -> dict:
        if len(inputs) == 1:
            from raypai.alignment._tensors import select_rows

            chosen, rejected = held["pairs"]
            idx = torch.as_tensor(inputs[0])
            inputs = (select_rows(chosen, idx), select_rows(rejected, idx))
        return {"chosen": inputs[0], "rejected": inputs[1]}

    def units(self, batch: dict) -> int:
        return batch["chosen"]["input_ids"].shape[0]

    def loss(self, model: Model, batch: dict) -> Loss:
        n = batch["chosen"]["input_ids"].shape[0]
        loss, accuracy = bradley_terry_loss(model.scores(batch["chosen"]), model.scores(batch["rejected"]), self.margin)
        return Loss(loss * n, n, {"train_accuracy": accuracy.detach()})  # the mean over n pairs: n times it summed
