"""Lineage graph queries over the metadata store, and export as OpenLineage events.

raypai lineage <artifact-id>          # upstream chain to the raw sources
raypai lineage <artifact-id> --down   # everything built from it
"""

from __future__ import annotations

from raypai.artifacts import Artifact
from raypai.store import MetadataStore

OPENLINEAGE_PRODUCER = "https://github.com/raypai/raypai"
OPENLINEAGE_SCHEMA = "https://openlineage.io/spec/2-0-2/OpenLineage.json#/definitions/RunEvent"


def _art(a: Artifact) -> dict:
    return {
        "id": a.id,
        "kind": a.kind,
        "name": a.name,
        "uri": a.uri,
        "digest": a.digest,
        "size_bytes": a.size_bytes,
        "metadata": a.metadata,
    }


def _step(store: MetadataStore, step_run_id: str) -> dict:
    sr = store.get_step_run(step_run_id)
    run = store.get_run(sr["run_id"])
    return {
        "step_run_id": sr["id"],
        "node": sr["node"],
        "step": sr["step_name"],
        "state": sr["state"],
        "run_id": sr["run_id"],
        "pipeline": run["pipeline"],
        "mlflow_run_id": sr["mlflow_run_id"],
        "cache_hit": sr["cache_hit"],
        "metrics": sr["metrics"] or {},
        "finished_at": sr["finished_at"].isoformat() if sr["finished_at"] else None,
    }


def upstream(store: MetadataStore, artifact_id: str, _seen: set | None = None) -> dict:
    """{'artifact': ..., 'produced_by': {step..., 'inputs': [{'name', 'lineage': <same shape>}]}}."""
    seen = _seen if _seen is not None else set()
    art = store.get_artifact(artifact_id)
    node: dict = {"artifact": _art(art), "produced_by": None}
    if art.id in seen:
        node["repeated"] = True
        return node
    seen.add(art.id)
    if art.producer_step_run_id:
        step = _step(store, art.producer_step_run_id)
        step["inputs"] = [
            {"name": name, "lineage": upstream(store, a.id, seen)}
            for name, a in sorted(store.inputs_of(art.producer_step_run_id).items())
        ]
        node["produced_by"] = step
    return node


def downstream(store: MetadataStore, artifact_id: str, _seen: set | None = None) -> dict:
    """{'artifact': ..., 'consumed_by': [{step..., 'outputs': [<same shape>]}]}."""
    seen = _seen if _seen is not None else set()
    art = store.get_artifact(artifact_id)
    node: dict = {"artifact": _art(art), "consumed_by": []}
    if art.id in seen:
        node["repeated"] = True
        return node
    seen.add(art.id)
    for srid in sorted(set(store.consumers_of(art.id))):
        step = _step(store, srid)
        step["outputs"] = [
            downstream(store, a.id, seen) for _, a in sorted(store.outputs_of(srid).items()) if a.id != art.id
        ]
        node["consumed_by"].append(step)
    return node


def sources(tree: dict) -> list[dict]:
    """The raw sources (artifacts nobody produced) at the leaves of an upstream tree."""
    out = []
    step = tree.get("produced_by")
    if tree.get("repeated"):  # already expanded elsewhere in the tree, not a leaf
        return []
    if step is None:
        return [tree["artifact"]]
    for inp in step["inputs"]:
        out += sources(inp["lineage"])
    uniq = {a["id"]: a for a in out}
    return list(uniq.values())


def openlineage_events(store: MetadataStore, run_id: str, namespace: str = "raypai") -> list[dict]:
    """START/COMPLETE/FAIL RunEvents of every step run of a pipeline run (OpenLineage 2 spec)."""
    run = store.get_run(run_id)
    events = []
    names = {"running": "START", "succeeded": "COMPLETE", "cached": "COMPLETE", "failed": "FAIL", "skipped": "ABORT"}
    for sr in store.step_runs(run["id"]):
        inputs = [
            {"namespace": namespace, "name": f"{a.kind}/{a.name}", "facets": {"version": {"datasetVersion": a.digest}}}
            for a in store.inputs_of(sr["id"]).values()
        ]
        outputs = [
            {"namespace": namespace, "name": f"{a.kind}/{a.name}", "facets": {"version": {"datasetVersion": a.digest}}}
            for a in store.outputs_of(sr["id"]).values()
        ]
        for state, at in store.step_events(sr["id"]):
            if state not in names:
                continue
            events.append(
                {
                    "eventType": names[state],
                    "eventTime": at.isoformat(),
                    "producer": OPENLINEAGE_PRODUCER,
                    "schemaURL": OPENLINEAGE_SCHEMA,
                    "run": {
                        "runId": _uuid(sr["id"]),
                        "facets": {
                            "parent": {
                                "run": {"runId": _uuid(run["id"])},
                                "job": {"namespace": namespace, "name": run["pipeline"]},
                            }
                        },
                    },
                    "job": {"namespace": namespace, "name": f"{run['pipeline']}.{sr['node']}"},
                    "inputs": inputs,
                    "outputs": outputs if names[state] == "COMPLETE" else [],
                }
            )
    return sorted(events, key=lambda e: e["eventTime"])


def _uuid(hex32: str) -> str:
    h = hex32.ljust(32, "0")[:32]
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"
