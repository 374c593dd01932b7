"""The rank side of a role that is several ranks (`raypai.alignment.ranks.RankGroup` is the driver's
side): joining the role's process group, taking this rank's share of a batch's rows, and putting
the shares of a result back together.

Every rank of a role gets every call with the same arguments, in the same order (Ray runs an actor's
calls in the order they were made), so the ranks stay in step without a coordinator: each takes its
contiguous share of the batch's rows, computes, and the ranks meet in collectives (DeepSpeed's
gradient reduction, ZeRO-3's parameter gathers, the all-gathers here). A batch is a nest of dicts,
tuples and tensors whose tensors all have their rows first (what every objective's `assemble`
makes), so splitting each tensor along its first dimension keeps every row's parts together."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch


@dataclass(frozen=True)
class Rendezvous:
    """Where a role's ranks meet: the driver's TCPStore (`raypai.alignment.ranks.rendezvous`), a
    key prefix of the role's own and the collective timeout."""

    host: str
    port: int
    prefix: str
    ranks: int
    timeout_s: float


def join(rv: Rendezvous | None, rank: int, use_gpu: bool, deepspeed: bool = True) -> None:
    """Make this process rank `rank` of its role's process group (one rank: a group of its own, no
    network), and DeepSpeed's too (`deepspeed`). Collectives that wait longer than `rv.timeout_s`
    fail, so a dead rank ends the run."""
    if torch.distributed.is_initialized():
        return
    backend = "nccl" if use_gpu else "gloo"
    # DeepSpeed reads these; each rank's actor sees its own GPU (Ray sets CUDA_VISIBLE_DEVICES), so
    # its local rank is 0
    os.environ.update(RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE=str(rv.ranks if rv else 1))
    if rv is None or rv.ranks == 1:
        # a group of one needs no rendezvous at all: an in-memory store, no TCP port
        torch.distributed.init_process_group(backend, store=torch.distributed.HashStore(), rank=0, world_size=1)
    else:
        timeout = timedelta(seconds=rv.timeout_s)
        store = torch.distributed.TCPStore(rv.host, rv.port, is_master=False, timeout=timeout)
        torch.distributed.init_process_group(
            backend,
            store=torch.distributed.PrefixStore(rv.prefix, store),
            rank=rank,
            world_size=rv.ranks,
            timeout=timeout,
        )
    if deepspeed:
        from raypai.train._deepspeed import import_deepspeed

        # DeepSpeed's own comm layer adopts the group (ZeRO-3's loading under zero.Init needs it)
        import_deepspeed().init_distributed(dist_backend=backend)


def rows(batch) -> int:
    """The row count of a batch: its first tensor's first dimension (0 for no tensor)."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else 0
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for x in batch:
            n = rows(x)
            if n:
                return n
    return 0


def _take(x, part: int, parts: int):
    if isinstance(x, torch.Tensor):
        return torch.tensor_split(x, parts)[part] if x.dim() else x
    if isinstance(x, dict):
        return {k: _take(v, part, parts) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_take(v, part, parts) for v in x)
    return x


def share(batch, rank: int, ranks: int) -> tuple[object, float]:
    """(this rank's rows of `batch`, its weight). Rank r of n takes the r-th of n contiguous, near-equal
    slices of every tensor's rows. A rank whose slice is empty (fewer rows than ranks) takes the
    first row with weight 0: it still runs the same passes, so the ranks' collectives match, and its
    result counts for nothing."""
    if ranks == 1:
        return batch, 1.0
    mine = _take(batch, rank, ranks)
    if rows(mine) == 0 and rows(batch):
        return _take(batch, 0, rows(batch)), 0.0
    return mine, 1.0


def micro_count(batch, ranks: int, size: int) -> int:
    """Micro-batches per rank for `batch` split across `ranks` in micro-batches of `size` rows (0: one):
    the same number on every rank (that of the largest share), so the ranks' passes and collectives match."""
    if not size:
        return 1
    largest = -(-rows(batch) // ranks)
    return max(1, -(-largest // size))


def micro(batch, parts: int) -> list[tuple[object, float]]:
    """`batch` in `parts` near-equal micro-batches of rows, each with its weight: an empty one is the
    first row at weight 0 (as in `share`)."""
    out = []
    for i in range(parts):
        chunk = _take(batch, i, parts)
        out.append((chunk, 1.0) if rows(chunk) else (_take(batch, 0, rows(batch)), 0.0))
    return out


def _cat(parts: list):
    first = parts[0]
    if first is None:
        return None
    if isinstance(first, torch.Tensor):
        return torch.cat(parts) if first.dim() else first
    if isinstance(first, (list, tuple)):
        return type(first)(_cat([p[i] for p in parts]) for i in range(len(first)))
    if isinstance(first, dict):
        return {k: _cat([p[k] for p in parts]) for k in first}
    return first


def gather(part, weight: float, ranks: int):
    """Every rank's share of a result put back in row order, on every rank (an all-gather); the
    shares of weight-0 ranks (`share`) are left out."""
    if ranks == 1:
        return part
    out: list = [None] * ranks
    torch.distributed.all_gather_object(out, (part, weight))
    return _cat([p for p, w in out if w])


def all_sum(values: list[float], device: torch.device) -> list[float]:
    """The sums over the ranks of `values` (one all-reduce)."""
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(t)
    return t.tolist()
