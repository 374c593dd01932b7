"""Private fault injection for raypai's own tests and drills: not a user interface.

Nothing here is a parameter of `clean`, the `clean` step or `raypai data clean`. A test sets one
environment variable in the driver's process before calling `clean`:

    RAYPAI_DATA_FAULTS='{"stop_after_shards": 2}'

`clean` reads it once per call (`Faults.from_env`); the hook acts in the driver, where shards are
committed, so Ray workers need not see the variable.
- `stop_after_shards`: once this many shards are committed to the work folder, `clean` stops with
  a DataError, as a run killed part-way would (the committed shards stay; the next run resumes).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from raypai.errors import DataError

from raypai._faults import from_env

ENV = "RAYPAI_DATA_FAULTS"


@dataclass(frozen=True)
class Faults:
    stop_after_shards: int = -1  # -1: never

    @classmethod
    def from_env(cls) -> "Faults":
        return from_env(cls, ENV)

    def to_env(self) -> str:
        return json.dumps(asdict(self))

    def after_commit(self, committed: int) -> None:
        """Called by `clean` after each shard it commits; `committed`: shards committed in this call."""
        if 0 <= self.stop_after_shards <= committed:
            raise DataError(f"clean stopped after {committed} shards ({ENV} stop_after_shards, a simulated "
                            "kill); run again to resume")
