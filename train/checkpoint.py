"""Checkpoints of the full training state, saved through `ray.train.report` into the run's storage.

A checkpoint folder holds DeepSpeed's files (`state/`: module weights, at ZeRO-3 each rank's
partition of them, this rank's ZeRO optimizer partition, lr scheduler; read back with
`weights_only=True`, raypai.checkpoint_io), one `rng-rank{r}.json`/`.npz` per worker (never pickled) and `data_position.json` (the next optimizer step; with `data.BlockOrder` that step fixes
every block each worker reads next). The final checkpoint also holds `metrics.json`, the finished
run's metrics, so that a run resumed at its last step (called again by name, or its worker group
restarted after the final report) reports them again instead of an empty window.

Two ways to save (`PretrainConfig.async_checkpoint`):
- synchronous (`save`): serialize into `/dev/shm`, upload to storage, then continue training;
- asynchronous (`AsyncCheckpointer`), after CheckFreq (Mohan et al. 2021, FAST '21 §4.2) and
  EasyCkpt: the loop only *snapshots* the state (tensor copies in memory); a background thread
  serializes it, and once every worker's write is done the checkpoint is reported with Ray Train's
  background upload (`CheckpointUploadMode.ASYNC`) to durable storage (local, NFS or `s3://`).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pyarrow.fs as pafs

from raypai.checkpoint_io import read_state, write_state
from raypai.errors import TrainError
from raypai.train import _fs

DATA_POSITION = "data_position.json"
FINAL_METRICS = "metrics.json"
TAG = "state"


def _rng_state() -> dict:
    import torch

    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def _set_rng(state: dict) -> None:
    import torch

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def dir_name(next_step: int) -> str:
    """Checkpoint folders are named by the step they resume at: `checkpoint_000016`."""
    return f"checkpoint_{next_step:06d}"


def _new_folder() -> Path:
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    return Path(tempfile.mkdtemp(prefix="raypai-ckpt-", dir=base))


def _write_small_files(folder: Path, *, next_step: int, rank: int, rng: dict | None = None) -> None:
    """This rank's RNG state (`rng`: one captured earlier; default: now) and the data position."""

    write_state(folder, rng if rng is not None else _rng_state(), name=f"rng-rank{rank}")
    (folder / DATA_POSITION).write_text(json.dumps({"next_step": next_step}))


def snapshot(engine, *, next_step: int, rank: int, with_hf: bool = False, metrics: dict | None = None) -> Path:
    """Write this worker's share of the training state into a fresh folder in memory (`/dev/shm`
    where it exists). `with_hf`: rank 0 also writes the model as a Hugging Face folder in `hf/`;
    `metrics`: the finished run's metrics, written into the final checkpoint by rank 0."""
    folder = _new_folder()
    try:
        _snapshot_into(folder, engine, next_step=next_step, rank=rank, with_hf=with_hf, metrics=metrics)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)  # a failed snapshot leaves nothing in /dev/shm
        raise
    return folder


def _snapshot_into(folder: Path, engine, *, next_step: int, rank: int, with_hf: bool, metrics: dict | None) -> None:
    engine.save_checkpoint(str(folder), tag=TAG)
    _write_small_files(folder, next_step=next_step, rank=rank)
    if metrics is not None and rank == 0:
        # one writer: every rank's folder is uploaded into the same checkpoint directory, and two
        # ranks' copies of one file (their metrics differ in per-rank timings, so in length) raced
        # there into a file with another's tail ("Extra data" when a finished run was read back)
        (folder / FINAL_METRICS).write_text(json.dumps(metrics, default=float))
    if with_hf:
        save_hf(engine, folder / "hf", rank)


def save_hf(engine, folder: Path, rank: int) -> None:
    """Rank 0 writes the whole model as a Hugging Face folder (safetensors). At ZeRO-3 every rank must
    call this: DeepSpeed gathers the partitions one module at a time into rank 0's host memory
    (`_zero3_consolidated_16bit_state_dict`, which keeps the weights' own dtype, fp32 on the CPU,
    whatever its name says; tied weights stay one tensor, which `save_pretrained` writes once)."""
    state = engine._zero3_consolidated_16bit_state_dict() if engine.zero_optimization_partition_weights() else None
    if rank == 0:
        engine.module.save_pretrained(folder, state_dict=state, safe_serialization=True)


def _report(folder: Path, metrics: dict, next_step: int, *, upload_async: bool) -> None:
    import ray.train

    mode = ray.train.CheckpointUploadMode.ASYNC if upload_async else ray.train.CheckpointUploadMode.SYNC
    ray.train.report(
        dict(metrics),
        checkpoint=ray.train.Checkpoint.from_directory(str(folder)),
        checkpoint_dir_name=dir_name(next_step),
        checkpoint_upload_mode=mode,
        delete_local_checkpoint_after_upload=True,
    )


