"""Sleep and wake a model (and its optimizer) between the phases of roles that share one GPU.

When the trainer and the rollout are colocated on one device they take turns: during rollout the
trainer's weights, gradients and optimizer state sit idle in GPU memory that the rollout's KV cache
could use, and during the update the rollout's cache is freed for the trainer. `sleep` moves every
tensor of a model and optimizer to host memory and hands the device memory back to the allocator;
`wake` puts each tensor back on the device it came from, bitwise equal:

    slept = sleep(trainer.model, trainer.optimizer)   # before rollout: GPU memory goes back
    rollouts = policy.generate(prompts)               # the rollout's KV cache uses it
    slept.wake()                                      # before the update, on the same devices
    trainer.update(rollouts, advantages)

The idea is ChatLearn's parameter/optimizer offload between colocated phases and verl's
sleep/wake of the hybrid engine; this is a small torch-only form of it.

What moves: each parameter's data (the `Parameter` objects stay, since optimizers and DeepSpeed
engines hold references to them), each gradient, each buffer (rotary `inv_freq` and the like), and
each tensor in the optimizer's state. Tensors are moved a whole storage at a time, so tied weights
(GPT-2's `lm_head` and `wte`) and views into one flat buffer move once and share storage again after
wake. A tensor already on `to` is left alone and not counted: AdamW's CPU `step` counter, and every
tensor of a model on the CPU, where moving would free nothing and would unbind parameters that live
in shared memory (`sync.py`'s live shared weights). Anything else holding device memory (an
engine's own buffers, activations a caller kept) is not reached and stays where it is.

While asleep the model refuses a forward pass and the optimizer a step (`TrainError`): the role
must call `wake()` before its next phase.

Pinned host memory (the default when the tensors come from CUDA) is allocated once per tensor and
kept on the model as `model._raypai_host_buffers`: pinning a gigabyte costs far more than copying
it, so every later sleep copies into the same pages. That host memory stays held while awake.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from raypai.errors import TrainError

_ASLEEP = "_raypai_asleep"  # model attribute: the Slept holding it, while asleep
_HOST_BUFFERS = "_raypai_host_buffers"  # model attribute: {tensor name: pinned uint8 host buffer}


@dataclass
class _View:
    """One tensor backed by a moved storage, and where in that storage it sits (offset in elements)."""

    tensor: torch.Tensor
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


@dataclass
class _Storage:
    source: torch.device
    host: torch.Tensor  # (nbytes,) uint8 on `to`: the storage's bytes while asleep
    views: list[_View]


class Slept:
    """A model and optimizer asleep on `to`. `bytes`: bytes moved; `seconds`: the sleep's wall time,
    devices synchronised."""

    def __init__(self, model: torch.nn.Module, storages: list[_Storage], hooks: list, *, bytes: int, seconds: float):
        self.bytes = bytes
        self.seconds = seconds
        self._model = model
        self._storages = storages
        self._hooks = hooks
        self._awake = False

    def wake(self) -> float:
        """Put every moved tensor back on the device it came from; returns the wall time in seconds."""
        if self._awake:
            raise TrainError(
                f"{type(self._model).__name__} was already woken from this sleep: wake() is called "
                f"once per sleep(); sleep the model again for a new Slept to wake"
            )
        start = time.perf_counter()
        for s in self._storages:
            device = torch.empty(s.host.numel(), dtype=torch.uint8, device=s.source)
            device.copy_(s.host, non_blocking=_is_cuda(s.source, s.host.device))
            _rebind(s.views, device)
        _synchronize({s.source for s in self._storages})
        for hook in self._hooks:
            hook.remove()
        setattr(self._model, _ASLEEP, None)
        self._storages, self._hooks, self._awake = [], [], True  # unpinned host copies are freed here
        return time.perf_counter() - start


def sleep(model: torch.nn.Module, optimizer=None, *, to: str | torch.device = "cpu", pin: bool | None = None) -> Slept:
    """Move `model`'s parameters, gradients and buffers and `optimizer`'s state to `to`, free the
    device memory they held, and return the `Slept` whose `wake()` moves them back.

    `optimizer`: a torch optimizer, or an object wrapping one as `.optimizer` (DeepSpeed's).
    `pin`: pin the host copies; None pins when the tensors come from CUDA and `to` is the CPU."""
    name = type(model).__name__
    if getattr(model, _ASLEEP, None) is not None:
        raise TrainError(
            f"{name} is already asleep (sleep() moved its tensors off their device): call wake() "
            f"on the Slept that sleep() returned before sleeping it again"
        )
    to = torch.device(to)
    if pin and to.type != "cpu":
        raise TrainError(f"sleep({name}, pin=True) pins host memory, so `to` must be 'cpu' (got {str(to)!r})")
    opt = _torch_optimizer(optimizer)
    start = time.perf_counter()
    storages: dict[tuple[torch.device, int], tuple[str, list[torch.Tensor]]] = {}
    for key, t in _named_tensors(model, opt):
        if t.device.type == "meta" or _on(t.device, to):
            continue
        storage = (t.device, t.untyped_storage().data_ptr())
        storages.setdefault(storage, (key, []))[1].append(t)
    sources = {device for device, _ in storages}
    if pin is None:
        pin = to.type == "cpu" and any(d.type == "cuda" for d in sources)
    cache = getattr(model, _HOST_BUFFERS, None)
    if pin and cache is None:
        cache = {}
        setattr(model, _HOST_BUFFERS, cache)
    moved, in_flight = [], []
    for (source, _), (key, tensors) in storages.items():
        src = torch.empty(0, dtype=torch.uint8, device=source).set_(tensors[0].untyped_storage())  # (nbytes,)
        host = _host_buffer(cache if pin else None, key, src.numel(), to)
        host.copy_(src, non_blocking=_is_cuda(source, to))
        views = [_View(t, t.storage_offset(), tuple(t.size()), tuple(t.stride())) for t in tensors]
        _rebind(views, host)
        moved.append(_Storage(source, host, views))
        in_flight.append(src)  # the old storage outlives its copy even if it came from another stream
    _synchronize(sources | {to})
    del in_flight  # the device storages are freed here, with the last reference to each
    if any(d.type == "cuda" for d in sources):
        torch.cuda.empty_cache()  # hand the freed blocks back to the device, for the other role

    def refuse(*_):
        raise TrainError(
            f"{name} is asleep (sleep() moved its tensors to {to}): call wake() on the Slept that "
            f"sleep() returned before this role's next phase"
        )

    hooks = [model.register_forward_pre_hook(refuse)]
    if opt is not None and hasattr(opt, "register_step_pre_hook"):
        hooks.append(opt.register_step_pre_hook(refuse))
    slept = Slept(model, moved, hooks, bytes=sum(s.host.numel() for s in moved), seconds=time.perf_counter() - start)
    setattr(model, _ASLEEP, slept)
    return slept


def _torch_optimizer(optimizer):
    """The object holding the optimizer state: `optimizer` itself, or the one it wraps as `.optimizer`."""
    if optimizer is None:
        return None
    for candidate in (optimizer, getattr(optimizer, "optimizer", None)):
        if isinstance(getattr(candidate, "state", None), Mapping):
            return candidate
    raise TrainError(
        f"sleep(optimizer=...) needs a torch optimizer or an object wrapping one as `.optimizer`; "
        f"{type(optimizer).__name__} has neither a `.state` dict nor `.optimizer.state`"
    )


def _named_tensors(model: torch.nn.Module, opt) -> list[tuple[str, torch.Tensor]]:
    """Every tensor to move, once each (tied parameters appear once), named stably across sleeps so that
    the pinned host buffers can be found again."""
    params = [(f"param:{n}", p) for n, p in model.named_parameters()]
    if opt is not None:  # parameters the optimizer owns beyond the model's, e.g. fp32 master copies
        params += [
            (f"param:#{g}.{i}", p)
            for g, group in enumerate(getattr(opt, "param_groups", []))
            for i, p in enumerate(group["params"])
        ]
    names = {}
    for key, p in params:
        names.setdefault(id(p), key.removeprefix("param:"))
    out = params + [(f"grad:{key}", p.grad) for key, p in params if p.grad is not None]
    out += [(f"buffer:{n}", b) for n, b in model.named_buffers()]
    if opt is not None:
        out += [
            (f"state:{names.get(id(p), f'#{i}')}:{k}", v)
            for i, (p, state) in enumerate(opt.state.items())
            for k, v in state.items()
            if isinstance(v, torch.Tensor)
        ]
    seen: set[int] = set()
    return [(key, t) for key, t in out if not (id(t) in seen or seen.add(id(t)))]


def _host_buffer(cache: dict | None, key: str, nbytes: int, to: torch.device) -> torch.Tensor:
    """A (nbytes,) uint8 buffer on `to`: the cached pinned one when caching and it still fits, else new."""
    if cache is None:
        return torch.empty(nbytes, dtype=torch.uint8, device=to)
    buf = cache.get(key)
    if buf is None or buf.numel() != nbytes or not buf.is_pinned():
        buf = cache[key] = torch.empty(nbytes, dtype=torch.uint8, device=to, pin_memory=True)
    return buf


def _rebind(views: list[_View], storage: torch.Tensor) -> None:
    """Point each tensor's data at the same place in `storage` ((nbytes,) uint8) it had in the old one."""
    for v in views:
        v.tensor.data = torch.empty(0, dtype=v.tensor.dtype, device=storage.device).set_(
            storage.untyped_storage(), v.offset, v.size, v.stride
        )


def _on(device: torch.device, to: torch.device) -> bool:
    return device.type == to.type and (to.index is None or device.index == to.index)


def _is_cuda(a: torch.device, b: torch.device) -> bool:
    # asynchronous copies only where `_synchronize` waits for them
    return a.type == "cuda" or b.type == "cuda"


def _synchronize(devices) -> None:
    for d in devices:
        if d.type == "cuda":
            torch.cuda.synchronize(d)
