"""Explicit, measured weight sync from the trainer to the rollout replicas.

Two paths, chosen per replica:
- **shared memory** when the trainer and the replica run on the same node (always so for
  colocated roles): the trainer copies its weights into one flat buffer in `/dev/shm` (a header with
  the weights' version and a digest of the parameter layout, then every tensor at an aligned
  offset); the replica, in its own task order, checks the version it was told to expect and copies
  the buffer into its parameters. Nothing is pickled and nothing goes through the object store.
  verl's hybrid engine and ChatLearn's parameter sync do the same job in GPU memory; this is the
  host-memory form (CPU roles, or GPUs through a host copy).
- **object store** otherwise: one `state_dict` copy shared by the replicas on other nodes (a ZeRO-3
  trainer's gathered and put bucket by bucket, so no rank assembles a whole copy: `Trainer.state_parts`);
  or, with `transport="collective"`, a broadcast over a process group of the trainer and those
  replicas (gloo on CPUs, NCCL on GPUs: `raypai.alignment.sync_group`).

- **live shared parameters** (synchronous loops: the roles take turns, so nobody reads while the
  trainer writes): the trainer's parameters themselves live in that buffer (ZeRO stage 0, the
  default: DeepSpeed then updates them in place), and a same-node replica binds its own parameters
  to the same pages. A sync is then the version check alone: the trainer stamps its update count in
  the header after each optimizer step, and the replica refuses to sample unless the header holds
  the version it was told to expect. No copy on either side. Once every same-node replica has
  bound the trainer's buffer, later syncs send nothing at all: each sampling call reads the version
  from the header itself (and refuses while an update is being written), so the trainer and the
  replicas are not called between steps.

Either way a replica loads the new weights after the work already submitted to it and before
anything submitted later (an actor runs one caller's tasks in submission order), and
`sync_seconds` / `sync_bytes` are measured (`sync_bytes`: the size of the weights handed over,
copied or, live, shared).
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import torch

# Ray is imported where it is used: the buffer itself (SharedWeights) serves roles built in-process too

HEADER = 64  # bytes: int64 version, int64 layout digest, padding
ALIGN = 64

_NODES: dict[str, str] = {}  # actor id -> node id (an actor never moves)
_FIRST_ROUND: dict[str, tuple] = {}  # trainer id -> (its first shared round's loads, the replicas, `written`)
_BOUND: dict[str, tuple[frozenset, int]] = {}  # live trainer id -> (replica ids bound to its parameters, bytes)
_LAST_LOADS: dict[str, list] = {}  # trainer id -> its last shared round's loads (its next write waits for them)


def layout(state: dict) -> tuple[list[tuple[str, int, int]], int, int]:
    """[(name, offset, nbytes)] of every tensor in a flat buffer, its total size, and a digest of
    names, shapes and dtypes (trainer and replica must agree on it)."""
    entries, offset, h = [], HEADER, hashlib.sha256()
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        entries.append((name, offset, nbytes))
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        offset += -(-nbytes // ALIGN) * ALIGN
    return entries, offset, int.from_bytes(h.digest()[:7], "little")


class SharedWeights:
    """A flat weights buffer in `/dev/shm` (or the temp dir), mapped by the trainer and the
    replicas of one node: `write(state, version)` on the trainer, `read_into(state, version)` on a
    replica. Its file is removed once every replica has mapped it (the mappings stay valid)."""

    def __init__(self, path: str | Path, state: dict, *, create: bool):
        self.path = str(path)
        self.entries, self.total, self.digest = layout(state)
        # each tensor's dtype in the buffer, which a writer or reader of another dtype casts to and from
        self.dtypes = [t.dtype for t in state.values()]
        self.shapes = [tuple(t.shape) for t in state.values()]
        self.index = {name: i for i, name in enumerate(state)}
        if create:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "wb") as f:
                f.truncate(self.total)
        elif not os.path.exists(self.path):
            raise RuntimeError(
                f"shared weights {self.path} are gone (removed after the first sync); "
                "a replica started later syncs through the object store"
            )
        elif os.path.getsize(self.path) != self.total:
            raise RuntimeError(
                f"shared weights {self.path} hold {os.path.getsize(self.path)} bytes, this model "
                f"needs {self.total}: trainer and rollout models differ"
            )
        storage = torch.UntypedStorage.from_file(self.path, shared=True, nbytes=self.total)
        self.buf = torch.tensor([], dtype=torch.uint8).set_(storage)  # (total,) bytes
        self.head = self.buf[:16].view(torch.int64)  # [version, layout digest]
        self._pinned = None  # page-locked for CUDA copies (`_pin`): not tried yet

    def _views(self, state: dict, flat: torch.Tensor | None = None):
        """(tensor, its slice of the buffer — or of `flat`, a device copy of the buffer's layout)."""
        buf = self.buf if flat is None else flat
        for (_name, offset, nbytes), dtype, t in zip(self.entries, self.dtypes, state.values()):
            yield t, buf[offset : offset + nbytes].view(dtype).view(t.shape)

    def bind(self, params: dict, *, copy: bool) -> None:
        """Point every tensor of `params` at its slice of the buffer (after copying its values
        there when `copy`): the tensors then live in the shared pages, and in-place updates of them
        (an optimizer step) are what every process that bound the same buffer reads."""
        with torch.no_grad():
            for t, view in self._views(params):
                if copy:
                    view.copy_(t.detach())
                t.data = view

    def stamp(self, version: int) -> None:
        """The version the buffer now holds (−1: being written, no reader may take it)."""
        self.head[1] = self.digest
        self.head[0] = version

    def current(self) -> int:
        """The version the buffer holds; raises while it is being written (version −1)."""
        found = int(self.head[0])
        if found < 0:
            raise RuntimeError(
                f"shared weights {self.path} are being written by the trainer: a replica bound to "
                "them must not sample during an update (live parameters are for synchronous loops)"
            )
        return found

    def check(self, version: int) -> None:
        """Raise unless the buffer holds `version` of this layout (stale or foreign weights are never used)."""
        found, digest = int(self.head[0]), int(self.head[1])
        if digest != self.digest:
            raise RuntimeError(
                f"shared weights {self.path} have another parameter layout: trainer and rollout models differ"
            )
        if found != version:
            raise RuntimeError(
                f"shared weights {self.path} hold version {found}, expected {version}: refusing stale weights"
            )

    def write(self, state: dict, version: int) -> int:
        """Copy `state` (the trainer's tensors, any device and dtype) into the buffer, cast to the
        buffer's dtypes, then stamp the version."""
        self.head[0] = -1  # being written: no version a reader expects
        tensors = list(state.values())
        if tensors and tensors[0].is_cuda:  # cast on the GPU into one staging buffer, then one copy to the host
            flat = torch.empty(self.total, dtype=torch.uint8, device=tensors[0].device)
            for t, view in self._views(state, flat):
                view.copy_(t.detach())
            self._pin()
            self.buf[HEADER:].copy_(flat[HEADER:])
        else:
            for t, view in self._views(state):
                view.copy_(t.detach())
        self.head[1] = self.digest
        self.head[0] = version
        return self.total - HEADER

    def write_parts(self, parts, version: int) -> int:
        """`write` from (name, tensor) pairs as they come (a ZeRO-3 trainer's gathered buckets: each
        copied into its slice at once, so no whole copy of the model is assembled first); every
        entry of the layout must come, then the version is stamped."""
        self.head[0] = -1
        seen = set()
        for name, t in parts:
            i = self.index[name]
            _, offset, nbytes = self.entries[i]
            self.buf[offset : offset + nbytes].view(self.dtypes[i]).view(self.shapes[i]).copy_(t.detach())
            seen.add(name)
        if len(seen) != len(self.entries):
            missing = [n for n in self.index if n not in seen]
            raise RuntimeError(f"weights sync: {len(missing)} tensors were not written (first: {missing[0]})")
        self.head[1] = self.digest
        self.head[0] = version
        return self.total - HEADER

    def _pin(self) -> None:
        """Page-lock the mapped buffer for the GPU (cudaHostRegister), once, so copies between it and
        the device run at DMA speed instead of through pageable staging; left as it is where the
        driver refuses (the copies then stay correct, only slower)."""
        if self._pinned is None:
            try:
                torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(self.buf.data_ptr(), self.total, 0))
                self._pinned = True
            except Exception:  # noqa: BLE001 - an optimisation only
                self._pinned = False

    def read_into(self, state: dict, version: int) -> int:
        """Copy the buffer into `state` (the replica's own tensors) after checking that it holds
        `version` of the same layout; a mismatch raises (stale or foreign weights are never used)."""

        self.check(version)
        tensors = list(state.values())
        with torch.no_grad():
            if tensors and tensors[0].is_cuda:  # one copy to the GPU, then each tensor from its slice there
                flat = torch.empty(self.total, dtype=torch.uint8, device=tensors[0].device)
                self._pin()
                flat[HEADER:].copy_(self.buf[HEADER:])
                for t, view in self._views(state, flat):
                    t.copy_(view)
            else:
                for t, view in self._views(state):
                    t.copy_(view)
        return self.total - HEADER


