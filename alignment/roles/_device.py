"""Where a role computes: the CPU (fp32) or a CUDA device (bf16), and what crosses into it.

A role placed with a GPU (`RoleSpec(gpus=...)`, e.g. `GRPOConfig.gpus`) runs on `cuda`: the
trainer keeps fp32 weights and AdamW state and runs its forward under bf16 autocast (mixed
precision: Micikevicius et al. 2018, with bf16 instead of fp16 so no loss scaling); the rollout and
the reference hold bf16 weights for inference. Batches come from the driver on the CPU and go back
there; only the role moves them."""

from __future__ import annotations

import contextlib
import os

import torch

from raypai.errors import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


def autocast(device: torch.device):
    """bf16 autocast on CUDA (the trainer's forward); nothing on the CPU, which trains in fp32."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def maybe(x, device: torch.device):
    """An optional tensor on `device` (batches: `raypai.alignment._tensors.to_device`)."""
    return x.to(device, non_blocking=True) if isinstance(x, torch.Tensor) else x


def release(device: torch.device) -> None:
    """Hand the allocator's free blocks back to the device, for the roles sharing it (a role's
    cached blocks are invisible to another process)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
