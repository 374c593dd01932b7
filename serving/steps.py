"""The `register` and `deploy` pipeline steps."""

from __future__ import annotations

from raypai import Artifact, StepContext, step
from raypai.deployment import DEFAULT_ALIAS, DEFAULTS


@step(cpus=0.25)  # cached by model digest + evaluation: an unchanged re-run registers nothing new
def register(
    ctx: StepContext, model: Artifact, name: str, evaluation: dict | None = None, alias: str = DEFAULT_ALIAS
) -> dict:
    """Register the model in the MLflow registry with lineage tags; set `alias` only when the
    evaluation says it beat its baseline (or when there is no evaluation)."""
    version = ctx.register_model(model, name, {"model": model})
    promoted = evaluation is None or bool(evaluation.get("improved"))
    if promoted:
        ctx.tracker.set_alias(name, alias, version)
    ctx.log_metrics({"registered_version": version, "promoted": int(promoted)})
    return {"model": name, "version": version, "alias": alias if promoted else None, "promoted": promoted}


def deploy_gate(
    registered: dict,
    *,
    require_promoted: bool,
    evaluation: dict | None = None,
    min_metrics: dict[str, float] | None = None,
) -> str | None:
    """Why the deploy step must not deploy `registered` (the `register` step's output), or None when
    it may: with `require_promoted` (the pipelines' `require_improvement`), a version the evaluation
    did not promote is refused; then each `min_metrics` threshold `evaluation` fails."""
    if require_promoted and not registered.get("promoted"):
        return "evaluation did not beat the baseline"
    failed = unmet_gates(evaluation, min_metrics)
    return "metric gate: " + ", ".join(failed) if failed else None


def unmet_gates(evaluation: dict | None, min_metrics: dict[str, float] | None) -> list[str]:
    """Each `metric >= threshold` in `min_metrics` that `evaluation` fails (missing counts as failed)."""
    problems = []
    for metric, threshold in (min_metrics or {}).items():
        value = (evaluation or {}).get(metric)
        if not isinstance(value, (int, float)) or value < threshold:
            problems.append(f"{metric}={value} < {threshold}")
    return problems


def still_serving(value: dict | None, store) -> str | None:
    """The deploy step's cache check: None when the deployment its cached result names still serves
    that version (the store's desired state, and Serve's application RUNNING), else why not. A cached
    "not deployed" (a gate said no) holds as it is."""
    if not value or not value.get("deployed"):
        return None
    name, version = value["deployment"], value["version"]
    rec = store.get_deployment(name)
    if rec is None or rec.state != "running":
        return f"deployment {name!r} is {'gone' if rec is None else rec.state} now"
    if rec.spec.version != version:
        return f"deployment {name!r} now serves version {rec.spec.version}, not {version}"
    try:
        from ray import serve

        from raypai.serving.router import app_name

        status = serve.status().applications.get(app_name(name, version))
    except Exception as exc:  # noqa: BLE001 - Serve unreachable: redeploy rather than trust the record
        return f"Ray Serve cannot be asked whether {name!r} runs ({type(exc).__name__}: {exc})"
    state = getattr(getattr(status, "status", None), "value", None) if status is not None else "MISSING"
    if state != "RUNNING":
        return f"Serve application of {name!r} v{version} is {state}"
    return None


# Cached by its inputs (the registered version, the gates), vetted by a health check: a re-run whose
# deployment already serves the version is a cache hit, not a redeploy.
@step(cpus=0.25, cache_check=still_serving)
def deploy(
    ctx: StepContext,
    registered: dict,
    name: str,
    replicas: int = DEFAULTS["replicas"],
    cpus: float = DEFAULTS["cpus"],
    gpus: float = DEFAULTS["gpus"],
    engine: str = DEFAULTS["engine"],
    require_promoted: bool = False,
    evaluation: dict | None = None,
    min_metrics: dict[str, float] | None = None,
) -> dict:
    """Create the deployment `name` serving `registered` (the `register` step's output), or roll its
    stable version forward to it (the new version starts before the old one stops). Skipped, with the
    reason, when `require_promoted` and the evaluation did not promote it, or when a metric in
    `min_metrics` (e.g. {"accuracy_candidate": 0.5}) is below its threshold in `evaluation`.
    `engine` ("raypai", "vllm", "auto": vLLM when `gpus` > 0 and vLLM imports) applies when it creates
    the deployment; a roll-forward keeps the deployment's engine."""
    from raypai.serving.control import Controller
    from raypai.store import MetadataStore

    refused = deploy_gate(registered, require_promoted=require_promoted, evaluation=evaluation, min_metrics=min_metrics)
    if refused:
        return {"deployed": False, "reason": refused, **registered}
    # the control plane's own handle on the deployments table (the step context gives no store)
    ctl = Controller(
        ctx.settings, store=MetadataStore(ctx.settings.database_url, migrate_schema=False), tracker=ctx.tracker
    )
    existing = ctl.spec(name)
    if existing is None:
        out = ctl.create(
            name, registered["model"], registered["version"], replicas=replicas, cpus=cpus, gpus=gpus, engine=engine
        )
    elif existing.version == registered["version"]:
        ctl.reconcile()  # same version: make sure Serve still has it
        out = ctl.describe(name)
    else:
        # the offline evaluation (require_promoted / min_metrics) is this step's gate: roll forward at once
        # (a measured canary is `raypai deploy update --canary-percent N`, then promote on a healthy verdict)
        ctl.update(name, canary_version=registered["version"], canary_percent=0)
        out = ctl.update(name, promote=True, force=True)
    ctx.log_metrics({"deployed_version": out["spec"]["version"]})
    return {
        "deployed": True,
        "deployment": name,
        "model": registered["model"],
        "version": out["spec"]["version"],
        "endpoint": out["endpoint"],
    }
