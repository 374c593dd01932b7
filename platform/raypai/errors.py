"""One exception hierarchy for raypai. Messages say what failed, where, and what to do next."""

from __future__ import annotations


class RaypaiError(Exception):
    """Base of every error raypai raises on purpose."""


class ConfigError(RaypaiError):
    """Invalid settings or step/algorithm config. Carries every problem found, not just the first."""

    def __init__(self, problems: list[str] | str, *, what: str = "configuration"):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"invalid {what} ({len(self.problems)} problem(s)):\n{lines}")


class DataError(RaypaiError):
    """Input data that cannot be read or processed (missing file, empty folder, bad recipe)."""


class PipelineError(RaypaiError):
    """A malformed pipeline (cycle, unknown param) or a failed step run."""


class StoreError(RaypaiError):
    """The metadata store or artifact store cannot be reached or used."""


class TrainError(RaypaiError):
    """Training cannot start or continue (does not fit memory, vocab mismatch, no checkpoint)."""


class DeployError(RaypaiError):
    """A deployment request that cannot be carried out."""


class DeploymentConflict(DeployError):
    """A deploy request that contradicts the current state (name taken, version already stable, a
    promotion the canary's verdict does not allow): HTTP 409 from the deploy API."""


class NotFoundError(RaypaiError):
    """A named run, artifact, model or deployment does not exist."""


__all__ = [
    "RaypaiError",
    "ConfigError",
    "DataError",
    "PipelineError",
    "StoreError",
    "TrainError",
    "DeployError",
    "DeploymentConflict",
    "NotFoundError",
]
