"""The deploy step's metric gate (the step itself runs in tests/e2e/test_tinychat.py)."""


def test_deploy_metric_gate_lists_every_unmet_threshold():
    from raypai.serving.steps import unmet_gates

    assert unmet_gates({"acc": 0.8, "ppl": 3.0}, {"acc": 0.5}) == []
    assert unmet_gates({"acc": 0.4}, {"acc": 0.5, "bleu": 0.1}) == ["acc=0.4 < 0.5", "bleu=None < 0.1"]
    assert unmet_gates(None, None) == []
