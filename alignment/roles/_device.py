"""Where a role computes: the CPU or a CUDA device, in fp32 or bf16, and what crosses into it.

A role placed with a GPU (`RoleSpec(gpus=...)`, e.g. `GRPOConfig.gpus`) runs on `cuda`. In bf16
(`precision`: "auto" or "bf16" on a GPU) the trainer keeps fp32 weights and AdamW state and runs its
forward under bf16 autocast (mixed precision: Micikevicius et al. 2018, with bf16 instead of fp16 so
no loss scaling); the rollout and the reference hold bf16 weights for inference. On the CPU the same
split applies when `precision` is "bf16" (or "auto" on a CPU with bf16 units: AVX-512 BF16 or AMX,
where oneDNN runs bf16 matrix products several times faster than fp32 ones); "fp32" keeps every role
in fp32. Batches come from the driver on the CPU and go back there; only the role moves them."""

from __future__ import annotations

import contextlib
import os

import torch

from raypai.errors import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PRECISIONS = ("auto", "fp32", "bf16")


def cpu_has_bf16() -> bool:
    """Whether this machine's CPU multiplies bf16 natively (AVX-512 BF16 or AMX tiles)."""
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


# "auto" on a CPU: bf16 from this hidden size up. Below it the casts around each product cost more
# than bf16 saves: on a Zen 4 (2 vCPUs) synchronous GRPO ran 0.6× as fast in bf16 as in fp32 at
# hidden 128 (issue #14's toy Llama), 1.6× as fast at hidden 256 (the 9.8 M Qwen2): benchmarks/RESULTS.md
BF16_MIN_HIDDEN = 256


def run_dtype(precision: str, on_gpu: bool, hidden: int | None = None) -> str:
    """The compute dtype of a run's model roles for `precision` (`Resources.precision`): "bfloat16"
    (the trainer's mixed precision: bf16 products, fp32 master weights; bf16 weights in the inference
    roles) or "float32". "auto" is bf16 on a GPU, and on a CPU with bf16 units for a model whose
    `hidden` size is at least BF16_MIN_HIDDEN (decided where the driver runs: a cluster's nodes are
    taken to be one machine type)."""
    if precision not in PRECISIONS:
        raise ConfigError([f"precision {precision!r} is not one of {', '.join(PRECISIONS)}"], what="role device")
    if precision == "fp32":
        return "float32"
    if precision == "bf16" or on_gpu:
        return "bfloat16"
    big = hidden is None or hidden >= BF16_MIN_HIDDEN
    return "bfloat16" if big and cpu_has_bf16() else "float32"


def hidden_size(model_dir: str | None) -> int | None:
    """The model's hidden size from its config (None: no folder, or a config without one)."""
    if not model_dir:
        return None
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.from_pretrained(model_dir)
    except (OSError, ValueError):
        return None
    cfg = getattr(cfg, "text_config", None) or cfg
    return next((getattr(cfg, k) for k in ("hidden_size", "n_embd", "d_model") if hasattr(cfg, k)), None)


def role_device(device: str, role: str) -> torch.device:
    """torch.device for `device` ("cpu" or "cuda"), refusing a GPU this process cannot see."""
    if device not in ("cpu", "cuda"):
        raise ConfigError([f"role {role!r}: device {device!r} is not 'cpu' or 'cuda'"], what="role device")
    if device == "cuda" and not torch.cuda.is_available():
        seen = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
        raise ConfigError(
            [
                f"role {role!r} was placed with a GPU, but torch in its actor sees no CUDA device "
                f"(torch {torch.__version__}, CUDA_VISIBLE_DEVICES={seen}): install a CUDA build of "
                "torch on the GPU nodes, or run the roles on CPUs (gpus=0)"
            ],
            what="role device",
        )
    return torch.device(device)


def inference_dtype(device: torch.device, dtype: str | None = None) -> torch.dtype:
    """The weights' dtype of an inference role: `dtype` when given, else bf16 on CUDA and fp32 on the CPU."""
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ConfigError([f"dtype {dtype!r} is not one of {', '.join(DTYPES)}"], what="role device")
    return DTYPES[dtype]


def autocast(device: torch.device, dtype: torch.dtype | None):
    """The trainer's forward under `dtype` autocast (bf16: mixed precision), or as it is (None: fp32)."""
    return contextlib.nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)


def trainer_dtype(device: torch.device, compute: str | None) -> torch.dtype | None:
    """A trainer's autocast dtype: bf16 when `compute` (`run_dtype`'s) is "bfloat16", none when it is
    "float32"; not given: bf16 on CUDA and none (fp32) on the CPU."""
    if compute is not None:
        return None if DTYPES[compute] == torch.float32 else DTYPES[compute]
    return torch.bfloat16 if device.type == "cuda" else None


def maybe(x, device: torch.device):
    """An optional tensor on `device` (batches: `raypai.alignment._tensors.to_device`)."""
    return x.to(device, non_blocking=True) if isinstance(x, torch.Tensor) else x


def release(device: torch.device) -> None:
    """Hand the allocator's free blocks back to the device, for the roles sharing it (a role's
    cached blocks are invisible to another process)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
