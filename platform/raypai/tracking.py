"""MLflow behind two small objects: `Tracker` (experiments, runs, registry) and `RunLogger`
(a picklable handle on one run, safe to pass into Ray actors and Train workers).

    tracker = Tracker("sqlite:///.raypai/mlflow.db", artifact_root=".raypai/mlartifacts")
    run_id = tracker.start_run("tinychat", "run-1")
    RunLogger(tracker.uri, run_id).log_metrics({"loss": 2.1}, step=10)
    version = tracker.register_model("out/model", "tinychat", run_id=run_id, alias="champion")

No fluent `mlflow.start_run()` globals anywhere: every call names its run (STYLE.md point 11).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time
import uuid
from pathlib import Path

from raypai.artifacts import (
    MARKER,
    Artifact,
    _discard,
    _entries,
    committed_problems,
    default_cache_dir,
    digest_dir,
    read_marker,
)
from raypai.credentials import redact_params, redact_url
from raypai.errors import NotFoundError, StoreError
from raypai.integrity import content_problems, digest_of, refuse_pickle_weights, within

# MLflow's telemetry is off in every process that talks to MLflow through raypai; the variables are
# set when the first client is made (MLflow reads them then), never as a side effect of an import.
TELEMETRY_OFF = {"MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true"}


def _client(uri: str):
    for k, v in TELEMETRY_OFF.items():
        os.environ.setdefault(k, v)
    from mlflow.tracking import MlflowClient

    if uri.startswith("sqlite:///"):  # MLflow creates the database file, not its folder
        Path(uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


class RunLogger:
    """Logs to one MLflow run. Picklable: holds only the tracking URI and the run id."""

    def __init__(self, tracking_uri: str, run_id: str):
        self.tracking_uri = tracking_uri
        self.run_id = run_id
        self._c = None

    def __getstate__(self):
        return {"tracking_uri": self.tracking_uri, "run_id": self.run_id}

    def __setstate__(self, state):
        self.__init__(state["tracking_uri"], state["run_id"])

    @property
    def client(self):
        if self._c is None:
            self._c = _client(self.tracking_uri)
        return self._c

    def log_metrics(self, metrics: dict, step: int | None = None) -> None:
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        batch = [Metric(_key(k), float(v), ts, int(step or 0)) for k, v in metrics.items() if _is_number(v)]
        if batch:
            self.client.log_batch(self.run_id, metrics=batch)

    def log_params(self, params: dict) -> None:
        from mlflow.entities import Param

        # values under secret-looking names become ***, URLs lose their passwords (raypai.credentials)
        flat = _flatten(redact_params(params))
        items = [Param(_key(k), str(v)[:6000]) for k, v in flat.items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[i : i + 100])

    def set_tags(self, tags: dict) -> None:
        for k, v in redact_params(tags).items():
            self.client.set_tag(self.run_id, k, str(v))

    def log_artifact(self, local_path: str | Path, artifact_path: str | None = None) -> None:
        self.client.log_artifact(self.run_id, str(local_path), artifact_path)

    def log_artifacts(self, local_dir: str | Path, artifact_path: str | None = None) -> None:
        self.client.log_artifacts(self.run_id, str(local_dir), artifact_path)

    def log_dataset(self, artifact: Artifact, context: str = "input") -> None:
        """Record an artifact as an MLflow dataset input carrying raypai's own digest."""
        from mlflow.entities import Dataset, DatasetInput, InputTag

        ds = Dataset(
            name=artifact.name,
            digest=artifact.digest[:36],
            source_type="raypai",
            source=artifact.uri,
            schema=None,
            profile=None,
        )
        tags = [
            InputTag("mlflow.data.context", context),
            InputTag("raypai.artifact_id", artifact.id),
            InputTag("raypai.kind", artifact.kind),
        ]
        self.client.log_inputs(self.run_id, datasets=[DatasetInput(ds, tags)])


# Set on every model version raypai registers: the way back from the registry to raypai's lineage.
ARTIFACT_TAG = "raypai.artifact_id"
# Set on every model version raypai registers: the sha256 of its files (raypai.artifacts.digest_dir),
# checked by every download (a replica refuses weights that differ).
DIGEST_TAG = "raypai.digest"
# Set on a registered LoRA adapter (a PEFT folder, not a model): the base version it applies to,
# as "models:/NAME/VERSION". Deploys refuse such a version and name the merge that makes it servable.
ADAPTER_OF_TAG = "raypai.adapter_of"


def lineage_tags(model, *, run_id: str, step_run_id: str, pipeline: str, inputs: dict) -> dict:
    """Registry tags of a model version: its artifact (id, digest), the run and step run that made it,
    and each input artifact (kind:digest prefix and id)."""
    tags = {
        ARTIFACT_TAG: model.id,
        "raypai.digest": model.digest,
        "raypai.run_id": run_id,
        "raypai.step_run_id": step_run_id,
        "raypai.pipeline": pipeline,
    }
    tags.update({f"raypai.input.{k}": f"{a.kind}:{a.digest[:16]}" for k, a in inputs.items() if a is not None})
    tags.update({f"raypai.input.{k}.artifact_id": a.id for k, a in inputs.items() if a is not None})
    return tags


