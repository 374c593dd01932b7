"""Reading checkpoints without running code from them.

A `.pt` file is a pickle, and unpickling can call any importable function: a checkpoint folder
someone else can write to (a shared bucket, an `s3://` URI given to `resume_from`) would otherwise
run their code in every rank that resumes from it. So:

- DeepSpeed's files (module weights, ZeRO partitions, optimizer and scheduler state) are read
  with `torch.load(weights_only=True)`, which rebuilds tensors, containers and plain values only,
  plus the few DeepSpeed types its optimizer state holds (`DEEPSPEED_TYPES`, found by saving and
  reading back a checkpoint at every ZeRO stage, with and without LoRA). Anything else in such a
  file is refused, naming the file and the type.
- raypai's own state (loop step, data position, the driver's and every replica's RNG, metrics) is
  never pickled: `write_state` splits it into JSON and one `.npz` for its tensors and arrays.

Storage is still trusted for *what* it holds: a writer can change weights or the data position.
docs/trust.md says what raypai verifies and what it trusts.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any

from raypai.errors import TrainError

STATE = "raypai_state"  # raypai_state.json + raypai_state.npz
_ARRAY = "__array__"
_TUPLE = "__tuple__"


class CheckpointError(TrainError):
    """A checkpoint file that raypai refuses to read (it holds more than weights and plain state)."""


def deepspeed_types() -> list:
    """The non-tensor types DeepSpeed's checkpoint files hold (its ZeRO 1/2 optimizer state)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def load_weights_only(path: str | os.PathLike | io.BytesIO, map_location=None):
    """`torch.load` that rebuilds tensors, containers, plain values and `deepspeed_types()` only."""
    import pickle

    import torch

    try:
        with torch.serialization.safe_globals(deepspeed_types()):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"refused to read checkpoint file {path}: it holds objects beyond tensors and plain state "
            f"({_first_line(e)}). raypai reads checkpoints without running code from them; a file "
            "like this was not written by raypai or DeepSpeed, or was changed after. Resume from a "
            "checkpoint this platform wrote, into storage only trusted writers can change (docs/trust.md)."
        ) from None


def guard_engine(engine) -> None:
    """Make a DeepSpeed engine read every checkpoint file with `load_weights_only` (every load of
    `engine.load_checkpoint`, the ZeRO partitions included, goes through its checkpoint engine)."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    current = getattr(engine, "checkpoint_engine", None)
    if current is not None and type(current) is not TorchCheckpointEngine:
        raise CheckpointError(
            f"the DeepSpeed checkpoint engine {type(current).__name__} is not supported: raypai reads "
            "checkpoints with the torch engine and weights_only=True (remove `checkpoint.engine` settings)"
        )
    safe = TorchCheckpointEngine.__new__(TorchCheckpointEngine)
    if current is not None:
        safe.__dict__.update(current.__dict__)
    else:
        TorchCheckpointEngine.__init__(safe)
    safe.load = lambda path, map_location=None: load_weights_only(path, map_location)
    engine.checkpoint_engine = safe


def write_state(folder: str | os.PathLike, state: dict, name: str = STATE) -> None:
    """Write `state` into `folder` as JSON (`{name}.json`) plus its tensors and numpy arrays in
    `{name}.npz`; tuples are kept as tuples. Each file is written whole, then renamed."""
    import numpy as np

    folder = Path(folder)
    arrays: dict[str, Any] = {}
    doc = _encode(state, arrays)
    if arrays:
        buf = io.BytesIO()
        np.savez(buf, **arrays)
        _write_atomic(folder / f"{name}.npz", buf.getvalue())
    _write_atomic(folder / f"{name}.json", json.dumps(doc).encode())


def read_state(folder: str | os.PathLike, name: str = STATE) -> dict | None:
    """What `write_state` wrote (tensors come back as torch tensors), or None if `folder` has none."""
    import numpy as np

    folder = Path(folder)
    if not (folder / f"{name}.json").exists():
        return None
    doc = json.loads((folder / f"{name}.json").read_text())
    arrays = {}
    if (folder / f"{name}.npz").exists():
        with np.load(folder / f"{name}.npz", allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    return _decode(doc, arrays)


def _encode(x, arrays: dict):
    import numpy as np

    if isinstance(x, dict):
        bad = [k for k in x if not isinstance(k, str)]
        if bad:
            raise TypeError(f"checkpoint state keys must be strings, got {bad[0]!r}")
        return {k: _encode(v, arrays) for k, v in x.items()}
    if isinstance(x, tuple):
        return {_TUPLE: [_encode(v, arrays) for v in x]}
    if isinstance(x, list):
        return [_encode(v, arrays) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if type(x).__module__ == "torch" and type(x).__name__ == "Tensor":
        key = f"a{len(arrays)}"
        arrays[key] = x.detach().cpu().numpy()
        return {_ARRAY: key, "torch": True}
    if isinstance(x, np.ndarray):
        key = f"a{len(arrays)}"
        arrays[key] = x
        return {_ARRAY: key, "torch": False}
    raise TypeError(f"checkpoint state holds a {type(x).__name__}: only JSON values, tuples, tensors and arrays")


def _decode(x, arrays: dict):
    if isinstance(x, list):
        return [_decode(v, arrays) for v in x]
    if isinstance(x, dict):
        if _ARRAY in x:
            a = arrays[x[_ARRAY]]
            if x.get("torch"):
                import torch

                return torch.from_numpy(a.copy())
            return a
        if _TUPLE in x and len(x) == 1:
            return tuple(_decode(v, arrays) for v in x[_TUPLE])
        return {k: _decode(v, arrays) for k, v in x.items()}
    return x


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _first_line(e: Exception) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if "GLOBAL" in ln or "Unsupported" in ln]
    return (lines[0] if lines else str(e).splitlines()[0])[:300]
