"""The DPO step's one forward over chosen and rejected rows gives each row the log-probs it gets alone."""

import torch

from raypai.alignment._tensors import pad, sequence_logprob, token_logprobs
from raypai.alignment.roles.policy import _stack_right_padded


def test_stacked_chosen_and_rejected_match_separate_forwards(tiny_model):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    g = torch.Generator().manual_seed(0)

    def batch(lengths, prompt):
        seqs = [torch.randint(3, 200, (n,), generator=g).tolist() for n in lengths]
        return pad(seqs, [[0] * prompt + [1] * (n - prompt) for n in lengths], 0)

    chosen, rejected = batch([9, 5, 12], 3), batch([7, 15, 4], 2)  # rejected is the longer batch
    both = _stack_right_padded(chosen, rejected)
    assert both["input_ids"].shape == (6, 15) and both["response_mask"].shape == (6, 14)
    with torch.no_grad():
        together = sequence_logprob(token_logprobs(model, both["input_ids"], both["attention_mask"]),
                                    both["response_mask"])
        alone = torch.cat([sequence_logprob(token_logprobs(model, b["input_ids"], b["attention_mask"]),
                                            b["response_mask"]) for b in (chosen, rejected)])
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
    from raypai.alignment.roles.policy import PolicyTrainer

    g = torch.Generator().manual_seed(2)

    def side(n_resp):
        seqs = [list(range(3, 9)) + torch.randint(3, 200, (n,), generator=g).tolist() for n in n_resp]
        return pad(seqs, [[0] * 6 + [1] * n for n in n_resp], 0)

    chosen, rejected = side([2, 5, 3, 4]), side([4, 1, 6, 2])
    ref_c, ref_r = -torch.rand(4) * 10, -torch.rand(4) * 10
    a, b = PolicyTrainer(tiny_model, 1e-3, seed=0), PolicyTrainer(tiny_model, 1e-3, seed=0)
    assert b.hold_pairs(chosen, rejected, ref_c, ref_r) == 4
    c = PolicyTrainer(tiny_model, 1e-3, seed=0)
    c.hold_pairs(chosen, rejected, ref_c, ref_r)
    steps, one_by_one = ([2, 0], [1, 3, 3], [0]), []
    for idx in steps:
        t = torch.tensor(idx)
        shipped = a.dpo_step(select_rows(chosen, t), select_rows(rejected, t), ref_c[t], ref_r[t], 0.1, "sigmoid", 0.0)
        held = b.dpo_step_held(idx, 0.1, "sigmoid", 0.0)
        assert shipped == held
        one_by_one.append(held)
    # several steps in one call: the same steps, in order
    assert c.dpo_steps_held(list(steps), 0.1, "sigmoid", 0.0) == one_by_one
    for p, q in zip(b.engine.module.parameters(), c.engine.module.parameters()):
        assert torch.equal(p, q)
    for p, q in zip(a.engine.module.parameters(), b.engine.module.parameters()):
        assert torch.equal(p, q)
    assert any(not torch.equal(p, q) for p, q in zip(a.engine.module.parameters(),
                                                    PolicyTrainer(tiny_model, 1e-3, seed=0).engine.module.parameters()))


def test_the_trainer_switches_every_submodule_between_train_and_eval(tiny_model):
    """A step leaves an unchanged mode alone (walking every submodule each step cost 3 % of a DPO
    step); every switch still reaches every submodule."""
    from raypai.alignment.roles.policy import PolicyTrainer

    g = torch.Generator().manual_seed(3)
    seqs = [list(range(3, 9)) + torch.randint(3, 200, (n,), generator=g).tolist() for n in (2, 4)]
    batch = pad(seqs, [[0] * 6 + [1] * n for n in (2, 4)], 0)
    trainer = PolicyTrainer(tiny_model, lr=1e-3)

    def modes():
        return {m.training for m in trainer.engine.module.modules()}

    assert modes() == {False}  # from_pretrained gives an eval-mode model
    trainer.sft_step(batch)
    assert modes() == {True}
    trainer.sft_step(batch)
    assert modes() == {True}
    trainer.logprobs(batch)
    assert modes() == {False}
    before = [p.detach().clone() for p in trainer.engine.module.parameters()]
    other = pad([s[:6] + [7, 8, 9][:n] for s, n in zip(seqs, (3, 1))], [[0] * 6 + [1] * n for n in (3, 1)], 0)
    trainer.dpo_step(batch, other, torch.zeros(2), torch.zeros(2), 0.1, "sigmoid", 0.0)
    assert modes() == {True}
    # the step moved the weights and left no gradient behind (the stage-0 zero_grad over a list)
    params = list(trainer.engine.module.parameters())
    assert any(not torch.equal(a, p) for a, p in zip(before, params))
    assert all(p.grad is None for p in params)
