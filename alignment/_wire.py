"""Plain CPU tensors between raypai's processes as numpy arrays.

Ray pickles a `torch.Tensor` through torch's own reduction, which writes the tensor's storage with
`torch.save`, several times slower for a batch of small tensors than the same arrays as numpy, which
Ray passes as pickle-5 buffers (benchmarks/history/asides.md). `install()` makes the calling process send plain CPU
tensors as arrays; the receiving process needs nothing installed (Ray pickles the function that
rebuilds them by reference).

What changes: a CPU tensor arrives with its dtype, shape and values, as a tensor of its own: tensors
that shared a storage in the sender (views, tied weights) arrive as separate copies. Tensors the
arrays cannot carry exactly (on a GPU, requiring grad, sparse, conjugate or negative views, and
dtypes numpy lacks other than bfloat16) go the way Ray sends them otherwise.
"""

from __future__ import annotations

import io

import torch

_NUMPY_DTYPES = frozenset(
    {
        torch.float64,
        torch.float32,
        torch.float16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    }
)


def _plain(t: torch.Tensor) -> bool:
    return (
        t.device.type == "cpu"
        and not t.requires_grad
        and t.layout == torch.strided
        and not t.is_conj()
        and not t.is_neg()
    )


def to_wire(t: torch.Tensor):
    """(kind, payload, dtype name): an array for a plain CPU tensor (bfloat16 as its int16 bits),
    else torch's own serialized bytes."""
    if _plain(t) and t.dtype in _NUMPY_DTYPES:
        return "array", t.detach().numpy(), None
    if _plain(t) and t.dtype == torch.bfloat16:
        return "array", t.detach().view(torch.int16).numpy(), "bfloat16"
    buf = io.BytesIO()
    torch.save(t, buf)
    return "torch", buf.getvalue(), None


def from_wire(wire) -> torch.Tensor:
    kind, payload, dtype = wire
    if kind == "torch":
        return torch.load(io.BytesIO(payload), weights_only=False)
    # an array Ray hands out without a copy is read-only (it lives in the object store): torch needs
    # memory it may write
    array = payload if payload.flags.writeable else payload.copy()
    t = torch.from_numpy(array)
    return t.view(getattr(torch, dtype)) if dtype else t


def install() -> None:
    """Send this process's plain CPU tensors as arrays over Ray (a no-op where Ray is not running)."""
    import ray

    if ray.is_initialized():
        ray.util.register_serializer(torch.Tensor, serializer=to_wire, deserializer=from_wire)
