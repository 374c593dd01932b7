"""Losses and advantages on hand-written tensors; each expected value is derived in the docstring."""

import math

import pytest
import torch

from raypai.alignment.losses import (
    ChosenRejected,
    aggregate,
    bradley_terry_loss,
    clipped_surrogate,
    clipped_value_loss,
    dpo_loss,
    gae,
    grpo_advantages,
    grpo_loss,
    k3_kl,
    kl_penalized_rewards,
    masked_whiten,
)


def test_dpo_sigmoid_ipo_hinge_and_label_smoothing():
    """π_c − π_r = (−1) − (−3) = 2, ref_c − ref_r = (−2) − (−2) = 0 → h = 2.
    sigmoid, β = 0.5: −log σ(1) = log(1 + e^−1) = 0.31326.
    cDPO ε = 0.1: 0.9·0.31326 + 0.1·log(1 + e^1) = 0.28193 + 0.13133 = 0.41326.
    IPO, β = 0.5: (2 − 1)² = 1.  hinge, β = 0.5: max(0, 1 − 1) = 0.
    Implicit rewards: chosen β·(−1 + 2) = 0.5, rejected β·(−3 + 2) = −0.5 → margin 1, accuracy 1."""
    pol = ChosenRejected(torch.tensor([-1.0]), torch.tensor([-3.0]))
    ref = ChosenRejected(torch.tensor([-2.0]), torch.tensor([-2.0]))
    out = dpo_loss(pol, ref, beta=0.5)
    assert out.loss.item() == pytest.approx(math.log1p(math.exp(-1)), abs=1e-6)
    assert dpo_loss(pol, ref, beta=0.5, label_smoothing=0.1).loss.item() == pytest.approx(
        0.9 * math.log1p(math.exp(-1)) + 0.1 * math.log1p(math.e), abs=1e-6
    )
    one = ChosenRejected(torch.tensor([1.0]), torch.tensor([1.0]))  # one-token responses: mean = sum
    assert dpo_loss(pol, ref, beta=0.5, loss_type="ipo", lengths=one).loss.item() == pytest.approx(1.0)
    assert dpo_loss(pol, ref, beta=0.5, loss_type="hinge").loss.item() == pytest.approx(0.0)
    assert out.margin == pytest.approx(1.0) and out.accuracy == 1.0
    with pytest.raises(ValueError, match="sigmoid, ipo, hinge"):
        dpo_loss(pol, ref, loss_type="kto")


def test_ipo_uses_per_token_mean_log_ratios_on_unequal_lengths():
    """Chosen: 4 tokens, log-ratio π_c − ref_c = (−4) − (−8) = 4 → mean 1 per token.
    Rejected: 2 tokens, log-ratio (−6) − (−4) = −2 → mean −1 per token. h̄ = 1 − (−1) = 2.
    β = 0.5: (2 − 1/(2·0.5))² = (2 − 1)² = 1. The summed form would give h = 4 + 2 = 6 → 25, and
    doubling both lengths with the same per-token ratios must not change the averaged loss."""
    pol = ChosenRejected(torch.tensor([-4.0]), torch.tensor([-6.0]))
    ref = ChosenRejected(torch.tensor([-8.0]), torch.tensor([-4.0]))
    lengths = ChosenRejected(torch.tensor([4.0]), torch.tensor([2.0]))
    assert dpo_loss(pol, ref, beta=0.5, loss_type="ipo", lengths=lengths).loss.item() == pytest.approx(1.0)
    doubled = dpo_loss(
        ChosenRejected(pol.chosen * 2, pol.rejected * 2),
        ChosenRejected(ref.chosen * 2, ref.rejected * 2),
        beta=0.5,
        loss_type="ipo",
        lengths=ChosenRejected(lengths.chosen * 2, lengths.rejected * 2),
    )
    assert doubled.loss.item() == pytest.approx(1.0)
    with pytest.raises(ValueError, match="needs the response lengths"):
        dpo_loss(pol, ref, beta=0.5, loss_type="ipo")


def test_bradley_terry_with_margin():
    """r_w − r_l = 2 − 1 = 1, margin 1 → −log σ(0) = log 2; second pair 0 − 1 − 1 = −2 → log(1 + e²).
    Mean = (0.693147 + 2.126928)/2 = 1.410038; accuracy 1/2."""
    loss, acc = bradley_terry_loss(torch.tensor([2.0, 0.0]), torch.tensor([1.0, 1.0]), margin=1.0)
    assert loss.item() == pytest.approx((math.log(2) + math.log1p(math.e**2)) / 2, abs=1e-6)
    assert acc.item() == 0.5


