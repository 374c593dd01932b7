"""StepContext: what a running step sees (settings, its artifacts, its MLflow run, scratch space).

A step reaches the metadata store only through the narrow methods below (`save`,
`register_source`, `register_model`, `record_op_stats`): not tokens, deployments or other runs.
"""

from __future__ import annotations

import shutil
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
    _metadata: object  # the runner's MetadataStore; steps use the methods below, never the store itself
    artifacts: ArtifactStore
    tracker: Tracker
    logger: RunLogger | None
    attempt: int = 0
    cache_key: str | None = None  # the runner's key of this step call (raypai.cachekey)
    key_metrics: dict = field(default_factory=dict)
    _scratch: Path | None = None
    _reporter: object = None

    def record_op_stats(self, artifact: Artifact, rows: list[dict]) -> None:
        """Per-op data-cleaning counters for `artifact` (this step's output), shown by `raypai show`."""
        self._metadata.record_op_stats(self.step_run_id, artifact.id, rows)

    @property
    def scratch(self) -> Path:
        if self._scratch is None:
            self._scratch = self.settings.home / "scratch" / self.step_run_id
            self._scratch.mkdir(parents=True, exist_ok=True)
        return self._scratch

    def work_key(self) -> str:
        """16 hex digits naming this step call's resumable work: the runner's cache key, which is the
        same for every run of this step with the same code, parameters and inputs."""
        return (self.cache_key or self.step_run_id)[:16]

    def work_dir(self, name: str = "work") -> Path:
        """A persistent folder for resumable state (checkpoints, per-shard progress) under
        $RAYPAI_HOME/work, shared by every attempt and run of this step call with the same cache key:
        a retry or `raypai resume` after a crash finds what the failed attempt left there; changed
        code, parameters or inputs get a new folder."""
        path = self.settings.home / "work" / f"{self.pipeline}.{self.node}.{name}-{self.work_key()}"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def output_dir(self, name: str = "output") -> Path:
        """A fresh, empty local folder to write an output into before `save`."""
        path = self.scratch / f"{name}-{self.attempt}"
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        return path

    def save(
        self, local_dir: str | Path, *, kind: str, name: str | None = None, metadata: dict | None = None
    ) -> Artifact:
        """Commit a folder to the artifact store and record it as produced by this step run."""
        art = self.artifacts.put_dir(local_dir, kind=kind, name=name or self.node, metadata=metadata)
        return self._metadata.record_artifact(art, producer_step_run_id=self.step_run_id)

    def register_source(self, path: str | Path, *, name: str | None = None, metadata: dict | None = None) -> Artifact:
        """Record raw input files (not copied) so lineage reaches them; returns the source artifact."""
        art = self.artifacts.register_external(path, kind="source", name=name, metadata=metadata)
        art = self._metadata.record_artifact(art)
        self._metadata.add_edge(self.step_run_id, art.id, f"source:{art.name}", direction="input")
        if self.logger:
            self.logger.log_dataset(art, context="source")
        return art

    def register_model(
        self,
        model: Artifact,
        name: str,
        inputs: dict[str, Artifact],
        *,
        alias: str | None = None,
        local_dir: str | Path | None = None,
        tags: dict | None = None,
    ) -> int:
        """Register the saved model artifact `model` in the MLflow registry as `name` (optionally
        setting `alias`; `local_dir`: the folder it was saved from, saving a download), tagged with its lineage (raypai.tracking.lineage_tags: the artifact, this
        step run, `inputs`) and `tags`; returns the registry version."""
        from raypai.tracking import lineage_tags

        lineage = lineage_tags(
            model, run_id=self.run_id, step_run_id=self.step_run_id, pipeline=self.pipeline, inputs=inputs
        )
        return self.tracker.register_model(
            local_dir or self.artifacts.open_artifact(model),
            name,
            tags={**lineage, **(tags or {})},
            alias=alias,
            run_id=self.logger.run_id if self.logger else None,
        )

    def log_metrics(self, metrics: dict, step: int | None = None) -> None:
        self.key_metrics.update({k: v for k, v in metrics.items() if isinstance(v, int | float)})
        if self.logger:
            self.logger.log_metrics(metrics, step=step)

    def log_params(self, params: dict) -> None:
        if self.logger:
            self.logger.log_params(params)

    def progress(
        self,
        done: float | str | None = None,
        total: float | None = None,
        unit: str = "steps",
        *,
        note: str | None = None,
    ) -> None:
        """How far this step is (`ctx.progress(120, 200, "steps")`, or a note: `ctx.progress("loading")`):
        the driver shows one summary line per running step (rate, time left). Throttled to 1/s."""
        self.progress_reporter()(done, total, unit, note=note)

    def progress_reporter(self):
        """The same reporter as a picklable callable, for the Ray Train workers or actors a step starts."""
        if self._reporter is None:
            from raypai.progress import StepProgress

            self._reporter = StepProgress(self.node)
        return self._reporter

    def cleanup(self) -> None:
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
