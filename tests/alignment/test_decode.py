"""The rollout's decoding loop (raypai.alignment._decode) against transformers' own `generate` and a
full forward pass, on three model families with prompts of different lengths (left padding)."""

import pytest
import torch

from raypai.alignment._decode import decode, sample_tokens
from raypai.alignment._lean import lean_decoder
from raypai.alignment._tensors import pad, token_logprobs
from raypai.alignment.tasks.tiny import build_tiny_model
from raypai.chat import ChatFormat


@pytest.fixture(scope="module", params=["llama3", "qwen2", "gpt2"])
def family_model(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = build_tiny_model(tmp_path_factory.mktemp(request.param) / "m", family=request.param)
    fmt = ChatFormat.from_pretrained(path)
    return AutoModelForCausalLM.from_pretrained(path).eval(), fmt


def _prompts(fmt):
    return [fmt.prompt_ids(p) for p in ("1+2=", "13+27=", "a much longer prompt: 40+41=", "7+7=")]


def test_the_lean_forward_covers_llama_and_qwen2_and_leaves_gpt2_to_its_own_forward(family_model):
    model, _ = family_model
    assert (lean_decoder(model) is None) == (type(model).__name__ == "GPT2LMHeadModel")


# the lean forward shrinking the batch as rows end (the CPU's default), the lean forward's fixed-shape
# step (what CUDA replays as a graph; run eagerly here), and the model's own forward
ENGINES = pytest.mark.parametrize(
    "lean, static", [(True, False), (True, True), (False, False)], ids=["lean", "lean-static", "model-forward"]
)


@ENGINES
def test_greedy_tokens_are_those_of_hf_generate(family_model, lean, static):
    model, fmt = family_model
    prompts = _prompts(fmt)
    stops = list(fmt.stop_ids)
    mine = decode(
        model,
        prompts,
        pad_id=fmt.tok.pad_token_id,
        stop_ids=stops,
        max_new_tokens=12,
        temperature=0,
        lean=lean,
        static=static,
    )
    for p, got in zip(prompts, mine.tokens):  # one prompt at a time: no padding on HF's side
        ref = model.generate(
            torch.tensor([p]),
            attention_mask=torch.ones(1, len(p), dtype=torch.long),
            max_new_tokens=12,
            do_sample=False,
            eos_token_id=stops,
            pad_token_id=fmt.tok.pad_token_id,
        )[0, len(p) :].tolist()
        cut = next((j for j, t in enumerate(ref) if t in stops), None)
        assert got == (ref if cut is None else ref[: cut + 1])


# and the fixed-shape step through torch.compile (`compile_rollout`; GPT-2 falls back to its own forward)
@pytest.mark.parametrize(
    "lean, static, compiled",
    [(True, False, False), (True, True, False), (False, False, False), (True, None, True)],
    ids=["lean", "lean-static", "model-forward", "lean-compiled"],
)
def test_sampled_logprobs_are_the_models_and_rows_end_at_their_stop_token(family_model, lean, static, compiled):
    model, fmt = family_model
    prompts = _prompts(fmt) * 4
    stop = list(fmt.stop_ids)
    # a model this small rarely emits its stop token; stop on two frequent tokens as well so rows end early
    frequent = torch.topk(model(torch.tensor([prompts[0]])).logits[0, -1], 2).indices.tolist()
    g = torch.Generator().manual_seed(3)
    d = decode(
        model,
        prompts,
        pad_id=fmt.tok.pad_token_id,
        stop_ids=stop + frequent,
        max_new_tokens=10,
        generator=g,
        logprobs=True,
        lean=lean,
        static=static,
        compiled=compiled,
    )
    assert d.path == _path(model, lean, static, compiled)  # this call's steps ran where asked (GPT-2: its own)
    ended = [t for t in d.tokens if t and t[-1] in stop + frequent]
    assert 0 < len(ended) == d.stopped < len(prompts)  # some rows left the batch early, others ran on
    for toks in d.tokens:
        assert all(t not in stop + frequent for t in toks[:-1])  # nothing after a stop token
        assert 1 <= len(toks) <= 10
    # the log-probs returned with the samples equal a full forward pass over prompt + completion
    batch = pad(
        [p + t for p, t in zip(prompts, d.tokens)],
        [[0] * len(p) + [1] * len(t) for p, t in zip(prompts, d.tokens)],
        fmt.tok.pad_token_id,
    )
    with torch.no_grad():
        full = token_logprobs(model, batch["input_ids"], batch["attention_mask"])
    for i, (p, lp) in enumerate(zip(prompts, d.logprobs)):
        assert torch.allclose(lp, full[i, len(p) - 1 : len(p) - 1 + len(lp)], atol=1e-4)


def _path(model, lean: bool, static: bool | None, compiled: bool) -> str:
    """The step `decode` runs on the CPU for these arguments: GPT-2 has no lean forward."""
    if not lean or lean_decoder(model) is None:
        return "model"
    return "compiled" if compiled else "static" if static else "lean"


def test_compiled_greedy_tokens_are_those_of_hf_generate(family_model):
    """The fixed-shape step through torch.compile (`compile_rollout`) decodes greedily what HF
    `generate` does, on each family (GPT-2 on its own forward), with the log-prob of each token under
    generate's own logits: a tiny random model's greedy tokens barely depend on its attention, the
    log-probs do (to 1e-4). 16 rows and 10 new tokens, as the sampled test's compiled run, so the two
    share one compile per family."""
    model, fmt = family_model
    prompts = _prompts(fmt)
    stops = list(fmt.stop_ids)
    mine = decode(
        model,
        prompts * 4,
        pad_id=fmt.tok.pad_token_id,
        stop_ids=stops,
        max_new_tokens=10,
        temperature=0,
        logprobs=True,
        compiled=True,
    )
    assert mine.path == _path(model, True, None, True)
    for i, p in enumerate(prompts):  # one prompt at a time: no padding on HF's side
        ref = model.generate(
            torch.tensor([p]),
            attention_mask=torch.ones(1, len(p), dtype=torch.long),
            max_new_tokens=10,
            do_sample=False,
            eos_token_id=stops,
            pad_token_id=fmt.tok.pad_token_id,
            output_logits=True,
            return_dict_in_generate=True,
        )
        toks = ref.sequences[0, len(p) :].tolist()
        cut = next((j for j, t in enumerate(toks) if t in stops), None)
        toks = toks if cut is None else toks[: cut + 1]
        assert mine.tokens[i] == mine.tokens[i + 4] == toks
        lp = torch.stack([torch.log_softmax(step[0].float(), -1)[t] for step, t in zip(ref.logits, toks)])
        torch.testing.assert_close(mine.logprobs[i], lp, atol=1e-4, rtol=0)


def test_sampling_follows_temperature_and_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(20000, 1)
    g = torch.Generator().manual_seed(0)
    freq = torch.bincount(sample_tokens(logits, 1.0, 1.0, g), minlength=4) / 20000
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.015)
    # top-p 0.7: the nucleus is {0, 1} (0.5 before token 1 is < 0.7; 0.8 before token 2 is not)
    freq = torch.bincount(sample_tokens(logits, 1.0, 0.7, g), minlength=4) / 20000
    assert freq[2:].sum() == 0 and abs(freq[0] - 0.625) < 0.015
    # temperature 0.5 sharpens: p ∝ p₀², so token 0 gets 0.25 / (0.25 + 0.09 + 0.0225 + 0.0025)
    freq = torch.bincount(sample_tokens(logits, 0.5, 1.0, g), minlength=4) / 20000
    assert abs(freq[0] - 0.25 / 0.365) < 0.015
    assert sample_tokens(logits[:3], 0.0, 1.0).tolist() == [0, 0, 0]