class Tracker:
    """Experiments, runs and the model registry of one MLflow tracking URI."""

    def __init__(self, tracking_uri: str, artifact_root: str | Path | None = None):
        self.uri = tracking_uri
        self.artifact_root = str(artifact_root) if artifact_root else None
        self._c = None

    def __getstate__(self):
        return {"uri": self.uri, "artifact_root": self.artifact_root}

    def __setstate__(self, state):
        self.__init__(state["uri"], state["artifact_root"])

    @property
    def client(self):
        if self._c is None:
            try:
                self._c = _client(self.uri)
            except Exception as exc:  # noqa: BLE001 - MLflow raises many types for a bad URI
                raise StoreError(
                    f"MLflow at {redact_url(self.uri)} cannot be used ({redact_url(str(exc))}); check MLFLOW_TRACKING_URI"
                ) from exc
        return self._c

    def experiment_id(self, name: str) -> str:
        exp = self.client.get_experiment_by_name(name)
        if exp is not None:
            return exp.experiment_id
        location = None
        if self.artifact_root and not self.uri.startswith("http"):
            location = f"{self.artifact_root.rstrip('/')}/{name}"
        try:
            return self.client.create_experiment(name, artifact_location=location)
        except Exception:  # noqa: BLE001 - lost a creation race
            exp = self.client.get_experiment_by_name(name)
            if exp is None:
                raise
            return exp.experiment_id

    def start_run(
        self, experiment: str, run_name: str, *, parent_run_id: str | None = None, tags: dict | None = None
    ) -> str:
        all_tags = {"mlflow.runName": run_name, **(tags or {})}
        if parent_run_id:
            all_tags["mlflow.parentRunId"] = parent_run_id
        run = self.client.create_run(
            self.experiment_id(experiment), run_name=run_name, tags={k: str(v) for k, v in all_tags.items()}
        )
        return run.info.run_id

    def end_run(self, run_id: str, status: str = "FINISHED") -> None:
        self.client.set_terminated(run_id, status=status)

    def logger(self, run_id: str) -> RunLogger:
        return RunLogger(self.uri, run_id)

    def get_run(self, run_id: str):
        return self.client.get_run(run_id)

    def child_runs(self, parent_run_id: str) -> list:
        parent = self.client.get_run(parent_run_id)
        return self.client.search_runs(
            [parent.info.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent_run_id}'"
        )

    # ---- model registry ------------------------------------------------------------------------

    def register_model(
        self,
        model_dir: str | Path,
        name: str,
        *,
        run_id: str | None = None,
        tags: dict | None = None,
        alias: str | None = None,
    ) -> int:
        """Upload an HF model folder (or a PEFT adapter folder) under the run's `model/` and create a
        registry version tagged with its files' digest (DIGEST_TAG; a digest given in `tags`, the
        model artifact's, must be the folder's). Pickle weights are refused: only safetensors."""
        model_dir = Path(model_dir)
        if not any((model_dir / f).exists() for f in ("config.json", "adapter_config.json")):
            raise StoreError(f"{model_dir} is not a Hugging Face model folder (no config.json); export the model first")
        refuse_pickle_weights(model_dir, f"model folder {model_dir}")
        digest, _ = digest_dir(model_dir)
        recorded = (tags or {}).get(DIGEST_TAG)
        if recorded and recorded != digest:
            raise StoreError(
                f"{model_dir} does not hold the model it is registered as: its files' sha256 is {digest[:12]}…, "
                f"the artifact records {recorded[:12]}…. Nothing was registered; check it with `raypai verify`"
            )
        tags = {**(tags or {}), DIGEST_TAG: digest}
        if run_id is None:
            run_id = self.start_run("raypai-models", f"register-{name}")
            self.end_run(run_id)
        self.client.log_artifacts(run_id, str(model_dir), "model")
        source = f"{self.client.get_run(run_id).info.artifact_uri.rstrip('/')}/model"  # inside the run's artifacts
        try:
            self.client.get_registered_model(name)
        except Exception:  # noqa: BLE001 - RESOURCE_DOES_NOT_EXIST
            try:
                self.client.create_registered_model(name)
            except Exception:  # noqa: BLE001 - created concurrently
                pass
        mv = self.client.create_model_version(
            name, source, run_id=run_id, tags={k: str(v) for k, v in (tags or {}).items()}
        )
        version = int(mv.version)
        if alias:
            self.client.set_registered_model_alias(name, alias, str(version))
        return version

    def set_alias(self, name: str, alias: str, version: int) -> None:
        self.client.set_registered_model_alias(name, alias, str(version))

    def resolve_model(self, name: str, ref: str | int) -> tuple[int, dict]:
        """(version, tags) of `name` at an alias ("champion") or a version number."""
        ref = str(ref)
        try:
            mv = (
                self.client.get_model_version(name, ref)
                if ref.isdigit()
                else self.client.get_model_version_by_alias(name, ref)
            )
        except Exception as exc:  # noqa: BLE001 - RESOURCE_DOES_NOT_EXIST and friends
            raise NotFoundError(
                f"model {name!r} has no version or alias {ref!r} in the MLflow registry at {redact_url(self.uri)}; "
                "register it first (a pipeline's register/pretrain step) or pick an existing version"
            ) from exc
        return int(mv.version), dict(mv.tags or {})

    def model_source(self, name: str, ref: str | int) -> str:
        version, _ = self.resolve_model(name, ref)
        return self.client.get_model_version(name, str(version)).source

    def download_model(self, name: str, ref: str | int, cache_dir: str | Path | None = None) -> Path:
        """Local HF folder of a registered model version (cached per registry, name, version and source)
        under `cache_dir` (entry points pass `settings.home / "cache" / "models"`; default: the user
        cache, `default_cache_dir("models")`). Verified before it is returned: the version's source
        lies in the artifact folder of the run that registered it, it holds no pickle files, and its
        files have the digest recorded at registration (DIGEST_TAG); a cached copy is checked by its
        files' sizes and downloaded again when they differ."""
        import mlflow.artifacts

        version, tags = self.resolve_model(name, ref)
        mv = self.client.get_model_version(name, str(version))
        source, where = mv.source, f"model {name!r} version {version}"
        self._check_source(where, mv)
        recorded = tags.get(DIGEST_TAG)
        if not recorded:
            raise StoreError(
                f"{where} has no recorded digest (tag {DIGEST_TAG}), so its weights cannot be verified; "
                f"register it again through raypai (`raypai model import DIR --name {name}`)"
            )
        if cache_dir is None:
            cache_dir = default_cache_dir("models")
        # The key names the registry and the version's source, not just name/version: an embedded
        # registry and an MLflow server used under one RAYPAI_HOME both have a `tinychat` version 1,
        # and a re-created model restarts at 1; either would otherwise serve the other's weights.
        key = hashlib.sha256(f"{self.uri}\0{source}".encode()).hexdigest()[:12]
        target = Path(cache_dir) / name / f"{version}-{key}"
        if (read_marker(target) or {}).get("digest") == recorded and not committed_problems(target):
            return target
        tmp = target.parent / f".{version}.{uuid.uuid4().hex[:8]}"
        tmp.mkdir(parents=True, exist_ok=True)
        try:
            local = Path(
                mlflow.artifacts.download_artifacts(artifact_uri=source, dst_path=str(tmp), tracking_uri=self.uri)
            )
            _verify_weights(local, recorded, f"{where} (downloaded from {source})")
            if target.exists():
                _discard(target)  # an unverified or damaged earlier copy
            try:
                local.rename(target)
            except OSError:
                pass  # a concurrent download won; it was verified the same way
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return target

    def _check_source(self, where: str, mv) -> None:
        """A version's weights come from the registry's own artifact store: the artifact folder of
        the run that registered it (where register_model uploads them), never a URI a caller chose."""
        run_uri = self.client.get_run(mv.run_id).info.artifact_uri if mv.run_id else ""
        if not run_uri or not within(mv.source, run_uri):
            raise StoreError(
                f"{where}: its source {mv.source} lies outside the registry's artifact store "
                f"({run_uri or 'the version names no run'}); raypai loads only weights it uploaded itself. "
                "Register the model through raypai (`raypai model import DIR --name NAME`, or a pipeline's "
                "register step), which uploads its files and records their digest"
            )


