"""StepContext: what a running step sees (settings, stores, its MLflow run, scratch space)."""

from __future__ import annotations

import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from raypai.artifacts import Artifact, ArtifactStore
from raypai.settings import Settings
from raypai.tracking import RunLogger, Tracker


@dataclass
class StepContext:
    settings: Settings
    run_id: str
    step_run_id: str
    node: str
    pipeline: str
    store: object  # MetadataStore (typed loosely to keep this import light)
    artifacts: ArtifactStore
    tracker: Tracker
    logger: RunLogger | None
    attempt: int = 0
    key_metrics: dict = field(default_factory=dict)
    _scratch: Path | None = None

    @property
    def scratch(self) -> Path:
        if self._scratch is None:
            self._scratch = self.settings.home / "scratch" / self.step_run_id
            self._scratch.mkdir(parents=True, exist_ok=True)
        return self._scratch

    def output_dir(self, name: str = "output") -> Path:
        """A fresh, empty local folder to write an output into before `save`."""
        path = self.scratch / f"{name}-{self.attempt}"
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        return path

    def save(self, local_dir: str | Path, *, kind: str, name: str | None = None, metadata: dict | None = None) -> Artifact:
        """Commit a folder to the artifact store and record it as produced by this step run."""
        art = self.artifacts.put_dir(local_dir, kind=kind, name=name or self.node, metadata=metadata)
        return self.store.record_artifact(art, producer_step_run_id=self.step_run_id)

    def register_source(self, path: str | Path, *, name: str | None = None, metadata: dict | None = None) -> Artifact:
        """Record raw input files (not copied) so lineage reaches them; returns the source artifact."""
        art = self.artifacts.register_external(path, kind="source", name=name, metadata=metadata)
        art = self.store.record_artifact(art)
        self.store.add_edge(self.step_run_id, art.id, f"source:{art.name}", direction="input")
        if self.logger:
            self.logger.log_dataset(art, context="source")
        return art

    def log_metrics(self, metrics: dict, step: int | None = None) -> None:
        self.key_metrics.update({k: v for k, v in metrics.items() if isinstance(v, int | float)})
        if self.logger:
            self.logger.log_metrics(metrics, step=step)

    def log_params(self, params: dict) -> None:
        if self.logger:
            self.logger.log_params(params)

    def progress(self, message: str) -> None:
        """A progress line in the step's Ray log (and the driver's console via log_to_driver)."""
        print(f"[{time.strftime('%H:%M:%S')}] {self.pipeline}.{self.node}: {message}", file=sys.stderr, flush=True)

    def cleanup(self) -> None:
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