def save(engine, metrics: dict, *, next_step: int, rank: int, final: bool = False) -> float:
    """Synchronous: serialize, upload and report a checkpoint; returns the seconds the loop stalled.
    `final` also writes the Hugging Face export and the metrics (`metrics.json`), both on rank 0."""
    t0 = time.perf_counter()
    folder = snapshot(engine, next_step=next_step, rank=rank, with_hf=final, metrics=dict(metrics) if final else None)
    _report(folder, metrics, next_step, upload_async=False)
    return time.perf_counter() - t0


class SnapshotBuffers:
    """Host buffers a snapshot is copied into, kept from one checkpoint to the next.

    The first snapshot allocates them; later ones `copy_` into the same memory. A fresh clone of a
    large state pays the kernel's page faults for every new page, which costs several times the
    copy itself (benchmarks/history/asides.md). At most one snapshot is in flight
    (`AsyncCheckpointer` waits for the previous write first), so one set of buffers suffices; it
    costs one copy of this worker's checkpointed state.
    On a GPU the buffers are pinned and the copies asynchronous; the writer waits for them."""

    def __init__(self):
        self._bufs: dict[tuple, object] = {}

    def copy(self, item, key: tuple):
        """`item` with every enclosed tensor replaced by its buffer holding the same values
        (containers as in DeepSpeed's `clone_tensors_for_torch_save`)."""
        import torch

        if torch.is_tensor(item):
            src = item.detach()
            buf = self._bufs.get(key)
            if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
                buf = torch.empty(src.shape, dtype=src.dtype, pin_memory=src.is_cuda)
                self._bufs[key] = buf
            buf.copy_(src, non_blocking=src.is_cuda)
            return buf
        if isinstance(item, list):
            return [self.copy(v, (*key, i)) for i, v in enumerate(item)]
        if isinstance(item, tuple):
            return tuple(self.copy(v, (*key, i)) for i, v in enumerate(item))
        if isinstance(item, dict):
            return type(item)({k: self.copy(v, (*key, k)) for k, v in item.items()})
        return item

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._bufs.values())


class _MemorySnapshotEngine:
    """Stands in for DeepSpeed's checkpoint engine during `save_checkpoint`: instead of writing each
    state dict it copies its tensors into `SnapshotBuffers` (keyed by the file's path inside the
    checkpoint folder), so training may change the originals while a thread writes the copies."""

    def __init__(self, real, folder: Path, buffers: SnapshotBuffers):
        self.real, self.folder, self.buffers, self.items = real, folder, buffers, []

    def __getattr__(self, name):  # makedirs, create, commit, is_decoupled, ... as the real engine
        return getattr(self.real, name)

    def save(self, state_dict, path: str) -> None:
        rel = str(Path(path).relative_to(self.folder))
        self.items.append((path, self.buffers.copy(state_dict, (rel,))))


class AsyncCheckpointer:
    """Snapshot now, write in a background thread, report when every worker's write is done.

    All workers call `save` at the same steps and `poll` every step (a one-number all-reduce while
    a write is pending), so they report the same checkpoint at the same step, as Ray Train requires.
    A new `save` or `flush` first waits for the previous write (back-pressure: at most one
    snapshot is held in memory). `stall` holds the seconds the loop spent in each part."""

    def __init__(self, engine, rank: int):
        self.engine, self.rank = engine, rank
        self.buffers = SnapshotBuffers()
        self.stall = {"wait": 0.0, "snapshot": 0.0, "poll": 0.0, "report": 0.0}
        self._thread: threading.Thread | None = None
        self._pending: tuple[Path, dict, int] | None = None
        self._error: BaseException | None = None

    def save(self, metrics: dict, *, next_step: int) -> float:
        """Take the snapshot and start writing it; returns the seconds the loop was stalled."""
        t0 = time.perf_counter()
        self.flush()
        t1 = time.perf_counter()
        folder = _new_folder()
        real = self.engine.checkpoint_engine
        self.engine.checkpoint_engine = snap = _MemorySnapshotEngine(real, folder, self.buffers)
        try:
            self.engine.save_checkpoint(str(folder), tag=TAG)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)  # a failed snapshot leaves nothing in /dev/shm
            raise
        finally:
            self.engine.checkpoint_engine = real
        small = {"folder": folder, "next_step": next_step, "rank": self.rank, "rng": _rng_state()}  # RNG: a copy, now
        self._thread = threading.Thread(
            target=self._write, args=(snap.items, small, _cuda_event()), name="raypai-ckpt-writer", daemon=True
        )
        self._thread.start()
        self._pending = (folder, dict(metrics), next_step)
        t2 = time.perf_counter()
        self.stall["snapshot"] += t2 - t1
        return t2 - t0

    def _write(self, items: list, small: dict, copied) -> None:
        """`copied`: the CUDA event after the snapshot's device-to-host copies (None on CPU)."""
        import torch

        try:
            if copied is not None:
                copied.synchronize()
            for path, state in items:
                torch.save(state, path)
            _write_small_files(**small)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the training thread in _report_pending
            self._error = exc

    def poll(self) -> float:
        """Report the pending checkpoint if every worker finished writing it; returns seconds spent."""
        if self._pending is None:
            return 0.0
        import torch
        import torch.distributed as dist

        t0 = time.perf_counter()
        done = torch.tensor([0.0 if self._thread.is_alive() else 1.0], device=self.engine.device)  # NCCL: on the GPU
        dist.all_reduce(done, op=dist.ReduceOp.MIN)
        self.stall["poll"] += time.perf_counter() - t0
        if done.item() == 1.0:
            self._report_pending()
        return time.perf_counter() - t0

    def flush(self) -> float:
        """Wait for the pending write and report it (before the next snapshot and at the end)."""
        t0 = time.perf_counter()
        if self._pending is not None:
            self._thread.join()
            self.stall["wait"] += time.perf_counter() - t0
            self._report_pending()
        return time.perf_counter() - t0

    def _report_pending(self) -> None:
        t0 = time.perf_counter()
        self._thread.join()
        if self._error is not None:
            shutil.rmtree(self._pending[0], ignore_errors=True)
            raise TrainError(f"writing checkpoint {self._pending[0]} failed: {self._error}") from self._error
        folder, metrics, next_step = self._pending
        self._pending = None
        _report(folder, metrics, next_step, upload_async=True)
        self.stall["report"] += time.perf_counter() - t0