def _verify_weights(local: Path, digest: str, where: str) -> None:
    """A downloaded model folder must hold only safetensors weights and the recorded digest; on
    success it is stamped with a commit marker recording its files, for the size check of a cache hit."""
    import json

    refuse_pickle_weights(local, where)
    entries = _entries(local)
    got = digest_of([(rel, sha) for rel, _p, _n, sha in entries])
    files = {rel: [n, sha] for rel, _p, n, sha in entries}
    if got != digest:
        # a folder uploaded from the artifact store carries the artifact's marker: it names the file
        named = content_problems((read_marker(local) or {}).get("files"), {r: tuple(e) for r, e in files.items()})
        raise StoreError(
            f"{where} is not what was registered: its files' sha256 is {got[:12]}…, {digest[:12]}… was recorded"
            f"{' (' + '; '.join(named[:3]) + ')' if named else ''}. The download was discarded and nothing is "
            "served from it; register the model again from its artifact (`raypai verify` checks the artifact first)"
        )
    (local / MARKER).write_text(
        json.dumps({"digest": got, "size_bytes": sum(n for n, _ in files.values()), "files": files})
    )


def _is_number(v) -> bool:
    try:
        float(v)
        return not isinstance(v, bool | str)
    except (TypeError, ValueError):
        return False


def _key(k: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "_-. /" else "_" for ch in str(k))[:250]


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out
