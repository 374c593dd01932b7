"""The DPO step's one forward over chosen and rejected rows gives each row the log-probs it gets alone."""

import torch

from raypai.alignment._tensors import pad, sequence_logprob, stack_right_padded, token_logprobs
from raypai.alignment.losses.objectives import DPO, SFT, OnlineDPO, PPOPolicy, PPOValue


def _same(m: dict) -> dict:
    """An update's metrics less its own timing (`update_seconds`), which differs between two equal updates."""
    return {k: v for k, v in m.items() if k != "update_seconds"}


def test_stacked_chosen_and_rejected_match_separate_forwards(tiny_model):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    g = torch.Generator().manual_seed(0)

    def batch(lengths, prompt):
        seqs = [torch.randint(3, 200, (n,), generator=g).tolist() for n in lengths]
        return pad(seqs, [[0] * prompt + [1] * (n - prompt) for n in lengths], 0)

    chosen, rejected = batch([9, 5, 12], 3), batch([7, 15, 4], 2)  # rejected is the longer batch
    both = stack_right_padded(chosen, rejected)
    assert both["input_ids"].shape == (6, 15) and both["response_mask"].shape == (6, 14)
    with torch.no_grad():
        together = sequence_logprob(
            token_logprobs(model, both["input_ids"], both["attention_mask"]), both["response_mask"]
        )
        alone = torch.cat(
            [
                sequence_logprob(token_logprobs(model, b["input_ids"], b["attention_mask"]), b["response_mask"])
                for b in (chosen, rejected)
            ]
        )
    assert torch.allclose(together, alone, atol=1e-5), (together, alone)
    # the padding added to the shorter batch counts nowhere
    assert both["response_mask"][:3].sum() == chosen["response_mask"].sum()
    assert both["attention_mask"][:3, 12:].sum() == 0


def test_selected_rows_equal_the_rows_re_padded_alone():
    from raypai.alignment._tensors import select_rows

    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (9, 4, 14, 6)]
    masks = [[0] * 3 + [1] * (len(s) - 3) for s in seqs]
    batch = pad(seqs, masks, 0)
    for idx in ([1, 3], [3, 0, 0], [2]):
        alone = pad([seqs[i] for i in idx], [masks[i] for i in idx], 0)
        picked = select_rows(batch, torch.tensor(idx))
        assert picked.keys() == alone.keys()
        assert all(torch.equal(picked[k], alone[k]) for k in alone), idx


def test_a_step_on_held_pairs_equals_one_on_shipped_pairs(tiny_model):
    """Offline DPO hands the trainer its pairs once and names rows per step: the same update as
    shipping the rows' tensors; several steps in one call are the same steps."""
    from raypai.alignment._tensors import select_rows
    from raypai.alignment.roles.trainer import Trainer as PolicyTrainer

    g = torch.Generator().manual_seed(2)

    def side(n_resp):
        seqs = [list(range(3, 9)) + torch.randint(3, 200, (n,), generator=g).tolist() for n in n_resp]
        return pad(seqs, [[0] * 6 + [1] * n for n in n_resp], 0)

    chosen, rejected = side([2, 5, 3, 4]), side([4, 1, 6, 2])
    ref_c, ref_r = -torch.rand(4) * 10, -torch.rand(4) * 10
    a, b = PolicyTrainer(tiny_model, 1e-3, seed=0), PolicyTrainer(tiny_model, 1e-3, seed=0)
    assert b.hold("pairs", (chosen, rejected, ref_c, ref_r)) == 4
    c = PolicyTrainer(tiny_model, 1e-3, seed=0)
    c.hold("pairs", (chosen, rejected, ref_c, ref_r))
    dpo = DPO(beta=0.1, loss_type="sigmoid", label_smoothing=0.0)
    steps, one_by_one = ([2, 0], [1, 3, 3], [0]), []
    for idx in steps:
        t = torch.tensor(idx)
        shipped = _same(
            a.update(dpo, dpo.assemble(select_rows(chosen, t), select_rows(rejected, t), ref_c[t], ref_r[t]))
        )
        held = _same(b.update_on(dpo, idx))
        assert shipped == held
        one_by_one.append(held)
    # several steps in one call: the same steps, in order
    assert [_same(m) for m in c.updates(dpo, list(steps))] == one_by_one
    for p, q in zip(b.engine.module.parameters(), c.engine.module.parameters()):
        assert torch.equal(p, q)
    for p, q in zip(a.engine.module.parameters(), b.engine.module.parameters()):
        assert torch.equal(p, q)
    assert any(
        not torch.equal(p, q)
        for p, q in zip(
            a.engine.module.parameters(), PolicyTrainer(tiny_model, 1e-3, seed=0).engine.module.parameters()
        )
    )