def test_grpo_advantages_including_all_equal_groups():
    """Group [1, 0, 0, 1]: mean 0.5, unbiased std √(4·0.25/3) = 0.57735 → ±0.866 (ε negligible).
    Group [1, 1, 1, 1]: all equal → every advantage 0 (no learning signal, no division blow-up)."""
    adv = grpo_advantages(torch.tensor([1.0, 0, 0, 1, 1, 1, 1, 1]), group_size=4, eps=0.0 + 1e-12)
    assert adv[:4].tolist() == pytest.approx([0.866025, -0.866025, -0.866025, 0.866025], abs=1e-5)
    assert adv[4:].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert grpo_advantages(torch.tensor([2.0, 0.0]), 2, scale=False).tolist() == [1.0, -1.0]


def test_k3_kl_by_hand():
    """π = ref → 0. ref − π = log 2: e^{log 2} − log 2 − 1 = 1 − 0.693147 = 0.306853."""
    lp = torch.tensor([[-1.0, -1.0]])
    ref = torch.tensor([[-1.0, -1.0 + math.log(2)]])
    assert k3_kl(lp, ref).tolist()[0] == pytest.approx([0.0, 1 - math.log(2)], abs=1e-6)


def test_aggregation_modes():
    """per-token [[1, 2, 3], [4, 0, 0]], mask [[1,1,1],[1,0,0]]:
    grpo = mean(mean(1,2,3), mean(4)) = (2 + 4)/2 = 3; bnpo = dapo = (1+2+3+4)/4 = 2.5;
    dr_grpo = 10 / (2 rows · 3 max len) = 1.6667."""
    x = torch.tensor([[1.0, 2, 3], [4, 0, 0]])
    m = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert aggregate(x, m, "grpo").item() == pytest.approx(3.0)
    assert aggregate(x, m, "bnpo").item() == pytest.approx(2.5)
    assert aggregate(x, m, "dapo").item() == pytest.approx(2.5)
    assert aggregate(x, m, "dr_grpo").item() == pytest.approx(10 / 6)
    with pytest.raises(ValueError, match="grpo, bnpo, dr_grpo, dapo"):
        aggregate(x, m, "mean")


def test_grpo_loss_clips_the_ratio():
    """One token, advantage +1, ratio e^{0.5} = 1.6487 > 1 + 0.2 → clipped objective 1.2 → loss −1.2,
    clip fraction 1. With ε_high = 1.0 the ratio is inside the range → loss −1.6487."""
    lp, old = torch.tensor([[0.0]]), torch.tensor([[-0.5]])
    m = torch.ones(1, 1)
    loss, stats = grpo_loss(lp, old, None, torch.tensor([1.0]), m, clip_eps=0.2)
    assert loss.item() == pytest.approx(-1.2) and stats["clip_fraction"] == 1.0
    loss_hi, _ = grpo_loss(lp, old, None, torch.tensor([1.0]), m, clip_eps=0.2, clip_eps_high=1.0)
    assert loss_hi.item() == pytest.approx(-math.exp(0.5), abs=1e-6)
    with_kl, s = grpo_loss(lp, lp, lp + math.log(2), torch.tensor([0.0]), m, beta=0.04)
    assert with_kl.item() == pytest.approx(0.04 * (1 - math.log(2)), abs=1e-6) and s["kl"] > 0


def test_gae_and_value_clipping():
    """Two steps, γ = 1, λ = 0.5, r = [0, 1], V = [0.5, 0.5]:
    δ_1 = 1 + 0 − 0.5 = 0.5 → Â_1 = 0.5; δ_0 = 0 + 0.5 − 0.5 = 0 → Â_0 = 0 + 0.5·0.5 = 0.25.
    Returns = Â + V = [0.75, 1.0].
    Value clip 0.2: V = 1.0, V_old = 0.5, R = 0 → clipped V = 0.7; ½·max(1, 0.49) = 0.5."""
    adv, ret = gae(torch.tensor([[0.0, 1.0]]), torch.tensor([[0.5, 0.5]]), torch.ones(1, 2), gamma=1.0, lam=0.5)
    assert adv.tolist()[0] == pytest.approx([0.25, 0.5]) and ret.tolist()[0] == pytest.approx([0.75, 1.0])
    vl = clipped_value_loss(torch.tensor([[1.0]]), torch.tensor([[0.5]]), torch.tensor([[0.0]]), torch.ones(1, 1))
    assert vl.item() == pytest.approx(0.5)
    r = kl_penalized_rewards(
        torch.tensor([2.0]), torch.tensor([[0.0, -1.0]]), torch.tensor([[0.0, 0.0]]), torch.ones(1, 2), kl_coef=0.1
    )
    assert r.tolist()[0] == pytest.approx([0.0, 2.1])  # −0.1·(−1 − 0) + 2 at the last token


