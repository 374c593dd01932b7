"""The trainer's log-probs through raypai's lean forward (raypai.alignment._lean.lean_hidden, used by
token_logprobs) against the model's own transformers forward: the same per-token log-probs and the
same parameter gradients, on Llama, Qwen2, Mistral and Phi-3 (fused q/k/v and gate/up) configs,
right- and left-padded, and with rows that continue a shared prompt (run once per prompt); GPT-2, a
sliding-window Mistral or Phi-3, a Phi-3 with a partial rotary and one with residual dropout keep the
model's own forward."""

import pytest
import torch

from raypai.alignment._lean import lean_supported, shared_prefixes
from raypai.alignment._tensors import pad, token_logprobs

SMALL = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def _model(family: str):
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Phi3Config,
        Phi3ForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    torch.manual_seed(0)
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(**SMALL, tie_word_embeddings=True))
    if family == "qwen2":  # biases on q/k/v
        return Qwen2ForCausalLM(Qwen2Config(**SMALL, tie_word_embeddings=False))
    if family == "mistral":
        return MistralForCausalLM(MistralConfig(**SMALL, sliding_window=None))
    if family == "mistral-sliding":
        return MistralForCausalLM(MistralConfig(**SMALL, sliding_window=8))
    if family.startswith("phi3"):  # q/k/v in one qkv_proj, gate/up in one gate_up_proj
        changed = {
            "phi3": {},
            "phi3-sliding": {"sliding_window": 8},
            "phi3-partial-rotary": {"partial_rotary_factor": 0.5},
            "phi3-dropout": {"resid_pdrop": 0.1},
        }[family]
        return Phi3ForCausalLM(Phi3Config(**SMALL, pad_token_id=0, bos_token_id=1, eos_token_id=2, **changed))
    return GPT2LMHeadModel(
        GPT2Config(
            vocab_size=97,
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_positions=64,
            bos_token_id=0,
            eos_token_id=0,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
    )


def _batch(side: str):
    """Rows of 5..13 tokens, padded on `side`, a response over each row's last 4 real labels."""
    g = torch.Generator().manual_seed(1)
    lengths = [13, 5, 9, 11]
    T = max(lengths)
    ids = torch.randint(1, 97, (len(lengths), T), generator=g)
    att = torch.zeros_like(ids)
    resp = torch.zeros((len(lengths), T - 1))
    for i, n in enumerate(lengths):
        start = 0 if side == "right" else T - n
        att[i, start : start + n] = 1
        resp[i, start + n - 5 : start + n - 1] = 1  # label positions of the row's last 4 tokens
    return ids, att, resp


def _lp_and_grads(model, ids, att, resp, lean):
    model.zero_grad()
    lp = token_logprobs(model, ids, att, where=resp, lean=lean)
    (-(lp * resp).sum() / resp.sum()).backward()
    return lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "phi3"])
def test_lean_logprobs_and_gradients_equal_the_models_own(family, side):
    model = _model(family).train()
    assert lean_supported(model)
    ids, att, resp = _batch(side)
    mine, my_grads = _lp_and_grads(model, ids, att, resp, lean=True)
    ref, ref_grads = _lp_and_grads(model, ids, att, resp, lean=False)
    on = resp.bool()
    assert torch.allclose(mine[on], ref[on], atol=1e-5), (mine[on] - ref[on]).abs().max()
    assert (mine[~on] == 0).all()  # positions not asked for are not computed
    assert my_grads.keys() == ref_grads.keys() and len(my_grads) == len(list(model.parameters()))
    for name, g in ref_grads.items():
        assert torch.allclose(my_grads[name], g, atol=1e-6, rtol=1e-4), (name, (my_grads[name] - g).abs().max())


def _grouped_batch():
    """Right-padded: prompt A (7 tokens) with 3 completions, prompt B (4 tokens) with 2, prompt C alone;
    completions of 1 to 6 tokens, responses masked like a rollout's."""
    g = torch.Generator().manual_seed(2)
    tokens = lambda n: torch.randint(1, 97, (n,), generator=g).tolist()  # noqa: E731
    a, b, c = tokens(7), tokens(4), tokens(5)
    rows = [(a, 3), (a, 6), (a, 1), (b, 5), (b, 2), (c, 4)]
    seqs, masks = [], []
    for prompt, n in rows:
        seqs.append(prompt + tokens(n))
        masks.append([0] * len(prompt) + [1] * n)
    return pad(seqs, masks, 0)