def sync_weights(trainer, rollouts: list, *, shared: bool | None = None, transport: str = "object_store") -> dict:
    """Copy the trainer's current weights into every rollout replica; returns `sync_seconds` (wall
    time until the last replica has loaded them) and `sync_bytes` (size of one copy). `shared`:
    None picks per replica (shared memory on the trainer's node), False forces the object store."""
    t0 = time.perf_counter()
    sizes = wait_loads(start_sync(trainer, rollouts, shared=shared, transport=transport))
    seconds = time.perf_counter() - t0
    _remove_file_once_mapped(trainer)
    return {"sync_seconds": seconds, "sync_bytes": sizes[0] if sizes else 0}


def wait_loads(loads: list) -> list[int]:
    """The bytes each replica took, once it has loaded them (`start_sync`'s list)."""
    import ray

    refs = [x for x in loads if isinstance(x, ray.ObjectRef)]
    done = iter(ray.get(refs))
    return [int(next(done)) if isinstance(x, ray.ObjectRef) else int(x) for x in loads]


def start_sync(trainer, rollouts: list, *, shared: bool | None = None, transport: str = "object_store") -> list:
    """Queue the copy without waiting: each replica loads the weights after the work already
    submitted to it and before anything submitted later. Returns, per replica, the ObjectRef of the
    bytes it loaded, or those bytes where nothing had to be sent (`wait_loads` waits for them all);
    with `transport="collective"` the trainer's broadcast comes last. `transport`: how replicas on
    other nodes get the weights: "object_store" (one copy there) or "collective" (a process group
    of the trainer and those replicas, `raypai.alignment.sync_group`)."""
    import ray

    _remove_file_once_mapped(trainer)
    here = [r for r in rollouts if shared is not False and _node(r) == _node(trainer)]
    away = [r for r in rollouts if r not in here]
    loads: list = []
    bound, size = _BOUND.get(trainer._actor_id.hex(), (frozenset(), 0))
    if here and {r._actor_id.hex() for r in here} <= bound:
        loads += [size] * len(here)  # the replicas read the trainer's own pages: nothing to send
    elif here:
        # the trainer writes into its one buffer only once the replicas have loaded the last round
        # from it: a caller that queues the next sync before the last one's loads ran (async GRPO,
        # whose loads wait behind the generation in flight) would otherwise have the replicas find a
        # newer version than the one they were sent, and refuse it
        after = [x for x in _LAST_LOADS.get(trainer._actor_id.hex(), ()) if isinstance(x, ray.ObjectRef)]
        written = trainer.write_shared.remote(*after)  # -> (path, version, live); the replicas' loads wait for it
        mine = [r.load_shared.remote(written) for r in here]
        _LAST_LOADS[trainer._actor_id.hex()] = mine
        loads += mine
        _FIRST_ROUND.setdefault(trainer._actor_id.hex(), (list(loads), [r._actor_id.hex() for r in here], written))
    if away and transport == "collective":
        _join_group(trainer, away)
        version = trainer.version.remote()
        pushed = trainer.push_weights.remote()  # broadcast bucket by bucket; the replicas receive
        loads += [r.pull_weights.remote(version) for r in away] + [pushed]
    elif away:
        # one copy in the object store, shared by every remote replica (a ZeRO-3 trainer's as buckets)
        state = trainer.state_parts.remote()
        version = trainer.version.remote()
        loads += [r.load_weights.remote(state, version) for r in away]
    return loads


