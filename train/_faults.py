"""Private fault injection and tracing for raypai's own tests and drills: not a user interface.

Nothing here is a `PretrainConfig` field. A test sets one environment variable in the driver's
process before calling `pretrain`:

    RAYPAI_TRAIN_FAULTS='{"trace_dir": "/tmp/trace", "kill_worker_at_step": 19}'

`pretrain` reads it once (`Faults.from_env`) and hands the value to its workers with the loop
config, so the workers need not inherit the driver's environment.
- `trace_dir`: every worker appends the block ids it trains on to `rank{r}.jsonl` (one line per
  step and micro-step) and, at the end of its loop, its memory peak and the parameter elements it
  holds (`model.local_param_count`: at ZeRO-3 its partitions) to `memory-rank{r}.json`.
- `kill_worker_at_step`: the last worker's process exits once (`os._exit(1)`) at this step, after
  the latest checkpoint is registered; a `killed-at-{step}` marker in `trace_dir` (required) makes
  it happen only once per drill.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from raypai._faults import from_env

ENV = "RAYPAI_TRAIN_FAULTS"


@dataclass(frozen=True)
class Faults:
    trace_dir: str = ""
    kill_worker_at_step: int = -1

    @classmethod
    def from_env(cls) -> "Faults":
        faults = from_env(cls, ENV)
        if faults.kill_worker_at_step >= 0 and not faults.trace_dir:
            raise ValueError(f"{ENV}: kill_worker_at_step needs trace_dir (where the once-only marker goes)")
        return faults

    def to_env(self) -> str:
        return json.dumps(asdict(self))

    def record_blocks(self, rank: int, step: int, micro: int, block_ids) -> None:
        if self.trace_dir:
            with open(Path(self.trace_dir) / f"rank{rank}.jsonl", "a") as f:
                f.write(json.dumps({"step": step, "micro": micro, "blocks": [int(b) for b in block_ids]}) + "\n")

    def maybe_kill(self, step: int, rank: int, world: int, registered) -> None:
        """The last worker dies once at `kill_worker_at_step`, after `registered()` says the latest
        checkpoint is what a restart loads (an asynchronous upload still in flight when the process
        dies is legitimately lost, which would make the drill's outcome depend on machine load)."""
        if step != self.kill_worker_at_step or rank != world - 1:
            return
        marker = Path(self.trace_dir) / f"killed-at-{step}"
        if marker.exists():
            return
        deadline = time.monotonic() + 120
        while not registered() and time.monotonic() < deadline:
            time.sleep(0.2)
        marker.write_text(str(step))
        os._exit(1)

    def reset_memory_peak(self) -> int:
        """Start a new peak-RSS window for this process (Linux: writing 5 to clear_refs resets
        VmHWM to the current RSS); returns the RSS in bytes at that moment."""
        if self.trace_dir:
            _reset_peak()
        return _status_bytes("VmRSS")

    def record_memory(self, rank: int, rss_at_start: int, *, param_elements: int) -> None:
        if self.trace_dir:
            (Path(self.trace_dir) / f"memory-rank{rank}.json").write_text(
                json.dumps(
                    {"rss_at_start": rss_at_start, "peak_rss": _status_bytes("VmHWM"), "param_elements": param_elements}
                )
            )


def _reset_peak() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def _status_bytes(key: str) -> int:
    """A `kB` field of /proc/self/status in bytes (0 where there is no /proc)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