def test_the_trainer_switches_every_submodule_between_train_and_eval(tiny_model):
    """A step leaves an unchanged mode alone (walking every submodule each step cost 3 % of a DPO
    step); every switch still reaches every submodule."""
    from raypai.alignment.roles.trainer import Trainer as PolicyTrainer

    g = torch.Generator().manual_seed(3)
    seqs = [list(range(3, 9)) + torch.randint(3, 200, (n,), generator=g).tolist() for n in (2, 4)]
    batch = pad(seqs, [[0] * 6 + [1] * n for n in (2, 4)], 0)
    trainer = PolicyTrainer(tiny_model, lr=1e-3)

    def modes():
        return {m.training for m in trainer.engine.module.modules()}

    assert modes() == {False}  # from_pretrained gives an eval-mode model
    trainer.update(SFT(), SFT().assemble(batch))
    assert modes() == {True}
    trainer.update(SFT(), SFT().assemble(batch))
    assert modes() == {True}
    trainer.logprobs(batch)
    assert modes() == {False}
    before = [p.detach().clone() for p in trainer.engine.module.parameters()]
    other = pad([s[:6] + [7, 8, 9][:n] for s, n in zip(seqs, (3, 1))], [[0] * 6 + [1] * n for n in (3, 1)], 0)
    trainer.update(DPO(), DPO().assemble(batch, other, torch.zeros(2), torch.zeros(2)))
    assert modes() == {True}
    # the step moved the weights and left no gradient behind (the stage-0 zero_grad over a list)
    params = list(trainer.engine.module.parameters())
    assert any(not torch.equal(a, p) for a, p in zip(before, params))
    assert all(p.grad is None for p in params)


def _outputs(seqs: list[list[int]], prompt_lens: list[int]) -> dict:
    """A rollout replica's output as `Rollout.generate` returns it (the fields the handover reads)."""
    return {
        "seqs": seqs,
        "masks": [[0] * p + [1] * (len(s) - p) for s, p in zip(seqs, prompt_lens)],
        "completions": [str(s[p:]) for s, p in zip(seqs, prompt_lens)],
    }


