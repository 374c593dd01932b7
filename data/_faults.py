"""Private fault injection for raypai's own tests and drills: not a user interface.

Nothing here is a parameter of `clean`, the `clean` step or `raypai data clean`. A test sets one
environment variable in the driver's process before calling `clean`:

    RAYPAI_DATA_FAULTS='{"sigkill_shard": "part-00003-00000.parquet", "sigkill_times": 1}'

`clean` reads it once per call (`Faults.from_env`) and hands the `Faults` to its filter tasks
(workers do not see the driver's environment).
- `sigkill_shard`: the Ray worker process filtering this shard SIGKILLs itself after its first
  batch, before the shard is committed: a real process death, as the OOM killer or a lost node
  would cause, not an exception.
- `sigkill_times`: how many attempts die. Ray retries a task whose worker died
  (`clean`'s `FILTER_RETRIES`): 1 shows the retry finishing the run; more than the retries makes
  the run fail, and the next run resumes from the shards committed. Each kill leaves a marker
  `<work_dir>/_faults/sigkill-<shard>-<n>` (the count survives the process).
"""

from __future__ import annotations

import json
import os
import signal
from dataclasses import asdict, dataclass
from pathlib import Path

from raypai._faults import from_env

ENV = "RAYPAI_DATA_FAULTS"


@dataclass(frozen=True)
class Faults:
    sigkill_shard: str = ""  # "": never
    sigkill_times: int = 1

    @classmethod
    def from_env(cls) -> "Faults":
        return from_env(cls, ENV)

    def to_env(self) -> str:
        return json.dumps(asdict(self))

    def kills(self, work: Path) -> int:
        """Kills done so far for this work folder."""
        return len(list((work / "_faults").glob(f"sigkill-{self.sigkill_shard}-*"))) if self.sigkill_shard else 0

    def in_worker(self, shard: str, work: Path) -> None:
        """Called by the filter task after each batch of `shard`; kills its own process when told."""
        if not self.sigkill_shard or shard != self.sigkill_shard:
            return
        n = self.kills(work)
        if n < self.sigkill_times:
            (work / "_faults").mkdir(exist_ok=True)
            (work / "_faults" / f"sigkill-{shard}-{n}").touch()
            os.kill(os.getpid(), signal.SIGKILL)