_GROUPS: dict[str, frozenset] = {}  # trainer id -> the replicas in its weight group


def _join_group(trainer, away: list, timeout_s: float = 120.0) -> None:
    """The trainer's weight group with the replicas `away`, made at the first collective sync (the
    members join together: making a group waits for all of them)."""
    import ray

    members = frozenset(r._actor_id.hex() for r in away)
    have = _GROUPS.get(trainer._actor_id.hex())
    if have == members:
        return
    if have is not None:
        raise RuntimeError(
            "the replicas on other nodes changed during the run: the weight group is fixed at its first sync"
        )
    host, port, backend, buckets = ray.get(trainer.open_weight_group.remote(timeout_s))
    size = len(away) + 1
    joins = [trainer.join_weight_group.remote(host, port, size, timeout_s)]
    joins += [
        r.join_weight_group.remote(host, port, i + 1, size, backend, buckets, timeout_s) for i, r in enumerate(away)
    ]
    ray.get(joins)
    _GROUPS[trainer._actor_id.hex()] = members


def _remove_file_once_mapped(trainer) -> None:
    """Once every replica of the first shared round has loaded (so mapped the file), the trainer
    removes the file: the mappings stay, and nothing is left in /dev/shm after the run. Live, those
    replicas are from then on bound to the trainer's parameters (`start_sync` sends them nothing)."""
    import ray

    key = trainer._actor_id.hex()
    refs, replicas, written = _FIRST_ROUND.get(key) or ([], [], None)
    if refs and len(ray.wait(refs, num_returns=len(refs), timeout=0)[0]) == len(refs):
        trainer.unlink_shared.remote()
        _FIRST_ROUND[key] = ()
        if ray.get(written)[2]:  # live: done, so this costs no wait
            _BOUND[key] = (frozenset(replicas), int(ray.get(refs[0])))


def locate(actors: list) -> None:
    """Learn each actor's node now (its start-up included), so that `start_sync` never asks later.
    An actor runs its calls in order, so asking an actor busy with a step (as the first sync used to,
    right after queueing the first update and generation) waits for that step: the first step's
    `sync_seconds` held the roles' start-up and first rollout and update (1.0-2.5 s against a steady
    0.1 ms for a 0.49 MB model; a p99 of 10,000× the median)."""
    import ray

    todo = [a for a in actors if a._actor_id.hex() not in _NODES]
    for a, node in zip(todo, ray.get([a.node_id.remote() for a in todo])):
        _NODES[a._actor_id.hex()] = node


def _node(actor) -> str:
    key = actor._actor_id.hex()
    if key not in _NODES:
        locate([actor])
    return _NODES[key]


def shared_path(run_key: str) -> Path:
    base = Path("/dev/shm") if os.path.isdir("/dev/shm") else Path(os.environ.get("TMPDIR", "/tmp"))
    return base / f"raypai-weights-{run_key}.bin"
