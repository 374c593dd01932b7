"""The engine under faults and load, without Ray: admission by KV budget (padded cells, not rows), a
failed prefill or step failing only its own requests, and cancelled rows leaving at once. The
requests that go on must decode exactly what HF `generate` gives them alone."""

import pytest
import torch

from raypai.serving.engine import Engine, kv_cells
from raypai.serving.generation import GenRequest, generate_batch


@pytest.fixture(scope="module")
def model_tok(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval(), AutoTokenizer.from_pretrained(tiny_model_dir)


def _req(tok, text: str, max_tokens: int) -> GenRequest:
    return GenRequest(tok(text)["input_ids"], max_tokens=max_tokens, temperature=0.0)


def _alone(model, tok, req: GenRequest) -> str:
    return generate_batch(model, tok, [req], {tok.eos_token_id})[0].text


def _drain(engine: Engine, events: list) -> dict:
    while engine.active:
        events += engine.step()
    return {e.key: e for e in events if e.result is not None or e.error is not None}


def test_admission_counts_padded_kv_cells_of_the_batch_not_rows(model_tok):
    """A left-padded batch is as wide as its longest row: rows x max(prompt + max_tokens). Running: one
    row of 4 + 8 = 12 positions. Budget 40 cells. Two more rows like it: 3 x 12 = 36 <= 40, admitted;
    a third: 4 x 12 = 48 > 40, refused though 13 of 16 rows are free. One long request of 4 + 26 = 30
    positions: 2 x 30 = 60 > 40, refused next to the running row, but an idle engine takes it alone."""
    model, tok = model_tok
    short = GenRequest([5, 6, 7, 8], max_tokens=8, temperature=0.0)
    long = GenRequest([5, 6, 7, 8], max_tokens=26, temperature=0.0)
    engine = Engine(model, tok, {tok.eos_token_id}, max_batch_size=16, max_kv_cells=40)
    assert kv_cells(rows=3, longest=12) == 36
    assert engine.fits([long])  # idle: one request always fits alone (it passed the context check)
    engine.add([("a", short)])
    assert engine.fits([short, short]) and not engine.fits([short, short, short])
    assert not engine.fits([long]) and engine.free_slots == 15
    assert Engine(model, tok, {tok.eos_token_id}).fits([long] * 15)  # no budget: rows are the only limit


def test_a_failed_prefill_fails_only_its_own_request(model_tok):
    """A group joins a running batch; one of its prompts holds a token id past the model's embedding
    (a tokenizer/model mismatch), so the group's prefill fails. That request fails; its group-mate
    (prefilled again alone) and the running row finish with the text each gives alone."""
    model, tok = model_tok
    running, mate = _req(tok, "the quick brown fox", 10), _req(tok, "1+2=", 6)
    bad = GenRequest([5, model.config.vocab_size + 3], max_tokens=4, temperature=0.0)
    engine = Engine(model, tok, {tok.eos_token_id})
    events = engine.add([("running", running)]) + engine.step()
    events += engine.add([("mate", mate), ("bad", bad)])
    assert engine.active == 2  # the running row and the mate; the bad one never joined
    done = _drain(engine, events)
    assert isinstance(done["bad"].error, IndexError)
    assert done["running"].result.text == _alone(model, tok, running)
    assert done["mate"].result.text == _alone(model, tok, mate)


class _FailsWide:
    """The model, except that a decode step over more than `rows` rows raises after running (as a
    device running out of memory in its last layer would: every layer's cache already grew)."""

    def __init__(self, model, rows: int):
        self.model, self.rows = model, rows

    def parameters(self):
        return self.model.parameters()

    def __call__(self, **kw):
        out = self.model(**kw)
        ids = kw["input_ids"]  # (B, 1) in a decode step, (B, T) in a prefill
        if ids.shape[1] == 1 and ids.shape[0] > self.rows:
            raise RuntimeError("CUDA out of memory (simulated)")
        return out


def test_a_failed_step_fails_the_newest_group_and_keeps_the_rest(model_tok):
    """Two rows decode; a third joins and the next step fails. The newest group (the third) fails; the
    step is undone (mask and the cache positions it appended) and retried, and the two rows that were
    running finish with the text each gives alone. The old engine failed and dropped all three."""
    model, tok = model_tok
    a, b, c = _req(tok, "the quick brown fox", 9), _req(tok, "1+2=", 7), _req(tok, "over the lazy", 5)
    engine = Engine(_FailsWide(model, rows=2), tok, {tok.eos_token_id})
    events = engine.add([("a", a), ("b", b)]) + engine.step()
    events += engine.add([("c", c)])
    done = _drain(engine, events)
    assert isinstance(done["c"].error, RuntimeError) and done["c"].result is None
    assert done["a"].result.text == _alone(model, tok, a)
    assert done["b"].result.text == _alone(model, tok, b)


def test_cancel_removes_a_row_at_once_and_the_others_go_on(model_tok):
    model, tok = model_tok
    a, b = _req(tok, "the quick brown fox", 9), _req(tok, "1+2=", 12)
    engine = Engine(model, tok, {tok.eos_token_id})
    events = engine.add([("a", a), ("b", b)]) + engine.step()
    assert engine.cancel({"b", "unknown"}) == ["b"] and engine.active == 1
    assert engine.mask.shape[0] == 1 and engine.cache.layers[0].keys.shape[0] == 1  # its cache row is gone
    done = _drain(engine, events)
    assert "b" not in done and done["a"].result.text == _alone(model, tok, a)


def test_no_reset_after_a_failure_keeps_the_engine_usable(model_tok):
    """After a failed prefill the engine serves the next request normally."""
    model, tok = model_tok
    engine = Engine(model, tok, {tok.eos_token_id})
    events = engine.add([("bad", GenRequest([model.config.vocab_size + 1], max_tokens=2, temperature=0.0))])
    assert isinstance(events[0].error, IndexError) and engine.active == 0
    ok = _req(tok, "the lazy dog", 5)
    done = _drain(engine, engine.add([("ok", ok)]))
    assert done["ok"].result.text == _alone(model, tok, ok)
    assert torch.equal(engine.mask, torch.zeros((0, 0), dtype=torch.long))
