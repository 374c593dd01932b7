"""Lineage from a deployment: deployment → registered model version(s) → model artifact → … → raw files.

raypai lineage --deployment tinychat
GET /api/v1/lineage/deployments/tinychat
"""

from __future__ import annotations

from raypai.errors import NotFoundError
from raypai.lineage import sources, upstream
from raypai.settings import Settings
from raypai.store import MetadataStore
from raypai.tracking import ARTIFACT_TAG


def deployment_lineage(store: MetadataStore, settings: Settings, name: str) -> dict:
    from raypai.runner import tracker_for

    rec = store.get_deployment(name)
    if rec is None:
        known = ", ".join(d.name for d in store.list_deployments()) or "none"
        raise NotFoundError(f"no deployment named {name!r} (known: {known}); see `raypai deploy list`")
    tracker = tracker_for(settings)
    models = []
    model = rec.spec.model
    for version, role in rec.spec.served():
        _, tags = tracker.resolve_model(model, version)
        entry = {
            "model": model,
            "version": version,
            "role": role,
            "tags": tags,
            "mlflow_source": tracker.model_source(model, version),
        }
        art_id = tags.get(ARTIFACT_TAG)
        if art_id:
            tree = upstream(store, art_id)
            entry["lineage"] = tree
            entry["raw_sources"] = sources(tree)
        models.append(entry)
    return {"deployment": rec.name, "state": rec.state, "spec": rec.spec.to_dict(), "models": models}
