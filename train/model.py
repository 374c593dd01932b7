"""Model construction, parameter count and FLOPs per token."""

from __future__ import annotations

from pathlib import Path

from raypai.errors import TrainError
from raypai.train.config import ModelConfig

WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def build_model(
    cfg: ModelConfig,
    vocab_size: int,
    pad_id: int | None = None,
    eos_id: int | None = None,
    *,
    weights: bool = True,
    ds_config: dict | None = None,
):
    """A `LlamaForCausalLM` from the config, or the checkpoint at `cfg.init_from`.

    `weights=False`: the architecture only, on PyTorch's meta device (no memory allocated, no random
    init, no weights read), which is all the driver's plan needs to count parameters and read the
    shape; building a 1B-parameter model for real would cost it seconds and 4 GB per run.
    `ds_config`: a worker's DeepSpeed config; at ZeRO stage 3 the model is built (or loaded) under
    `deepspeed.zero.Init` through transformers' DeepSpeed integration, so this process only ever holds
    its own partition of each weight (and one module's whole weights while they are initialised), never
    the whole model. Every rank must call it then, in the process group DeepSpeed has adopted."""
    if weights and ds_config is not None and (ds_config.get("zero_optimization") or {}).get("stage") == 3:
        from transformers.integrations import HfDeepSpeedConfig

        keep = HfDeepSpeedConfig(ds_config)  # while it lives, from_config/from_pretrained build under zero.Init
        try:
            return _build(cfg, vocab_size, pad_id, eos_id, weights=True, zero3=True)
        finally:
            del keep
    return _build(cfg, vocab_size, pad_id, eos_id, weights=weights, zero3=False)


def _build(cfg: ModelConfig, vocab_size: int, pad_id: int | None, eos_id: int | None, *, weights: bool, zero3: bool):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if cfg.init_from:
        path = Path(cfg.init_from)
        if not (path / "config.json").exists():
            raise TrainError(f"model.init_from={cfg.init_from}: not a Hugging Face model folder (no config.json)")
        if weights:
            model = AutoModelForCausalLM.from_pretrained(path)
        else:
            if not any((path / name).exists() for name in WEIGHT_FILES):
                raise TrainError(
                    f"model.init_from={cfg.init_from}: no weights there (none of {', '.join(WEIGHT_FILES)}); "
                    "pass a folder written by save_pretrained"
                )
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
        if model.config.vocab_size != vocab_size:
            raise TrainError(
                f"vocab mismatch: model at {path} has vocab_size {model.config.vocab_size} but the "
                f"tokenizer has {vocab_size}; use the tokenizer the model was trained with"
            )
        return model
    hf = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden,
        intermediate_size=cfg.intermediate,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads,
        max_position_embeddings=cfg.max_positions,
        tie_word_embeddings=True,
        pad_token_id=pad_id,
        eos_token_id=eos_id,
        bos_token_id=eos_id,
    )
    if not weights:
        with torch.device("meta"):
            return LlamaForCausalLM(hf)
    if zero3:
        return AutoModelForCausalLM.from_config(hf)  # under zero.Init, initialised module by module on rank 0
    # The same draws from the seed as the ZeRO-3 build above: transformers skips torch's default init
    # there (the model's own `_init_weights` overwrites it anyway), so it is skipped here too, and the
    # initial weights of a run do not depend on its ZeRO stage.
    from transformers.initialization import no_init_weights

    with no_init_weights():
        model = LlamaForCausalLM(hf)
    model.initialize_weights()
    model.tie_weights()
    return model


def local_param_count(model) -> int:
    """Parameter elements this process holds (a tied matrix counts once). At ZeRO-3: its own
    partitions (`ds_tensor`, padded to an equal share per rank) plus whatever whole weights are
    present (`p.data` is empty once partitioned, whole for a gathered or persistent parameter)."""
    return sum(
        p.ds_tensor.numel() + p.data.numel() if hasattr(p, "ds_tensor") else p.numel() for p in model.parameters()
    )


def param_count(model) -> int:
    """Distinct parameters (a tied embedding/head matrix counts once)."""
    return sum(p.numel() for p in model.parameters())


def flops_per_token(n_params: int, layers: int, hidden: int, seq_len: int) -> float:
    """Training FLOPs per token: 6N for the weight matmuls (forward 2N, backward 4N; Kaplan et al.
    2020 §2.1) plus 12·L·H·T for attention scores and values over a T-token context (Chowdhery et
    al. 2022, PaLM App. B, with H = heads × head size). N counts the tied embedding once, which is
    the output-head matmul; the input lookup costs no FLOPs."""
    return 6.0 * n_params + 12.0 * layers * hidden * seq_len


def measure_peak_flops(seconds: float = 0.3, size: int = 1024, trials: int = 5) -> float:
    """FLOP/s this process reaches on an fp32 (size × size) matmul with its current torch thread
    count: the MFU denominator when none is configured. The best of `trials` short timings, so
    that other processes on a shared machine lower the estimate as little as possible."""
    import time

    import torch

    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.mm(a, b)
    best = 0.0
    for _ in range(trials):
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds / trials:
            torch.mm(a, b)
            n += 1
        best = max(best, 2 * size**3 * n / (time.perf_counter() - t0))
    return best