def _cuda_event():
    """An event recorded after the snapshot's asynchronous device-to-host copies (None on CPU)."""
    import torch

    if not torch.cuda.is_available():
        return None
    event = torch.cuda.Event()
    event.record()
    return event


@contextmanager
def _local_copy(checkpoint, rank: int):
    """The checkpoint as a local folder for this rank: its own path when it is local, else a copy
    of this rank's own, removed afterwards. Not Ray's `Checkpoint.as_directory`: on a remote store
    it gives every rank on a node one shared temporary copy, and a rank that finishes reading can
    delete it while another, waiting for the download, has yet to open it (Ray then raises
    "Checkpoint directory ... does not exist, even though it should have been created by another
    process"; seen once in this project's S3 resume drill)."""
    import shutil

    if isinstance(checkpoint.filesystem, pafs.LocalFileSystem):
        yield checkpoint.path
        return
    folder = tempfile.mkdtemp(prefix=f"raypai-restore-rank{rank}-")
    try:
        yield checkpoint.to_directory(folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def restore(engine, checkpoint, rank: int) -> tuple[int, dict | None]:
    """Load the state of `checkpoint` (a `ray.train.Checkpoint`) into `engine`; return the next step
    and, for a final checkpoint, the finished run's metrics (None otherwise)."""

    with _local_copy(checkpoint, rank) as d:
        d = Path(d)
        if not (d / DATA_POSITION).exists():
            raise TrainError(f"checkpoint {checkpoint.path} has no {DATA_POSITION}; it was not written by raypai")
        engine.load_checkpoint(str(d), tag=TAG)
        next_step = json.loads((d / DATA_POSITION).read_text())["next_step"]
        rng = read_state(d, name=f"rng-rank{rank}")
        if rng is not None:  # absent when the worker count changed: keep the fresh seed
            _set_rng(rng)
        final = json.loads((d / FINAL_METRICS).read_text()) if (d / FINAL_METRICS).exists() else None
    return next_step, final


def checkpoint_from_path(path: str | Path):
    """A `ray.train.Checkpoint` for an earlier run's checkpoint folder (`PretrainConfig.resume_from`),
    local or remote (`s3://bucket/prefix/run/checkpoint_000016`)."""
    import ray.train

    fs, root = _fs.resolve(path)
    if fs.get_file_info(f"{root}/{DATA_POSITION}").type != pafs.FileType.File:
        raise TrainError(
            f"resume_from={path}: no raypai checkpoint there (no {DATA_POSITION}); pass a "
            "checkpoint_* folder of an earlier run (see `latest_checkpoint`), or leave resume_from empty"
        )
    return ray.train.Checkpoint(root, filesystem=fs)


def latest_checkpoint(storage_path: str | Path, name: str) -> Path | str | None:
    """The newest complete checkpoint folder of run `name` under `storage_path` (a Path for local
    storage, a URI for remote storage), or None."""
    fs, root = _fs.resolve(storage_path)
    entries = fs.get_file_info(pafs.FileSelector(f"{root}/{name}", allow_not_found=True))
    found = []
    for entry in entries:
        if entry.type == pafs.FileType.Directory and entry.base_name.startswith("checkpoint_"):
            position = _fs.read_json(fs, f"{entry.path}/{DATA_POSITION}")
            if position is not None:
                found.append((position["next_step"], entry.base_name))
    if not found:
        return None
    folder = max(found)[1]
    return _fs.join(storage_path, name, folder) if _fs.is_remote(storage_path) else Path(root) / name / folder


def is_registered(fs, run_dir: str, next_step: int) -> bool:
    """Whether Ray Train's controller has recorded the checkpoint resuming at `next_step` (it is
    then what a restart loads). Reads the controller's snapshot file in the run folder (`run_dir`
    inside the storage filesystem `fs`)."""
    try:
        return dir_name(next_step) in (_fs.read_text(fs, f"{run_dir}/checkpoint_manager_snapshot.json") or "")
    except OSError:
        return False
