"""The generic trainer role takes any objective: a new one (defined here, in a test) trains with no
change to `roles/`; the objectives' loss sums and normalisers add up across a split batch."""

from dataclasses import dataclass

import pytest
import torch

from raypai.alignment._tensors import pad
from raypai.alignment.losses.objectives import DPO, GRPO, SFT, Loss
from raypai.alignment.roles.trainer import Trainer


def _batch(lengths: list[int], prompt: int = 5, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    seqs = [list(range(3, 3 + prompt)) + torch.randint(20, 200, (n,), generator=g).tolist() for n in lengths]
    return pad(seqs, [[0] * prompt + [1] * n for n in lengths], 0)


@dataclass(frozen=True)
class Unlikelihood:
    """A test-only objective: push the response tokens' log-probs *down* (the opposite of SFT)."""

    def assemble(self, batch: dict, *, held=None) -> dict:
        return {"seq": batch}

    def loss(self, model, batch: dict) -> Loss:
        m = batch["seq"]["response_mask"]
        lp = model.logprobs(batch["seq"], m)
        return Loss((lp * m).sum(), m.sum(), {"mean_logprob": (lp * m).sum().detach() / m.sum()})


def _mean_lp(trainer: Trainer, batch: dict) -> float:
    m = batch["response_mask"]
    return float((trainer.logprobs(batch) * m).sum() / m.sum())


def test_a_new_objective_trains_through_the_generic_role(tiny_model):
    batch = _batch([4, 6, 3])
    toy, sft = Trainer(tiny_model, 1e-2, seed=0), Trainer(tiny_model, 1e-2, seed=0)
    start = _mean_lp(toy, batch)
    assert start == pytest.approx(_mean_lp(sft, batch))
    for _ in range(3):
        m = toy.update_on(Unlikelihood(), batch)
        sft.update_on(SFT(), batch)
    assert set(m) >= {"loss", "mean_logprob", "grad_norm", "policy_version", "update_seconds"}
    assert m["policy_version"] == 2 and toy.version() == 3
    # the toy objective lowered the response log-probs; SFT, on the same batch, raised them
    assert _mean_lp(toy, batch) < start - 0.05
    assert _mean_lp(sft, batch) > start + 0.05


@pytest.mark.parametrize("aggregation", ["grpo", "bnpo", "dapo", "dr_grpo"])
def test_grpo_loss_sums_over_groups_split_across_ranks_equal_the_whole_batch(tiny_model, aggregation):
    """Two ranks holding whole groups: (total₁ + total₂) / (n₁ + n₂) is the whole batch's loss."""
    trainer = Trainer(tiny_model, 1e-3)
    lengths = [2, 5, 3, 6, 4, 1, 5, 2]  # 4 groups of 2
    g = torch.Generator().manual_seed(1)
    adv = torch.randn(8, generator=g)
    whole = _batch(lengths, seed=3)
    old = -torch.rand(whole["response_mask"].shape, generator=g)
    obj = GRPO(group_size=2, beta=0.04, aggregation=aggregation, max_new_tokens=6)

    def loss(rows: list[int]) -> Loss:
        seq = {k: v[rows] for k, v in whole.items()}
        batch = {"seq": seq, "advantages": adv[rows], "old_lp": old[rows], "ref_lp": old[rows] - 0.1}
        with torch.no_grad():
            return obj.loss(trainer._forward, batch)

    full, a, b = loss(list(range(8))), loss([0, 1, 2, 3]), loss([4, 5, 6, 7])
    split = (a.total + b.total) / (a.normaliser + b.normaliser)
    assert torch.allclose(split, full.total / full.normaliser, atol=1e-6)
    # a split that is not the batch's (a rank's rows counted twice) gives another value: the check can fail
    twice = (a.total + a.total) / (a.normaliser + a.normaliser)
    assert not torch.allclose(twice, full.total / full.normaliser, atol=1e-4)


def test_dpo_and_sft_loss_sums_add_up_across_pairs_and_rows(tiny_model):
    trainer = Trainer(tiny_model, 1e-3)
    chosen, rejected = _batch([3, 5, 2, 4], seed=4), _batch([4, 2, 6, 1], seed=5)
    ref_c, ref_r = -torch.rand(4) * 5, -torch.rand(4) * 5
    dpo = DPO(beta=0.1)

    def rows(b, idx):
        return {k: v[idx] for k, v in b.items()}

    with torch.no_grad():
        full = dpo.loss(trainer._forward, dpo.assemble(chosen, rejected, ref_c, ref_r))
        parts = [
            dpo.loss(trainer._forward, dpo.assemble(rows(chosen, i), rows(rejected, i), ref_c[i], ref_r[i]))
            for i in ([0, 1], [2, 3])
        ]
        assert torch.allclose(sum(p.total for p in parts) / sum(p.normaliser for p in parts), full.total / 4)
        sft_full = SFT().loss(trainer._forward, SFT().assemble(chosen))
        sft_parts = [SFT().loss(trainer._forward, SFT().assemble(rows(chosen, i))) for i in ([0], [1, 2, 3])]
    summed = sum(p.total for p in sft_parts) / sum(p.normaliser for p in sft_parts)
    assert torch.allclose(summed, sft_full.total / sft_full.normaliser, atol=1e-6)
    # a mean of the parts' means is not the token mean (the rows have different lengths): normalisers matter
    mean_of_means = sum(p.total / p.normaliser for p in sft_parts) / 2
    assert not torch.allclose(mean_of_means, sft_full.total / sft_full.normaliser, atol=1e-4)


def test_sync_spread_reports_the_median_p99_and_share_of_the_sync():
    from raypai.alignment._loop import sync_spread

    history = [{"sync_seconds": s, "step_seconds": 1.0} for s in [0.01] * 98 + [0.05, 2.0]]
    out = sync_spread(history)
    assert out["p50_sync_seconds"] == 0.01
    assert out["p99_sync_seconds"] == 0.05  # the 99th of 100 by nearest rank: one outlier is not p99
    assert out["sync_share"] == pytest.approx((0.98 + 0.05 + 2.0) / 100)
    spiky = sync_spread([{"sync_seconds": s, "step_seconds": 1.0} for s in [0.01] * 90 + [0.9] * 10])
    assert spiky["p99_sync_seconds"] == 0.9 and spiky["p99_sync_seconds"] > 2 * spiky["p50_sync_seconds"]
    assert sync_spread([{"loss": 1.0}]) == {}
