"""Generation without Ray: stop strings, nucleus sampling, left padding, and the continuous-batching
engine agreeing with HF `generate` run on one request at a time."""

import math

import pytest
import torch

from raypai.serving.engine import Engine
from raypai.serving.generation import (
    GenRequest,
    cut_at_stop,
    generate_batch,
    left_pad,
    next_token,
    nucleus_probs,
    stream_safe_prefix,
)


def test_cut_at_stop_takes_the_earliest_stop_and_drops_it():
    assert cut_at_stop("hello world", ["ld", "o w"]) == ("hell", True)
    assert cut_at_stop("hello", ["xyz", ""]) == ("hello", False)


def test_stream_safe_prefix_holds_back_a_possible_stop_start():
    assert stream_safe_prefix("ab", ["bc"]) == "a"  # "b" may become "bc"
    assert stream_safe_prefix("a<|en", ["<|end|>", "n!"]) == "a"  # longest hold wins: "<|en"
    assert stream_safe_prefix("abc", ["xy"]) == "abc"
    assert stream_safe_prefix("abc", []) == "abc"


def test_nucleus_probs_keeps_the_smallest_set_reaching_top_p():
    """p = (.5, .3, .15, .05). Mass before each token: (0, .5, .8, .95). top_p=.8 keeps tokens whose
    preceding mass is < .8: the first two, renormalised to (.5/.8, .3/.8) = (.625, .375)."""
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    assert torch.allclose(nucleus_probs(logits, 1.0, 0.8), torch.tensor([0.625, 0.375, 0.0, 0.0]))
    # top_p=.81: the third token's preceding mass .8 < .81, so three survive: (.5, .3, .15) / .95
    assert torch.allclose(nucleus_probs(logits, 1.0, 0.81), torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95)
    # temperature .5 squares the probabilities before normalising: p_i^2 / sum p^2
    sq = torch.tensor([0.25, 0.09, 0.0225, 0.0025])
    assert torch.allclose(nucleus_probs(logits, 0.5, 1.0), sq / sq.sum())
    assert math.isclose(float(nucleus_probs(logits, 0.7, 0.9).sum()), 1.0, rel_tol=1e-6)


def test_tiny_temperatures_decode_greedily_instead_of_producing_nan():
    logits = torch.tensor([0.1, 2.0, -1.0])
    assert next_token(logits, 1e-300, 1.0) == next_token(logits, 0.0, 0.5) == 1
    gen = torch.Generator().manual_seed(0)
    for top_p in (1e-9, 3e-86):  # top_p → 0 keeps only the top token, even below float32's smallest number
        assert {next_token(logits, 1.0, top_p, gen) for _ in range(20)} == {1}


