"""Weight sync over a collective group (`weight_transport="collective"`): the trainer's rank 0 and
the rollout replicas on other nodes form a process group of their own, apart from DeepSpeed's (gloo
between CPUs, NCCL between GPUs), and the trainer broadcasts its weights to them bucket by bucket.
Nothing passes through Ray's object store or the driver, and no rank holds more than one bucket
beyond its own weights. verl and OpenRLHF push weights into their rollout engines the same way, over
a group made beside the training one.

Both sides walk one manifest, the trainer's: its tensors in the order it produces them (a ZeRO-3
trainer's gather order, `HandsOver._gathered_parts`), cut into buckets of about `bucket_bytes` in
the replicas' dtype. Each bucket travels as one flat byte tensor (every tensor at a 64-byte aligned
offset), so a broadcast is one collective call per bucket. A replica checks the manifest against
its own weights when it joins and refuses a mismatch by name.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

ALIGN = 64
BACKENDS = {"cpu": "gloo", "cuda": "nccl"}


def manifest(entries: list[tuple[str, tuple, torch.dtype]], bucket_bytes: int) -> list[list[tuple]]:
    """`entries` [(name, shape, dtype)] in send order → buckets [[(name, shape, dtype, offset,
    nbytes)]], each up to about `bucket_bytes` (a tensor larger than that is a bucket of its own)."""
    buckets, bucket, offset = [], [], 0
    for name, shape, dtype in entries:
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        if bucket and offset + nbytes > bucket_bytes:
            buckets.append(bucket)
            bucket, offset = [], 0
        bucket.append((name, tuple(shape), dtype, offset, nbytes))
        offset += -(-nbytes // ALIGN) * ALIGN
    if bucket:
        buckets.append(bucket)
    return buckets


def bucket_size(bucket: list[tuple]) -> int:
    name, shape, dtype, offset, nbytes = bucket[-1]
    return offset + nbytes


def check_against(buckets: list[list[tuple]], own: dict[str, torch.Tensor]) -> None:
    """Refuse a manifest whose tensors are not this replica's (names, shapes, dtypes), naming them."""
    sent = {name: (shape, dtype) for b in buckets for name, shape, dtype, _, _ in b}
    mine = {name: (tuple(t.shape), t.dtype) for name, t in own.items()}
    bad = sorted(n for n in sent.keys() | mine.keys() if sent.get(n) != mine.get(n))
    if bad:
        raise RuntimeError(
            f"the trainer's weights and this replica's differ in {len(bad)} tensors "
            f"(first: {bad[0]}: sent {sent.get(bad[0])}, held {mine.get(bad[0])}); the roles must load "
            "the same model in the replicas' dtype"
        )


def open_group(host: str, port: int, rank: int, size: int, backend: str, timeout_s: float):
    """This process's member of the weight group (rank 0: the trainer, which made the store at
    host:port), on `backend` (gloo or nccl). A process group of its own, outside
    torch.distributed's default one."""
    store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
    prefixed = dist.PrefixStore("raypai-weights/", store)
    if backend == "nccl":  # not run: needs GPUs in two processes
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timedelta(seconds=timeout_s)
        return dist.ProcessGroupNCCL(prefixed, rank, size, opts)
    return dist.ProcessGroupGloo(prefixed, rank, size, timedelta(seconds=timeout_s))


def make_store(timeout_s: float) -> tuple[object, str, int]:
    """The group's rendezvous, held by the trainer's rank 0: (store, host, port) on a free port."""
    import ray

    host = ray.util.get_node_ip_address()
    store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
    return store, host, store.port


def broadcast(group, flat: torch.Tensor) -> None:
    """`flat` from rank 0 to every member (in place on the others)."""
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = 0, 0
    group.broadcast([flat], opts).wait()


def send(group, parts, buckets: list[list[tuple]], device: torch.device) -> int:
    """Rank 0's side: `parts` yields (name, tensor) in the manifest's order; each bucket goes out
    once it is full. Returns the bytes sent."""
    sent, it = 0, iter(parts)
    for bucket in buckets:
        flat = torch.empty(bucket_size(bucket), dtype=torch.uint8, device=device)
        for name, shape, dtype, offset, nbytes in bucket:
            got, t = next(it)
            if got != name:
                raise RuntimeError(f"weight group: the trainer produced {got!r} where its manifest has {name!r}")
            flat[offset : offset + nbytes].view(dtype).view(shape).copy_(t.detach())
        broadcast(group, flat)
        sent += flat.numel()
    return sent


def receive(group, buckets: list[list[tuple]], own: dict[str, torch.Tensor], device: torch.device) -> int:
    """A replica's side: each bucket received on `device` (the backend's: a GPU for NCCL) and
    copied into its own tensors. Returns the bytes."""
    got = 0
    with torch.no_grad():
        for bucket in buckets:
            flat = torch.empty(bucket_size(bucket), dtype=torch.uint8, device=device)
            broadcast(group, flat)
            for name, shape, dtype, offset, nbytes in bucket:
                own[name].copy_(flat[offset : offset + nbytes].view(dtype).view(shape))
            got += flat.numel()
    return got