def test_online_dpo_pairs_are_taken_from_the_samples_as_ray_hands_them_over(tiny_model):
    """Online DPO's reference and trainer each pick the pairs from the rollout's outputs and the
    reward's scores (`ranked_pairs`): per group the best against the worst, a group whose scores all
    tie gives none, the replicas' rows are put back in the samples' order. The Reference's log-probs
    of the pairs and the trainer's update equal those on pairs built by hand."""
    from raypai.alignment._loop import ranked_pairs
    from raypai.alignment._tensors import select_rows
    from raypai.alignment.roles.reference import Reference
    from raypai.alignment.roles.trainer import Trainer as PolicyTrainer

    g = torch.Generator().manual_seed(4)
    prompts = [list(range(3, 8)), list(range(10, 14)), list(range(20, 26))]
    seqs = [p + torch.randint(30, 200, (n,), generator=g).tolist() for p in prompts for n in (2, 4, 3)]
    lens = [len(p) for p in prompts for _ in range(3)]
    # two replicas; the samples' order interleaves them (`Pending.rows`: (replica, row) per sample)
    order = [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2), (0, 3), (1, 3), (0, 4)]
    outs = [
        _outputs([seqs[i] for i in (0, 2, 4, 6, 8)], [lens[i] for i in (0, 2, 4, 6, 8)]),
        _outputs([seqs[i] for i in (1, 3, 5, 7)], [lens[i] for i in (1, 3, 5, 7)]),
    ]
    # group 1: sample 2 best, 0 worst; group 2: all tie (a near miss, 0.5 vs 0.5, gives nothing);
    # group 3: 0.51 beats 0.5 by a hair, which is still a preference
    scores = {"total": [0.0, 0.2, 0.9, 0.5, 0.5, 0.5, 0.5, 0.51, 0.5]}
    sampled = {"rows": order, "pad_id": 0, "n": 3}
    chosen, rejected = ranked_pairs(scores, sampled, *outs)
    batch = pad(seqs, [[0] * p + [1] * (len(s) - p) for s, p in zip(seqs, lens)], 0)
    for got, want in ((chosen, [2, 7]), (rejected, [0, 6])):
        assert all(torch.equal(got[k], select_rows(batch, torch.tensor(want))[k]) for k in got), want
    assert ranked_pairs({"total": [1.0] * 9}, sampled, *outs) is None

    ref = Reference(tiny_model)
    ref_c, ref_r = ref.pair_logprobs_on(scores, sampled, *outs)
    assert torch.allclose(ref_c, sequence_logprob(ref.logprobs(chosen), chosen["response_mask"]), atol=1e-5)
    assert torch.allclose(ref_r, sequence_logprob(ref.logprobs(rejected), rejected["response_mask"]), atol=1e-5)
    assert ref.pair_logprobs_on({"total": [1.0] * 9}, sampled, *outs) is None

    a, b = PolicyTrainer(tiny_model, 1e-3, seed=0), PolicyTrainer(tiny_model, 1e-3, seed=0)
    dpo = DPO(beta=0.1, loss_type="sigmoid", label_smoothing=0.0)
    by_hand = _same(a.update(dpo, dpo.assemble(chosen, rejected, ref_c, ref_r)))
    handed = _same(b.update_on(OnlineDPO(dpo), scores, (ref_c, ref_r), sampled, *outs))
    assert handed == {**by_hand, "pairs": 2}
    assert all(torch.equal(p, q) for p, q in zip(a.engine.module.parameters(), b.engine.module.parameters()))
    before = [p.detach().clone() for p in b.engine.module.parameters()]
    assert b.update_on(OnlineDPO(dpo), {"total": [1.0] * 9}, None, sampled, *outs) == {"skipped": 1.0}
    assert all(torch.equal(p, q) for p, q in zip(before, b.engine.module.parameters()))  # no update


