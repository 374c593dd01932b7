"""`precision` (Resources): bf16 roles on CPUs with bf16 units, and results within tolerance of fp32."""

from __future__ import annotations

import pytest
import torch

from raypai.alignment import GRPOConfig, SFTConfig
from raypai.alignment.roles._device import cpu_has_bf16, run_dtype
from raypai.alignment.roles.trainer import Trainer
from raypai.errors import ConfigError


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        return {w for line in f if line.startswith("flags") for w in line.split(":", 1)[1].split()}


def test_auto_is_bf16_on_gpus_and_on_cpus_with_bf16_units_for_models_wide_enough(tmp_path):
    from raypai.alignment.roles._device import BF16_MIN_HIDDEN, hidden_size
    from raypai.alignment.tasks.tiny import build_tiny_model

    flags = _cpu_flags()  # the kernel's word on the CPU, independent of torch's check
    assert cpu_has_bf16() == bool({"avx512_bf16", "amx_bf16"} & flags)
    units = "bfloat16" if cpu_has_bf16() else "float32"
    assert run_dtype("auto", on_gpu=False, hidden=BF16_MIN_HIDDEN) == units
    assert run_dtype("auto", on_gpu=False, hidden=BF16_MIN_HIDDEN // 2) == "float32"  # casts would cost more
    assert run_dtype("auto", on_gpu=True, hidden=64) == "bfloat16"
    assert run_dtype("fp32", on_gpu=True) == run_dtype("fp32", on_gpu=False) == "float32"
    assert run_dtype("bf16", on_gpu=False, hidden=64) == "bfloat16"
    gpt2 = build_tiny_model(tmp_path / "g", family="gpt2", hidden=64)  # n_embd, not hidden_size
    assert hidden_size(gpt2) == 64 and GRPOConfig().dtype(gpt2) == "float32"
    assert GRPOConfig(precision="bf16").dtype(gpt2) == "bfloat16" and SFTConfig(precision="fp32").dtype() == "float32"
    with pytest.raises(ConfigError, match=r"GRPOConfig.precision 'fp16' is unknown; choose one of auto, fp32, bf16"):
        GRPOConfig(precision="fp16")


def _batch(model_dir: str, rows: int = 6, length: int = 24, seed: int = 0) -> tuple[dict, torch.Tensor]:
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (rows, length), generator=g)
    att = torch.ones_like(ids)
    where = torch.zeros(rows, length - 1, dtype=torch.bool)
    where[:, 8:] = True  # the labels after an 8-token prompt
    return {"input_ids": ids, "attention_mask": att}, where


def _logprobs_and_grad(model_dir: str, compute: str, batch: dict, where: torch.Tensor):
    t = Trainer(model_dir, 1e-3, 0, 0, threads=2, compute_dtype=compute)
    lp = t._forward.logprobs(batch, where)
    (lp[where].sum()).backward()
    grad = torch.cat([p.grad.flatten() for p in t.net.parameters() if p.grad is not None])
    return lp.detach()[where], grad


@pytest.mark.parametrize("family", ["raypai", "llama3", "qwen2", "gpt2"])
def test_a_bf16_trainer_gives_the_fp32_logprobs_and_gradient_within_tolerance(family, tmp_path):
    """bf16 autocast over fp32 weights: per-token log-probs within 0.01 nats of fp32 on average and
    0.05 at most, and the gradient pointing the same way (cosine > 0.999); a different model (the
    negative) is far outside both. Measured: 0.0005 mean, 0.003 max, cosine 0.99999; the other
    model 0.18 and ~0."""
    from raypai.alignment.tasks.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "m", family=family, hidden=64, layers=2)
    other = build_tiny_model(tmp_path / "o", family=family, hidden=64, layers=2, seed=1)
    batch, where = _batch(model)
    lp32, g32 = _logprobs_and_grad(model, "float32", batch, where)
    lp16, g16 = _logprobs_and_grad(model, "bfloat16", batch, where)
    lpo, go = _logprobs_and_grad(other, "float32", batch, where)
    cos = torch.nn.functional.cosine_similarity
    assert not torch.equal(lp16, lp32)  # the bf16 path really ran in bf16
    err = (lp16 - lp32).abs()
    assert err.mean() < 0.01 and err.max() < 0.05 and cos(g16, g32, dim=0) > 0.999, (err.mean(), err.max())
    assert (lpo - lp32).abs().mean() > 0.1 and cos(go, g32, dim=0) < 0.5  # a wrong model is told apart


def test_a_grpo_run_hands_the_rollout_weights_in_the_precision_it_runs_in(ray_align, tiny_model, tmp_path):
    """`precision="bf16"` samples from bf16 weights: the trainer copies them over at 2 bytes an
    element of the state dict (a tied head's too). The defaults on this tiny model (hidden 64, below
    BF16_MIN_HIDDEN) are fp32: the replica runs on the trainer's own fp32 parameters (4 bytes each, once)."""
    from transformers import AutoModelForCausalLM

    from raypai.alignment import run_grpo
    from raypai.alignment.data import prompt_examples
    from raypai.alignment.tasks import arithmetic as ar

    prompts = prompt_examples(ar.prompt_rows(ar.problems(max_operand=9)[:8]))
    per_param = {}
    for precision in ("bf16", "auto"):
        cfg = GRPOConfig(
            steps=2, prompts_per_step=2, group_size=2, max_new_tokens=4, eval_every=10**6, precision=precision
        )
        out = run_grpo(
            tiny_model,
            str(tmp_path / precision),
            prompts,
            prompts[:2],
            cfg,
            run_name=f"t-precision-{precision}",
            rewards=["raypai.alignment.tasks.arithmetic:exact_match_reward"],
        )
        per_param[precision] = out["sync_bytes"] / out["total_params"]
    elements = sum(t.numel() for t in AutoModelForCausalLM.from_pretrained(tiny_model).state_dict().values())
    assert per_param == {"bf16": 2 * elements / out["total_params"], "auto": 4.0}, per_param
