"""raypai: a Ray-native platform from raw text to a deployed language model, with lineage.

from raypai import step, pipeline, run_pipeline, Artifact, StepContext
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# Where each public name lives. They load on first use (PEP 562): a Ray actor that only needs
# `raypai.alignment` does not import the runner, the metadata store, SQLAlchemy and pyarrow
# (CPU every role and task process would pay: benchmarks/history/asides.md).
_EXPORTS = {
    "Artifact": "raypai.artifacts",
    "ArtifactStore": "raypai.artifacts",
    "StepContext": "raypai.context",
    "pipeline": "raypai.dsl",
    "step": "raypai.dsl",
    **{
        name: "raypai.errors"
        for name in (
            "ConfigError",
            "DataError",
            "DeployError",
            "NotFoundError",
            "PipelineError",
            "RaypaiError",
            "StoreError",
            "TrainError",
        )
    },
    **{name: "raypai.runner" for name in ("RunResult", "Runner", "StepResult", "run_pipeline")},
    "Settings": "raypai.settings",
    "RunLogger": "raypai.tracking",
    "Tracker": "raypai.tracking",
}

__all__ = [
    "step",
    "pipeline",
    "run_pipeline",
    "Artifact",
    "ArtifactStore",
    "StepContext",
    "Settings",
    "Runner",
    "RunResult",
    "StepResult",
    "RunLogger",
    "Tracker",
    "RaypaiError",
    "ConfigError",
    "DataError",
    "PipelineError",
    "StoreError",
    "TrainError",
    "DeployError",
    "NotFoundError",
]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'raypai' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once: later lookups are plain module attributes
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
