"""raypai: a Ray-native platform from raw text to a deployed language model, with lineage.

    from raypai import step, pipeline, run_pipeline, Artifact, StepContext
"""

from raypai.artifacts import Artifact, ArtifactStore
from raypai.context import StepContext
from raypai.dsl import pipeline, step
from raypai.errors import (ConfigError, DataError, DeployError, NotFoundError, PipelineError, RaypaiError,
                           StoreError, TrainError)
from raypai.runner import RunResult, Runner, StepResult, run_pipeline
from raypai.settings import Settings
from raypai.tracking import RunLogger, Tracker

__version__ = "0.1.0"

__all__ = [
    "step", "pipeline", "run_pipeline", "Artifact", "ArtifactStore", "StepContext", "Settings", "Runner", "RunResult",
    "StepResult", "RunLogger", "Tracker", "RaypaiError", "ConfigError", "DataError", "PipelineError",
    "StoreError", "TrainError", "DeployError", "NotFoundError",
]