# on CUDA the grouped attention under a mask runs on other kernels (cuDNN on an H200)
CUDA = pytest.param(
    "cuda",
    marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(
            not torch.cuda.is_available(), reason="needs a CUDA device (benchmarks/gpu_check.py checks the same on one)"
        ),
    ],
)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("layout", ["packed", "split"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "phi3"])
def test_rows_sharing_a_prompt_run_it_once_with_the_same_logprobs_and_gradients(family, layout, device, monkeypatch):
    """Both layouts: each prompt and its continuations packed into one sequence, and (past
    PACKED_MAX_LEN) the prompts and the continuations as one list of tokens, split for attention."""
    import raypai.alignment._lean as lean

    if layout == "split":
        monkeypatch.setattr(lean, "PACKED_MAX_LEN", 0)
    used = []
    for name in ("_packed", "_split"):
        monkeypatch.setattr(lean, name, lambda *a, _f=getattr(lean, name), _n=name: used.append(_n) or _f(*a))
    model = _model(family).to(device).train()
    b = _grouped_batch()
    ids, att, resp = (b[k].to(device) for k in ("input_ids", "attention_mask", "response_mask"))
    plen, group, firsts = shared_prefixes(ids, att, resp)
    assert plen.tolist() == [7, 7, 7, 4, 4, 5] and group.tolist() == [0, 0, 0, 1, 1, 2] and len(firsts) == 3
    mine, my_grads = _lp_and_grads(model, ids, att, resp, lean=True)
    assert used == ["_packed" if layout == "packed" else "_split"]
    ref, ref_grads = _lp_and_grads(model, ids, att, resp, lean=False)
    on = resp.bool()
    assert torch.allclose(mine[on], ref[on], atol=1e-5), (mine[on] - ref[on]).abs().max()
    assert (mine[~on] == 0).all()
    for name, g in ref_grads.items():
        assert torch.allclose(my_grads[name], g, atol=1e-6, rtol=1e-4), (name, (my_grads[name] - g).abs().max())


def test_no_shared_prompt_or_a_row_without_response_takes_the_plain_lean_forward():
    b = _grouped_batch()
    ids, att, resp = b["input_ids"], b["attention_mask"], b["response_mask"]
    assert shared_prefixes(ids[[0, 3, 5]], att[[0, 3, 5]], resp[[0, 3, 5]]) is None  # three different prompts
    resp = resp.clone()
    resp[1] = 0
    assert shared_prefixes(ids, att, resp) is None


def test_every_position_without_where_equals_the_full_log_softmax():
    model = _model("llama").eval()
    ids, att, _ = _batch("right")
    with torch.no_grad():
        mine = token_logprobs(model, ids, att)
        full = torch.log_softmax(model(input_ids=ids, attention_mask=att).logits[:, :-1], -1)
        ref = full.gather(-1, ids[:, 1:, None]).squeeze(-1)
    real = att[:, 1:].bool()  # labels that are real tokens
    assert torch.allclose(mine[real], ref[real], atol=1e-5)


@pytest.mark.parametrize("family", ["gpt2", "mistral-sliding", "phi3-sliding", "phi3-partial-rotary", "phi3-dropout"])
def test_models_the_lean_forward_does_not_cover_use_their_own(family):
    model = _model(family).train()
    assert not lean_supported(model)
    if family == "phi3-dropout":  # residual dropout applies in training only: evaluation runs lean
        assert lean_supported(model.eval())
        return
    ids, att, resp = _batch("right")
    mine, my_grads = _lp_and_grads(model, ids, att, resp, lean=True)  # falls back
    ref, ref_grads = _lp_and_grads(model, ids, att, resp, lean=False)
    assert torch.equal(mine, ref)
    assert all(torch.equal(my_grads[n], g) for n, g in ref_grads.items())
