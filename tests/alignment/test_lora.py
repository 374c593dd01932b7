"""LoRA on the generic trainer role, in process (no Ray): only adapters (and a scalar head) train,
the base with adapters off is the reference, the lean forward applies the adapters (and never runs
the base alone), a replica merging the factors samples from the adapted model, and the exports load
in plain transformers and peft."""

import pytest
import torch

from raypai.alignment._tensors import pad, token_logprobs
from raypai.alignment.config import GRPOConfig, LoRASpec
from raypai.alignment.losses.objectives import SFT, PPOValue
from raypai.alignment.roles.trainer import Trainer

FAMILIES = ("llama3", "qwen2", "gpt2")


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    from raypai.alignment.tasks.tiny import build_tiny_model

    return request.param, build_tiny_model(tmp_path_factory.mktemp(request.param) / "m", family=request.param)


def _batch(seed: int = 0, lengths=(4, 6, 3)) -> dict:
    g = torch.Generator().manual_seed(seed)
    seqs = [list(range(3, 8)) + torch.randint(20, 200, (n,), generator=g).tolist() for n in lengths]
    return pad(seqs, [[0] * 5 + [1] * n for n in lengths], 0)


SPEC = LoRASpec(r=4, alpha=8.0)


def _trained(model_dir: str, steps: int = 3, **kwargs) -> Trainer:
    t = Trainer(model_dir, 1e-2, seed=0, lora=SPEC, **kwargs)
    for _ in range(steps):
        t.update_on(SFT(), _batch())
    return t


