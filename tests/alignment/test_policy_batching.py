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
