"""The memory plan (`raypai.alignment.plan`): exact model-state bytes against real models, ZeRO's
division by ranks, LoRA's trainable state, the activation formula against what autograd saves, the
refusal with fixes that do fit, and `raypai align --plan`. No Ray."""

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from raypai.alignment import plan as P
from raypai.alignment.config import DPOConfig, GRPOConfig, PPOConfig, RewardModelConfig, SFTConfig
from raypai.alignment.tasks.tiny import build_tiny_model
from raypai.errors import ConfigError


def _n(model, trainable=False) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable)


def _row(p, role):
    [row] = [r for r in p.rows if r.role == role]
    return row


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("gpt2") / "model", family="gpt2", hidden=48, layers=2)


def test_model_state_bytes_are_exact_for_each_head(tiny_model, gpt2):
    """fp32 weights (4 B), fp32 gradients (4 B) and AdamW's two fp32 moments (8 B) per parameter,
    with the parameters counted on the real models (tied embeddings once; a reward model's and a
    critic's scalar heads), for a Llama and a GPT-2 (Conv1D) model."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoModelForTokenClassification

    for path in (tiny_model, gpt2):
        n = _n(AutoModelForCausalLM.from_pretrained(path))
        row = _row(P.plan("sft", path, SFTConfig()), "policy")
        assert (row.bytes["params"], row.bytes["grads"], row.bytes["optimizer"]) == (4 * n, 4 * n, 8 * n), path
    n_rm = _n(AutoModelForSequenceClassification.from_pretrained(tiny_model, num_labels=1))
    assert _row(P.plan("reward_model", tiny_model, RewardModelConfig()), "reward-trainer").bytes["params"] == 4 * n_rm
    n_critic = _n(AutoModelForTokenClassification.from_pretrained(tiny_model, num_labels=1))
    assert _row(P.plan("ppo", tiny_model, PPOConfig()), "critic").bytes["grads"] == 4 * n_critic
    assert n_critic != n_rm  # the critic's head has a bias: the heads are counted, not assumed


def test_a_published_parameter_count_from_a_config_alone(tmp_path):
    """Llama-2-7B's 6,738,415,616 parameters from its config.json, without weights (meta device);
    without max_length the plan's sequence is the context capped at SEQ_CAP."""
    import json

    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "architectures": ["LlamaForCausalLM"],
                "hidden_size": 4096,
                "intermediate_size": 11008,
                "num_hidden_layers": 32,
                "num_attention_heads": 32,
                "num_key_value_heads": 32,
                "vocab_size": 32000,
                "max_position_embeddings": 32768,
                "tie_word_embeddings": False,
            }
        )
    )
    assert P.read_model(str(tmp_path)).params == 6_738_415_616
    p = P.plan("sft", str(tmp_path), SFTConfig(gpus=1), device_bytes=80 * 2**30)
    assert p.seq_len == P.SEQ_CAP
    assert _row(p, "policy").bytes["params"] == 4 * 6_738_415_616 and _row(p, "policy").device == "cuda"
    assert P.plan("sft", str(tmp_path), SFTConfig(max_length=512)).seq_len == 512
    assert P.plan("sft", str(tmp_path), SFTConfig(max_length=512), seq_len=100).seq_len == 100
    # full DPO of 7B on one 80 GB GPU: 16 B of model state per parameter alone is 100 GB; one pair per
    # step leaves no rows to share or split, so LoRA alone fits, and ZeRO-Offload with stage 1
    cfg = DPOConfig(batch_size=1, max_length=512, gpus=1)
    p = P.plan("dpo", str(tmp_path), cfg, device_bytes=80 * 2**30)
    assert not p.fits and [str(f) for f in p.fixes] == ["lora_r=16", "zero_stage=1, offload_optimizer=True"]
    fixed = P.plan("dpo", str(tmp_path), replace(cfg, lora_r=16), device_bytes=80 * 2**30)
    assert fixed.fits and [r.role for r in fixed.rows] == ["policy"]