def test_only_adapters_train_and_the_reference_is_the_base(family):
    from transformers import AutoModelForCausalLM

    name, model_dir = family
    t = _trained(model_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    base_params = dict(base.named_parameters())
    changed, frozen_same = [], 0
    for n, p in t.engine.module.named_parameters():
        if "lora_" in n:
            changed.append(n)
            continue
        key = n.removeprefix("base_model.model.").replace(".base_layer", "")
        assert torch.equal(p.detach(), base_params[key].detach()), f"{name}: {n} changed"
        frozen_same += 1
    assert changed and frozen_same == len(base_params)
    counts = t.param_counts()
    assert 0 < counts["trainable_params"] < 0.5 * counts["total_params"]
    batch = _batch(1)
    m = batch["response_mask"]
    with torch.no_grad():
        want = token_logprobs(base, batch["input_ids"], batch["attention_mask"], where=m, lean=False)
    # the reference: the same weights, adapters off, equals the base model's log-probs
    assert torch.allclose(t.base_logprobs(batch), want, atol=1e-6)
    # and the adapted policy is not the base (the adapters were trained; the check can fail)
    assert not torch.allclose(t.logprobs(batch), want, atol=1e-3)


def test_the_lean_forward_applies_the_adapters(family, monkeypatch):
    """Llama-family models take the lean forward with LoRA too: its log-probs and gradients equal
    peft's own forward, and it is the path taken (a spy counts it)."""
    from raypai.alignment import _lean

    name, model_dir = family
    t = _trained(model_dir)
    net = t.net
    batch = _batch(2)
    m = batch["response_mask"]
    if name == "gpt2":
        assert not _lean.lean_supported(net)  # GPT-2 has no lean path at all: peft's forward, adapters applied
        return
    assert _lean.lean_supported(net)
    calls = []
    real = _lean.lean_hidden
    monkeypatch.setattr(_lean, "lean_hidden", lambda *a, **k: calls.append(1) or real(*a, **k))
    # (padding positions differ between the two paths and are never read: compare under the mask)
    lean = token_logprobs(net, batch["input_ids"], batch["attention_mask"]) * m
    assert calls, "the LoRA model fell back to the slow path"
    slow = token_logprobs(net, batch["input_ids"], batch["attention_mask"], lean=False) * m
    assert torch.allclose(lean, slow, atol=1e-5)
    with t.engine.module.disable_adapter():
        base_lean = token_logprobs(net, batch["input_ids"], batch["attention_mask"]) * m
    assert not torch.allclose(lean, base_lean, atol=1e-3)  # the adapters are in the lean path's weights
    # gradients reach the adapters through the lean path, as through peft's forward
    grads = []
    for lean_flag in (True, False):
        t.engine.module.zero_grad(set_to_none=True)
        (token_logprobs(net, batch["input_ids"], batch["attention_mask"], where=m, lean=lean_flag) * m).sum().backward()
        grads.append({n: p.grad.clone() for n, p in t.engine.module.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and all("lora_" in n for n in grads[0])
    assert all(torch.allclose(grads[0][n], grads[1][n], atol=1e-4) for n in grads[0])


def test_a_replica_merging_the_adapters_samples_from_the_adapted_model(family):
    from raypai.alignment.roles.rollout import Rollout

    name, model_dir = family
    t = _trained(model_dir, steps=6)
    replica = Rollout(model_dir)
    batch = _batch(3)
    before = replica.logprobs(batch)
    state = t.state_dict()
    assert set(state) == {"lora", "spec"} and all("lora_" in k for k in state["lora"])
    sent = replica.load_weights(state, version=6)
    full = sum(p.numel() * p.element_size() for p in replica.model.parameters())
    assert 0 < sent < 0.5 * full  # the factors, not the model
    after = replica.logprobs(batch)
    assert torch.allclose(after, t.logprobs(batch), atol=1e-5)
    assert not torch.allclose(after, before, atol=1e-3)
    # a second load replaces the first adapters (their change merged, not added on top of them)
    replica.load_weights(state, version=6)
    assert torch.allclose(replica.logprobs(batch), after, atol=1e-6)
    # new adapters replace the old: the weights are base + the new delta (fp32 replicas keep the last
    # factors, not a copy of the base weights)
    t.update_on(SFT(), _batch())
    replica.load_weights(t.state_dict(), version=7)
    assert torch.allclose(replica.logprobs(batch), t.logprobs(batch), atol=1e-5)
    kept = sum(x.numel() * x.element_size() for f, _ in replica._lora_base.values() for x in f.values())
    assert kept <= sent
    prompts = ["1+2=", "3+4="]
    out = replica.generate(prompts, n=2, max_new_tokens=4, temperature=0.0)
    assert out["weights_version"] == 7


def test_the_merged_export_and_the_adapter_load_in_transformers_and_peft(family, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    name, model_dir = family
    t = _trained(model_dir)
    batch = _batch(4)
    with torch.no_grad():
        want = t.net(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    out = t.export(str(tmp_path / "merged"), {"algorithm": "sft"})
    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    assert not any("lora" in n for n, _ in merged.named_parameters())
    with torch.no_grad():
        got = merged(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        adapted = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(model_dir), str(tmp_path / "merged-adapter")
        )
        via_peft = adapted.eval()(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        base = (
            AutoModelForCausalLM.from_pretrained(model_dir)
            .eval()(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
            .logits
        )
    assert torch.allclose(got, want, atol=1e-4)
    assert torch.allclose(via_peft, want, atol=1e-4)
    assert not torch.allclose(base, want, atol=1e-3)
    assert (tmp_path / "merged-adapter" / "adapter_config.json").is_file()


def test_a_critic_with_lora_trains_its_head_and_adapters(tmp_path):
    from raypai.alignment.tasks.tiny import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "gpt2", family="gpt2")
    critic = Trainer(model_dir, 1e-2, head="token_value", lora=SPEC)
    names = [n for n, p in critic.engine.module.named_parameters() if p.requires_grad]
    assert any("lora_" in n for n in names) and any("modules_to_save" in n for n in names)
    assert all("lora_" in n or "modules_to_save" in n for n in names)
    batch = _batch(5)
    values = critic.values(batch)
    first = critic.update(PPOValue(clip=10.0), {"seq": batch, "old_values": values, "returns": values + 1.0})["loss"]
    for _ in range(5):
        last = critic.update(PPOValue(clip=10.0), {"seq": batch, "old_values": values, "returns": values + 1.0})["loss"]
    assert last < first


def test_bad_lora_settings_give_one_clear_error_before_any_actor(tmp_path):
    from raypai.alignment._driver import check_lora
    from raypai.alignment.tasks.tiny import build_tiny_model
    from raypai.errors import ConfigError

    with pytest.raises(ConfigError, match=r"lora_r must be ≥ 0 \(got -1\)"):
        GRPOConfig(lora_r=-1)
    model_dir = build_tiny_model(tmp_path / "m", family="qwen2")
    with pytest.raises(ConfigError, match=r"\['qkv'\] are not linear projections.*choose among \[.*'q_proj'"):
        check_lora(model_dir, GRPOConfig(lora_r=8, lora_target_modules=("q_proj", "qkv")))
    check_lora(model_dir, GRPOConfig(lora_r=8, lora_target_modules=("q_proj", "v_proj")))  # a near miss that is fine
    import json
    from pathlib import Path

    cfg_file = Path(model_dir) / "config.json"
    conf = json.loads(cfg_file.read_text())
    conf["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    cfg_file.write_text(json.dumps(conf))
    with pytest.raises(ConfigError, match="QLoRA is not supported"):
        check_lora(model_dir, GRPOConfig(lora_r=8))
    check_lora(model_dir, GRPOConfig())  # full fine-tuning: nothing to check


def test_lora_trains_alike_at_every_zero_stage_and_checkpoints_the_adapters_only(tmp_path):
    """ZeRO stages 0-2 give the same LoRA updates (one rank); a LoRA checkpoint holds the adapters
    and their optimizer state, not the base (a fraction of a full checkpoint), and resumes exactly."""
    from pathlib import Path

    from raypai.alignment.tasks.tiny import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "m", family="qwen2")
    batch = _batch(6)
    runs = []
    for stage in (0, 1, 2):
        t = Trainer(model_dir, 1e-2, zero_stage=stage, seed=0, lora=SPEC)
        runs.append([t.update_on(SFT(), batch)["loss"] for _ in range(3)])
    assert runs[1] == pytest.approx(runs[0], rel=1e-5) and runs[2] == pytest.approx(runs[0], rel=1e-5)
    assert runs[0][-1] < runs[0][0]

    def saved_bytes(trainer, folder) -> int:
        trainer.save_checkpoint(str(folder), "step-000001")
        return sum(p.stat().st_size for p in Path(folder, "step-000001").rglob("*.pt"))

    lora = Trainer(model_dir, 1e-2, seed=0, lora=SPEC)
    lora.update_on(SFT(), batch)
    full = Trainer(model_dir, 1e-2, seed=0)
    full.update_on(SFT(), batch)
    lora_bytes, full_bytes = saved_bytes(lora, tmp_path / "ck-lora"), saved_bytes(full, tmp_path / "ck-full")
    assert lora_bytes < 0.3 * full_bytes, (lora_bytes, full_bytes)
    want = lora.update_on(SFT(), batch)["loss"]
    resumed = Trainer(model_dir, 1e-2, seed=0, lora=SPEC)
    resumed.load_checkpoint(str(tmp_path / "ck-lora"), "step-000001")
    assert resumed.update_on(SFT(), batch)["loss"] == pytest.approx(want, rel=1e-6)
