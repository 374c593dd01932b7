"""Evaluation that fits the user's task, on real tiny models in this process: held-out reward,
response NLL, reward-model win rate, and the promotion decision in each metric's direction."""

import pytest
import torch

from raypai.alignment import evaluate as E
from raypai.alignment.data import prompt_examples, sft_examples
from raypai.alignment.tasks import arithmetic as ar
from raypai.alignment.tasks.tiny import build_tiny_model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A random Qwen2-style model and a copy fitted (plain PyTorch, in this process) to answer 2+3= and 1+4=."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    from raypai.alignment._tensors import encode_sft
    from raypai.chat import ChatFormat

    d = tmp_path_factory.mktemp("eval")
    base = build_tiny_model(d / "base", family="qwen2", hidden=32, layers=1)
    tok = AutoTokenizer.from_pretrained(base)
    good = AutoModelForCausalLM.from_pretrained(base)
    batch = encode_sft(ChatFormat(tok), sft_examples(ar.sft_rows([ar.Problem("2+3=", 5), ar.Problem("1+4=", 5)])))
    labels = batch["input_ids"].clone()
    labels[:, 1:][batch["response_mask"] == 0] = -100
    labels[:, 0] = -100
    opt = torch.optim.AdamW(good.parameters(), lr=1e-2)
    torch.manual_seed(0)
    for _ in range(60):
        loss = good(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    good.save_pretrained(d / "good")
    tok.save_pretrained(d / "good")
    rm = AutoModelForSequenceClassification.from_pretrained(base, num_labels=1)
    rm.save_pretrained(d / "rm")
    tok.save_pretrained(d / "rm")
    return {"base": base, "good": str(d / "good"), "rm": str(d / "rm")}


def test_held_out_reward_and_nll_see_the_better_model(models):
    prompts = prompt_examples(ar.prompt_rows([ar.Problem("2+3=", 5), ar.Problem("1+4=", 5)]))
    rewards = [(ar.exact_match_reward, 1.0)]
    good = E.held_out_reward(models["good"], prompts, rewards, max_new_tokens=3)
    base = E.held_out_reward(models["base"], prompts, rewards, max_new_tokens=3)
    assert good == 1.0 and base < 1.0  # a wrong model must score low
    examples = sft_examples(ar.sft_rows([ar.Problem("2+3=", 5)]))
    assert E.response_nll(models["good"], examples) < E.response_nll(models["base"], examples)
    assert E.decide("held_out_reward", good, base) and not E.decide("held_out_reward", base, good)
    assert E.decide("response_nll", 0.5, 1.0) and not E.decide("response_nll", 1.0, 0.5)
    assert not E.decide("held_out_reward", 0.52, 0.5, min_delta=0.05)


def test_rm_win_rate_counts_ties_as_half_and_gates_at_one_half(models):
    prompts = prompt_examples(ar.prompt_rows([ar.Problem("2+3=", 5), ar.Problem("1+1=", 2)]))
    same = E.rm_win_rate(models["base"], models["base"], models["rm"], prompts, max_new_tokens=3)
    assert same == 0.5  # identical completions: every comparison a tie
    assert not E.decide("rm_win_rate", same, 0.5) and E.decide("rm_win_rate", 0.75, 0.5)