def test_clipped_surrogate_with_per_token_and_negative_advantages():
    """Token 1: ratio e^{0.5} = 1.6487, Â = +1 → min(1.6487, 1.2) = 1.2 → loss −1.2 (clipped).
    Token 2: ratio e^{−0.5} = 0.6065, Â = −2 → min(−1.2131, 0.8·−2 = −1.6) = −1.6 → loss 1.6 (clipped:
    the pessimistic bound keeps the larger penalty). Token 3: ratio 1, Â = 3 → loss −3, not clipped."""
    logp = torch.tensor([[0.0, -0.5, -1.0]])
    old = torch.tensor([[-0.5, 0.0, -1.0]])
    loss, clipped = clipped_surrogate(logp, old, torch.tensor([[1.0, -2.0, 3.0]]), clip_eps=0.2)
    assert loss.tolist()[0] == pytest.approx([-1.2, 1.6, -3.0], abs=1e-5)
    assert clipped.tolist()[0] == [True, True, False]


def test_masked_whiten_ignores_padding():
    """Masked entries [1, 3] (the 100 is padding): mean 2, variance 1 → [−1, 1], padding → 0."""
    out = masked_whiten(torch.tensor([[1.0, 3.0, 100.0]]), torch.tensor([[1, 1, 0]]))
    assert out.tolist()[0] == pytest.approx([-1.0, 1.0, 0.0], abs=1e-4)


def test_gae_stops_at_the_end_of_each_completion():
    """Row [prompt, c1, c2, pad] with mask [0, 1, 1, 0], γ = λ = 1, r = [0, 0, 1, 5], V = [9, 0.5, 0.5, 9]:
    the pad's reward and value never leak in. Â_2 = 1 + 0 − 0.5 = 0.5; Â_1 = 0 + 0.5 − 0.5 + 0.5 = 0.5;
    prompt and pad positions get 0."""
    adv, ret = gae(
        torch.tensor([[0.0, 0.0, 1.0, 5.0]]),
        torch.tensor([[9.0, 0.5, 0.5, 9.0]]),
        torch.tensor([[0, 1, 1, 0]]),
        gamma=1.0,
        lam=1.0,
    )
    assert adv.tolist()[0] == pytest.approx([0.0, 0.5, 0.5, 0.0])
    assert ret.tolist()[0] == pytest.approx([0.0, 1.0, 1.0, 0.0])


@pytest.mark.parametrize("device, dtype", [("meta", torch.float32), ("cpu", torch.float64)])
def test_every_loss_and_advantage_stays_on_its_inputs_device_and_dtype(device, dtype):
    """A tensor allocated inside a pure function on the default device/dtype (the CPU, float32) would
    clash with inputs on another device (meta stands in for a GPU: any CPU tensor mixed in raises)
    or silently change precision (float64 in, float32 out)."""
    B, T = 4, 5
    t = lambda *shape: torch.randn(*shape, dtype=dtype).to(device)  # noqa: E731
    mask = torch.ones(B, T, dtype=dtype).to(device)
    lp, old, ref, values = t(B, T), t(B, T), t(B, T), t(B, T)
    outs = [
        dpo_loss(ChosenRejected(t(B), t(B)), ChosenRejected(t(B), t(B)), beta=0.1).loss,
        dpo_loss(
            ChosenRejected(t(B), t(B)),
            ChosenRejected(t(B), t(B)),
            beta=0.1,
            loss_type="ipo",
            lengths=ChosenRejected(t(B), t(B)),
        ).loss,
        bradley_terry_loss(t(B), t(B), margin=0.5)[0],
        grpo_advantages(t(B), 2),
        k3_kl(lp, ref),
        grpo_loss(lp, old, ref, t(B), mask, clip_eps=0.2, clip_eps_high=None, beta=0.04, aggregation="dapo")[0],
        clipped_surrogate(lp, old, t(B, T), clip_eps=0.2)[0],
        masked_whiten(lp, mask),
        kl_penalized_rewards(t(B), lp, ref, mask, 0.05),
        *gae(t(B, T), values, mask, 1.0, 0.95),
        clipped_value_loss(values, t(B, T), t(B, T), mask, 0.2),
    ]
    for out in outs:
        assert out.device.type == device and out.dtype == dtype, (out.device, out.dtype)