def test_ppo_steps_on_a_handed_over_generation_equal_the_steps_on_driver_made_targets(tiny_model):
    """PPO's trainers take the samples, scores, log-probs and values from Ray and compute the
    advantages (policy) and returns (critic) themselves: the same updates as on targets computed
    from the padded batch in one place; the replicas' rows are put back in the samples' order."""
    from raypai.alignment.losses import gae, kl_penalized_rewards, masked_whiten
    from raypai.alignment.roles.trainer import Trainer

    def PolicyTrainer(*args, **kwargs):
        return Trainer(*args, **kwargs)

    def Critic(*args, **kwargs):
        return Trainer(*args, head="token_value", **kwargs)

    g = torch.Generator().manual_seed(5)
    seqs = [
        list(range(3, 3 + p)) + torch.randint(30, 200, (n,), generator=g).tolist()
        for p, n in ((4, 3), (6, 2), (5, 5), (4, 1))
    ]
    lens = [4, 6, 5, 4]
    order = [(1, 0), (0, 0), (1, 1), (0, 1)]  # sample 0 came from replica 1, sample 1 from replica 0, ...
    outs = [_outputs([seqs[1], seqs[3]], [lens[1], lens[3]]), _outputs([seqs[0], seqs[2]], [lens[0], lens[2]])]
    batch = pad(seqs, [[0] * p + [1] * (len(s) - p) for s, p in zip(seqs, lens)], 0)
    mask = batch["response_mask"]
    scores = {"total": [1.0, -0.5, 0.25, 2.0]}
    old_lp, ref_lp = -torch.rand(mask.shape, generator=g) * mask, -torch.rand(mask.shape, generator=g) * mask
    values = torch.randn(mask.shape, generator=g)
    targets = {"kl_coef": 0.05, "gamma": 1.0, "lam": 0.95}
    adv, returns = gae(
        kl_penalized_rewards(torch.tensor(scores["total"]), old_lp, ref_lp, mask, 0.05), values, mask, 1.0, 0.95
    )
    adv = masked_whiten(adv, mask)
    sampled = {"rows": order, "pad_id": 0}

    a, b = PolicyTrainer(tiny_model, 1e-3, seed=0), PolicyTrainer(tiny_model, 1e-3, seed=0)
    policy_objective, value_objective = PPOPolicy(clip_eps=0.2, **targets), PPOValue(clip=0.2, **targets)
    assert _same(a.update(policy_objective, {"seq": batch, "old_lp": old_lp, "advantages": adv})) == _same(
        b.update_on(policy_objective, scores, old_lp, ref_lp, values, sampled, *outs)
    )
    assert all(torch.equal(p, q) for p, q in zip(a.engine.module.parameters(), b.engine.module.parameters()))
    c, d = Critic(tiny_model, 1e-3, seed=0), Critic(tiny_model, 1e-3, seed=0)
    assert torch.equal(c.values(batch), d.values_on(sampled, *outs))
    assert _same(c.update(value_objective, {"seq": batch, "old_values": values, "returns": returns})) == _same(
        d.update_on(value_objective, scores, old_lp, ref_lp, values, sampled, *outs)
    )
    assert all(torch.equal(p, q) for p, q in zip(c.engine.module.parameters(), d.engine.module.parameters()))
    # a different order of the samples is a different batch: the update differs (the test can fail)
    e = PolicyTrainer(tiny_model, 1e-3, seed=0)
    e.update_on(policy_objective, scores, old_lp, ref_lp, values, {"rows": None, "pad_id": 0}, *outs)
    assert any(not torch.equal(p, q) for p, q in zip(a.engine.module.parameters(), e.engine.module.parameters()))


def test_rl_trainers_train_without_dropout_so_training_and_sampling_see_the_same_model(tmp_path):
    """GPT-2 ships dropout 0.1 (embeddings, residuals, attention) and token-classification heads add
    their own: in training mode the policy's log-probs and the critic's values would differ from the
    eval-mode ones its samples, the reference and the rollout-time values were computed with. RL
    trainers turn it off; SFT (`dropout=True`) keeps the model's own, and there the two differ."""
    from raypai.alignment.roles._engine import set_mode
    from raypai.alignment.roles.trainer import Trainer as PolicyTrainer
    from raypai.alignment.tasks.tiny import build_tiny_model

    gpt2 = build_tiny_model(tmp_path / "gpt2", family="gpt2")
    g = torch.Generator().manual_seed(6)
    seqs = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (9, 12, 7)]
    batch = pad(seqs, [[0] * 4 + [1] * (len(s) - 4) for s in seqs], 0)
    m = batch["response_mask"]

    def train_vs_eval(trainer):
        set_mode(trainer.engine, True)
        with torch.no_grad():
            training = trainer._forward.logprobs(batch, m)
        return training, trainer.logprobs(batch)

    assert torch.allclose(*train_vs_eval(PolicyTrainer(gpt2, 1e-3)), atol=1e-6)
    kept = train_vs_eval(PolicyTrainer(gpt2, 1e-3, dropout=True))
    assert not torch.allclose(*kept, atol=1e-3)  # SFT's trainer: dropout on in training mode
    critic = PolicyTrainer(gpt2, 1e-3, head="token_value")
    set_mode(critic.engine, True)
    with torch.no_grad():
        training = critic._forward.values(batch)
    assert torch.allclose(training, critic.values(batch), atol=1e-6)