def test_left_pad_right_aligns_prompts_and_masks_padding():
    ids, mask = left_pad([[5, 6, 7], [9]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 9]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


@pytest.fixture(scope="module")
def model_tok(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval(), AutoTokenizer.from_pretrained(tiny_model_dir)


def test_padded_batch_equals_one_at_a_time(model_tok):
    model, tok = model_tok
    prompts = ["the quick brown fox", "1+2=", "the lazy dog jumps over the quick brown"]
    reqs = [GenRequest(tok(p)["input_ids"], max_tokens=8, temperature=0.0) for p in prompts]
    batched = generate_batch(model, tok, reqs, {tok.eos_token_id})
    singles = [generate_batch(model, tok, [r], {tok.eos_token_id})[0] for r in reqs]
    assert [b.text for b in batched] == [s.text for s in singles]  # padding and masks change nothing
    assert [b.prompt_tokens for b in batched] == [len(r.prompt_ids) for r in reqs]
    assert all(1 <= b.completion_tokens <= 8 for b in batched)


def test_sampling_respects_max_tokens_and_seed(model_tok):
    model, tok = model_tok
    req = GenRequest(tok("the")["input_ids"], max_tokens=5, temperature=1.0, top_p=0.9, seed=7)
    texts = []
    for _ in range(2):
        engine = Engine(model, tok, stop_ids=set())
        events = engine.add([("a", req)])
        while engine.active:
            events += engine.step()
        texts.append(events[-1].result)
    assert texts[0].completion_tokens == 5 and texts[0].finish_reason == "length" and texts[0].text == texts[1].text


CUDA = pytest.param(
    "cuda",
    marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(
            not torch.cuda.is_available(),
            reason="needs a CUDA device (benchmarks/gpu_check.py runs this check on a GPU machine)",
        ),
    ],
)


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_continuous_batching_matches_one_request_at_a_time(model_tok, device):
    """Requests joining a running batch at different steps (different prompt lengths and padding,
    rows leaving early) decode exactly what HF `generate` gives each request alone; with the model
    on a GPU too (cache, masks and positions on its device)."""
    import copy

    model, tok = model_tok
    model = model if device == "cpu" else copy.deepcopy(model).to(device)
    texts = ["the quick brown fox", "1+2=", "the lazy dog jumps over the quick brown", "3", "over the lazy"]
    reqs = [GenRequest(tok(t)["input_ids"], max_tokens=m, temperature=0.0) for t, m in zip(texts, (9, 3, 7, 12, 5))]
    expected = [generate_batch(model, tok, [r], {tok.eos_token_id})[0] for r in reqs]
    engine = Engine(model, tok, {tok.eos_token_id}, max_batch_size=8)
    events = engine.add([(0, reqs[0]), (1, reqs[1])])
    events += engine.step() + engine.step()
    events += engine.add([(2, reqs[2])])  # joins mid-flight, longer prompt than the running rows
    events += engine.step()
    events += engine.add([(3, reqs[3]), (4, reqs[4])])
    widest = 0
    while engine.active:
        widest = max(widest, engine.mask.shape[1])
        events += engine.step()
    results = {e.key: e.result for e in events if e.result}
    assert [results[i].text for i in range(5)] == [e.text for e in expected]
    assert [results[i].completion_tokens for i in range(5)] == [e.completion_tokens for e in expected]
    assert engine.cache is None and widest < 12 + 12  # finished rows left, their padding trimmed


def test_continuous_batching_streams_deltas_and_honours_stops(model_tok):
    model, tok = model_tok
    full = generate_batch(model, tok, [GenRequest(tok("1+2=")["input_ids"], 8, 0.0)], {tok.eos_token_id})[0]
    stop = full.text[2:4]
    engine = Engine(model, tok, {tok.eos_token_id})
    events = engine.add(
        [
            ("s", GenRequest(tok("1+2=")["input_ids"], 8, 0.0, stop=[stop], stream=True)),
            ("n", GenRequest(tok("1+2=")["input_ids"], 8, 0.0)),
        ]
    )
    while engine.active:
        events += engine.step()
    streamed = [e for e in events if e.key == "s"]
    assert "".join(e.delta for e in streamed) == streamed[-1].result.text == full.text[: full.text.index(stop)]
    assert streamed[-1].result.finish_reason == "stop"
    batched = generate_batch(
        model, tok, [GenRequest(tok("1+2=")["input_ids"], 8, 0.0, stop=[stop])], {tok.eos_token_id}
    )[0]
    assert batched.text == streamed[-1].result.text and batched.finish_reason == "stop"  # static path agrees
    plain = [e for e in events if e.key == "n"]
    assert len(plain) == 1 and plain[0].result.text == full.text  # no deltas unless streaming


def test_admission_waits_for_a_group_but_never_long():
    from raypai.serving.engine import should_admit

    assert should_admit(1, 16, active=0, waited_steps=0)  # idle: start at once
    assert not should_admit(1, 10, active=6, waited_steps=3)  # one arrival mid-flight: let it gather company
    assert should_admit(4, 10, active=6, waited_steps=0)  # a group of min_group=4 is ready
    assert should_admit(2, 2, active=14, waited_steps=0)  # enough to fill the batch
    assert should_admit(1, 10, active=6, waited_steps=8)  # waited max_wait_steps: go
    assert not should_admit(3, 0, active=16, waited_steps=50) and not should_admit(0, 8, active=8, waited_steps=9)