def test_the_sampler_never_draws_a_token_of_probability_zero_and_follows_the_rest():
    from raypai.alignment._decode import _inverse_cdf

    # zeros first, inside and last (top-p leaves trailing zeros; a masked vocabulary leaves any)
    w = torch.tensor([[0.0, 0.2, 0.0, 0.0, 0.6, 0.2, 0.0]]).repeat(30000, 1)
    freq = torch.bincount(_inverse_cdf(w, torch.Generator().manual_seed(1)), minlength=7) / 30000
    assert freq[[0, 2, 3, 6]].sum() == 0
    assert torch.allclose(freq[[1, 4, 5]], torch.tensor([0.2, 0.6, 0.2]), atol=0.012)
    # unnormalised weights (the nucleus before renormalising) give the same distribution
    freq = torch.bincount(_inverse_cdf(w * 0.37, torch.Generator().manual_seed(2)), minlength=7) / 30000
    assert torch.allclose(freq[[1, 4, 5]], torch.tensor([0.2, 0.6, 0.2]), atol=0.012)


def test_both_rollout_engines_give_the_same_greedy_completions_and_log_probs(tmp_path):
    """The Rollout role (in-process here) with raypai's loop and with transformers' generate, on a
    Qwen2 model with a ChatML template and chat prompts: same greedy completions, same behaviour
    log-probs (the loop's from its sampling pass, generate's from a second forward)."""
    from raypai.alignment.roles.rollout import Rollout
    from raypai.errors import ConfigError

    path = build_tiny_model(tmp_path / "m", family="qwen2")
    prompts = [[{"role": "user", "content": "1+2="}], [{"role": "user", "content": "a longer one: 13+27="}]]
    outs = [
        Rollout(str(path), engine=e).generate(prompts, n=2, max_new_tokens=6, temperature=0, logprobs=True)
        for e in ("raypai", "hf")
    ]
    assert outs[0]["completions"] == outs[1]["completions"] and outs[0]["seqs"] == outs[1]["seqs"]
    mask = outs[0]["batch"]["response_mask"]
    torch.testing.assert_close(outs[0]["logprobs"] * mask, outs[1]["logprobs"] * mask, atol=1e-4, rtol=0)
    with pytest.raises(ConfigError, match="rollout engine 'sglang' is not one of raypai, hf, vllm"):
        Rollout(str(path), engine="sglang")