def test_zero_stages_divide_by_ranks_what_they_shard(tiny_model):
    """ZeRO-1 divides the optimizer state (+ DeepSpeed's fp32 partition, 4 B) by the ranks, ZeRO-2
    the gradients too, ZeRO-3 the parameters too (Rajbhandari et al. 2020 §3); stage 0 divides
    nothing. Four ranks also share the step's rows."""
    from transformers import AutoModelForCausalLM

    n = _n(AutoModelForCausalLM.from_pretrained(tiny_model))
    expect = {
        0: (4 * n, 4 * n, 8 * n),
        1: (4 * n, 4 * n, 12 * n // 4),
        2: (4 * n, 4 * n // 4, 12 * n // 4),
        3: (4 * n // 4, 4 * n // 4, 8 * n // 4),
    }
    for stage, (w, g, k) in expect.items():
        row = _row(P.plan("dpo", tiny_model, DPOConfig(ranks=4, zero_stage=stage)), "policy")
        assert (row.bytes["params"], row.bytes["grads"], row.bytes["optimizer"]) == (w, g, k), stage
    one = _row(P.plan("dpo", tiny_model, DPOConfig(ranks=1)), "policy").bytes["activations"]
    four = _row(P.plan("dpo", tiny_model, DPOConfig(ranks=4)), "policy").bytes["activations"]
    assert four * 4 == one  # 8 pairs: 2 per rank
    off = _row(P.plan("dpo", tiny_model, DPOConfig(ranks=4, zero_stage=2, offload_optimizer=True)), "policy")
    assert off.bytes["optimizer"] == 0 and off.host == 12 * n // 4 + 4 * n // 4 and off.device == "cpu"
    assert off.total == _row(P.plan("dpo", tiny_model, DPOConfig(ranks=4, zero_stage=2)), "policy").total + n
    # ^ on the CPU the host is the device: offloading moves nothing off it (and adds the host gradient partition)


def test_lora_trains_the_adapters_only_and_drops_the_reference(tiny_model, gpt2):
    """With lora_r the gradients and optimizer state are the adapters' (counted on the peft model the
    trainer builds, `lora.attach`); the base stays whole and frozen; the reference row is gone
    (the policy's base is the reference)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from raypai.alignment import lora as L

    for path, cfg in ((tiny_model, DPOConfig(lora_r=4)), (gpt2, DPOConfig(lora_r=8, lora_target_modules=("c_attn",)))):
        peft = L.attach(AutoModelForCausalLM.from_pretrained(path), cfg.lora())
        t, total = _n(peft, trainable=True), _n(peft)
        p = P.plan("dpo", path, cfg)
        row = _row(p, "policy")
        assert (row.bytes["grads"], row.bytes["optimizer"], row.bytes["params"]) == (4 * t, 8 * t, 4 * total), path
        assert [r.role for r in p.rows] == ["policy"]
        full = _row(P.plan("dpo", path, replace(cfg, lora_r=0, lora_target_modules=())), "policy")
        assert row.bytes["grads"] < full.bytes["grads"] / 5
    cfg = RewardModelConfig(lora_r=4)
    rm = AutoModelForSequenceClassification.from_pretrained(tiny_model, num_labels=1)
    peft = L.attach(rm, cfg.lora(), L.head_modules(rm))
    row = _row(P.plan("reward_model", tiny_model, cfg), "reward-trainer")
    assert (row.bytes["grads"], row.bytes["params"]) == (4 * _n(peft, trainable=True), 4 * _n(peft))


def test_the_roles_each_algorithm_places(tiny_model):
    """GRPO has a reference only with beta > 0 (and no LoRA); PPO a critic; a reward model scored
    in is a CPU role; GRPO trains on prompts × group_size sequences, DPO on chosen + rejected."""
    path = tiny_model
    roles = lambda algo, cfg, **kw: [r.role for r in P.plan(algo, path, cfg, **kw).rows]  # noqa: E731
    assert roles("grpo", GRPOConfig()) == ["policy", "rollout"]
    assert roles("grpo", GRPOConfig(beta=0.04)) == ["policy", "reference", "rollout"]
    assert roles("grpo", GRPOConfig(beta=0.04, lora_r=4)) == ["policy", "rollout"]
    assert roles("ppo", PPOConfig(), reward_model_dir=path) == ["policy", "critic", "reference", "rollout", "reward"]
    assert roles("sft", SFTConfig()) == ["policy"]
    grpo = _row(P.plan("grpo", path, GRPOConfig(prompts_per_step=2, group_size=4)), "policy").note
    dpo = _row(P.plan("dpo", path, DPOConfig(batch_size=3)), "policy").note
    assert "8 sequences per micro-batch" in grpo and "6 sequences per micro-batch" in dpo
    assert _row(P.plan("ppo", path, PPOConfig(gpus=1), reward_model_dir=path), "reward").device == "cpu"


def test_a_tensor_parallel_rollout_replica_holds_its_share_of_the_weights_and_kv_cache(tiny_model):
    """rollout_tensor_parallel = k: vLLM shards the weights and the KV heads over the replica's k GPUs,
    so its row (the bytes of one of them) holds 1/k of each; what is not sharded (logits) is unchanged."""
    one = GRPOConfig(rollout_engine="vllm", gpus=4)
    whole = _row(P.plan("grpo", tiny_model, one), "rollout")
    half = _row(P.plan("grpo", tiny_model, replace(one, rollout_tensor_parallel=2)), "rollout")
    assert half.bytes["params"] == -(-whole.bytes["params"] // 2) and whole.bytes["params"] > 0
    assert half.bytes["buffers"] == -(-whole.bytes["buffers"] // 2)
    assert half.bytes["logits"] == whole.bytes["logits"]
    assert "over 2 GPUs" in half.note and "over" not in whole.note


def _saved_bytes(model, ids, lean: bool) -> int:
    """Bytes of the distinct tensors autograd saves for the backward of the trainer's log-prob
    forward (`_tensors.token_logprobs`), the parameters themselves left out."""
    from raypai.alignment._tensors import token_logprobs

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    B, T = ids.shape
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        token_logprobs(model, ids, torch.ones_like(ids), where=torch.ones(B, T - 1), lean=lean)
    return sum(seen.values())


def test_activation_formula_tracks_what_autograd_saves_and_checkpointing_cuts_it(tiny_model):
    """Korthikanti et al.'s count for the blocks (`block_values`), the saved fp32 logits (half the
    plan's logits term, which adds their gradient) and the lean forward's weight copies are within
    15% of the bytes autograd saves for the tiny Llama's forward, at two batch shapes. With
    activation checkpointing (the model's own forward) what is saved is at most the plan's
    checkpointed estimate (block inputs + one block being recomputed), and far below the full one."""
    from transformers import AutoModelForCausalLM

    s = P.read_model(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model).train()
    g = torch.Generator().manual_seed(0)
    for B, T in ((4, 32), (8, 64)):
        ids = torch.randint(0, s.vocab, (B, T), generator=g)
        planned = (
            P.activation_bytes(s, B, T, value_bytes=4, checkpointing=False)
            + P.logit_bytes(s, B, T - 1, scalar=False) // 2
            + P.weight_copies(s, on_gpu=False, blocks=s.layers)
        )
        measured = _saved_bytes(model, ids, lean=True)
        assert abs(planned - measured) / measured < 0.15, (B, T, planned, measured)
    full = P.activation_bytes(s, 8, 64, value_bytes=4, checkpointing=False)
    ckpt = P.activation_bytes(s, 8, 64, value_bytes=4, checkpointing=True)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    saved = _saved_bytes(model, ids, lean=False) - P.logit_bytes(s, 8, 63, scalar=False) // 2
    assert saved <= ckpt < full * 0.75, (saved, ckpt, full)
    cfg = DPOConfig(batch_size=8)
    on, off = (_row(P.plan("dpo", tiny_model, replace(cfg, activation_checkpointing=c)), "policy") for c in (1, 0))
    assert on.bytes["activations"] < off.bytes["activations"] and on.bytes["buffers"] < off.bytes["buffers"]
    assert on.bytes["params"] == off.bytes["params"]


def test_the_trainers_lean_forward_honours_activation_checkpointing(tiny_model):
    """What the plan assumes of `activation_checkpointing=True`: the trainer's forward (the lean one
    for Llama-family models) keeps less for the backward."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model).train()
    ids = torch.randint(0, model.config.vocab_size, (8, 64), generator=torch.Generator().manual_seed(0))
    before = _saved_bytes(model, ids, lean=True)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert _saved_bytes(model, ids, lean=True) < 0.75 * before


def test_an_impossible_config_is_refused_with_fixes_that_fit(tiny_model):
    """At 10 MB per rank the policy's activations do not fit: `check` names the role and the
    changes that would fit; each fix, applied to the config, fits when planned again; a fitting
    config passes and its table says so."""
    cfg = DPOConfig(batch_size=16, memory_gb=0.01)
    with pytest.raises(ConfigError) as err:
        P.check("dpo", tiny_model, cfg)
    p = P.plan("dpo", tiny_model, cfg)
    assert not p.fits and p.fixes and len(p.fixes) <= 6
    text = str(err.value)
    assert "policy needs" in text and "memory_gb=0.01" in text and f"it fits with {p.fixes[0]}" in text
    for fix in p.fixes:
        fixed = replace(cfg, **fix.changes)
        assert P.plan("dpo", tiny_model, fixed).fits, fix
    peaks = [f.peak for f in p.fixes if len(f.changes) == len(p.fixes[0].changes)]
    assert peaks == sorted(peaks)  # most headroom first among fixes of as many changes
    # no fix contains another: each is needed whole
    sets = [set(f.changes) for f in p.fixes]
    assert not any(a < b for a in sets for b in sets)
    assert "OVER" in p.table() and "does not fit" in p.table()
    ok = P.check("dpo", tiny_model, replace(cfg, memory_gb=1.0))
    assert ok.fits and ok.fixes == [] and ok.table().endswith("fits") and ok.to_dict()["fits"]


def test_no_change_fits_a_model_larger_than_the_memory(tiny_model):
    """Weights alone over the capacity: no config change is offered, the refusal says what to do."""
    p = P.plan("sft", tiny_model, SFTConfig(memory_gb=1e-6))
    assert not p.fits and p.fixes == []
    with pytest.raises(ConfigError, match="use a smaller model"):
        P.check("sft", tiny_model, SFTConfig(memory_gb=1e-6))


def _raypai(*args, home):
    env = {**os.environ, "RAYPAI_HOME": str(home)}
    env.pop("RAY_ADDRESS", None)
    raypai = Path(sys.executable).parent / "raypai"
    out = subprocess.run([str(raypai), *args], capture_output=True, text=True, env=env, timeout=300)
    out.text = out.stdout + out.stderr
    return out


def test_align_plan_prints_the_plan_and_exits_0_or_2_without_ray(tiny_model, tmp_path):
    """`raypai align ALGO --model M --plan` needs no --data or --out and starts no Ray: exit 0 and
    the table when the plan fits; exit 2 (REFUSED) and the fixes when it does not."""
    out = _raypai("align", "grpo", "--model", tiny_model, "--plan", home=tmp_path / "home")
    assert out.returncode == 0, out.text
    assert "policy" in out.stdout and "rollout" in out.stdout and out.stdout.rstrip().endswith("fits")
    (tmp_path / "tight.yaml").write_text("memory_gb: 0.01\nbeta: 0.04\n")
    args = ["align", "grpo", "--model", tiny_model, "--config", str(tmp_path / "tight.yaml"), "--plan"]
    out = _raypai(*args, home=tmp_path / "home")
    assert out.returncode == 2, out.text
    first = str(P.plan("grpo", tiny_model, GRPOConfig(memory_gb=0.01, beta=0.04)).fixes[0])
    assert "does not fit" in out.stdout and f"  - {first} (" in out.stdout, out.stdout
    assert "Started a local Ray" not in out.text


def test_align_without_plan_still_needs_data_and_out(tiny_model):
    """--data and --out are optional for --plan only: a run without them is refused, naming both."""
    from raypai.alignment.cli import align_command

    options = dict(eval_data=None, reward=[], reward_model=None, pairs=None, config=None, eval_fraction=0.1)
    with pytest.raises(ConfigError) as err:
        align_command("grpo", tiny_model, None, None, **options)
    assert err.value.problems == ["raypai align needs --data", "raypai align needs --out"]
