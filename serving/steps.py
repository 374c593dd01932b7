"""The `register` and `deploy` pipeline steps."""

from __future__ import annotations

from raypai import Artifact, StepContext, step
from raypai.train.steps import model_tags


@step(cpus=0.25)  # cached by model digest + evaluation: an unchanged re-run registers nothing new
def register(ctx: StepContext, model: Artifact, name: str, evaluation: dict | None = None,
             alias: str = "champion") -> dict:
    """Register the model in the MLflow registry with lineage tags; set `alias` only when the
    evaluation says it beat its baseline (or when there is no evaluation)."""
    version = ctx.tracker.register_model(model.local_path(), name, run_id=ctx.logger.run_id if ctx.logger else None,
                                         tags=model_tags(ctx, model, {"model": model}))
    promoted = evaluation is None or bool(evaluation.get("improved"))
    if promoted:
        ctx.tracker.set_alias(name, alias, version)
    ctx.log_metrics({"registered_version": version, "promoted": int(promoted)})
    return {"model": name, "version": version, "alias": alias if promoted else None, "promoted": promoted}


def unmet_gates(evaluation: dict | None, min_metrics: dict[str, float] | None) -> list[str]:
    """Each `metric >= threshold` in `min_metrics` that `evaluation` fails (missing counts as failed)."""
    problems = []
    for metric, threshold in (min_metrics or {}).items():
        value = (evaluation or {}).get(metric)
        if not isinstance(value, (int, float)) or value < threshold:
            problems.append(f"{metric}={value} < {threshold}")
    return problems


@step(cpus=0.25, cache=False)
def deploy(ctx: StepContext, registered: dict, name: str, replicas: int = 1, cpus: float = 0.5,
           require_promoted: bool = False, evaluation: dict | None = None,
           min_metrics: dict[str, float] | None = None) -> dict:
    """Create the deployment `name` serving `registered` (the `register` step's output), or roll its
    stable version forward to it (the new version starts before the old one stops). Skipped, with the
    reason, when `require_promoted` and the evaluation did not promote it, or when a metric in
    `min_metrics` (e.g. {"accuracy_candidate": 0.5}) is below its threshold in `evaluation`."""
    from raypai.serving.control import Controller

    if require_promoted and not registered.get("promoted"):
        return {"deployed": False, "reason": "evaluation did not beat the baseline", **registered}
    failed = unmet_gates(evaluation, min_metrics)
    if failed:
        return {"deployed": False, "reason": "metric gate: " + ", ".join(failed), **registered}
    ctl = Controller(ctx.settings, store=ctx.store, tracker=ctx.tracker)
    existing = ctx.store.get_deployment(name)
    if existing is None:
        out = ctl.create(name, registered["model"], registered["version"], replicas=replicas, cpus=cpus)
    elif existing.spec["version"] == registered["version"]:
        ctl.reconcile()  # same version: make sure Serve still has it
        out = ctl.describe(name)
    else:
        ctl.update(name, canary_version=registered["version"], canary_percent=0)
        out = ctl.update(name, promote=True)
    ctx.log_metrics({"deployed_version": out["spec"]["version"]})
    return {"deployed": True, "deployment": name, "model": registered["model"], "version": out["spec"]["version"],
            "endpoint": out["endpoint"]}
