"""Backend parity: the parts of a run's records that must not depend on where it ran.

    from raypai.tools.parity import lineage_shape, mlflow_shape, registry_shape, differences
    assert not differences(lineage_shape(upstream(store_a, id_a)), lineage_shape(upstream(store_b, id_b)))

The same pipeline run embedded (SQLite, local MLflow, local artifact folder) and against production
services (PostgreSQL, an MLflow server, s3://) must record the same graph: the same steps, edges,
artifact kinds and names, the same MLflow experiment / parent run / nested runs with the same
param, metric and tag keys, and the same registry tags. Ids, URIs, run ids and timestamps differ by
construction and are left out of a shape; digests are kept apart (`lineage_digests`) because only
deterministic steps reproduce them.
"""

from __future__ import annotations

__all__ = ["differences", "lineage_digests", "lineage_shape", "mlflow_shape", "registry_shape"]


def lineage_shape(tree: dict) -> dict:
    """An upstream tree (`raypai.lineage.upstream`) without ids, URIs, digests, run ids and times."""
    art = tree["artifact"]
    out: dict = {
        "keys": sorted(tree),
        "kind": art["kind"],
        "name": art["name"],
        "metadata_keys": sorted(art.get("metadata") or {}),
        "repeated": bool(tree.get("repeated")),
    }
    step = tree.get("produced_by")
    if step is not None:
        out["produced_by"] = {
            "keys": sorted(step),
            "node": step["node"],
            "step": step["step"],
            "state": step["state"],
            "pipeline": step["pipeline"],
            "cache_hit": step["cache_hit"],
            "has_mlflow_run": bool(step["mlflow_run_id"]),
            "metric_keys": sorted(step["metrics"]),
            "inputs": [{"name": i["name"], "lineage": lineage_shape(i["lineage"])} for i in step["inputs"]],
        }
    return out


def lineage_digests(tree: dict, path: str = "") -> dict[str, str]:
    """{'count<-text<-text': digest, ...}: each artifact's digest keyed by its edge path from the root."""
    here = path or tree["artifact"]["name"]
    out = {here: tree["artifact"]["digest"]}
    for inp in (tree.get("produced_by") or {}).get("inputs", []):
        out.update(lineage_digests(inp["lineage"], f"{here}<-{inp['name']}"))
    return out


def mlflow_shape(tracker, parent_run_id: str) -> dict:
    """Experiment name, the parent run and its nested runs (recursively), by run name: status,
    param/metric/tag keys and dataset inputs (name, context, raypai kind)."""
    client = tracker.client
    parent = client.get_run(parent_run_id)
    return {"experiment": client.get_experiment(parent.info.experiment_id).name, **_run_shape(client, parent)}


def _run_shape(client, run) -> dict:
    children = client.search_runs(
        [run.info.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{run.info.run_id}'"
    )
    by_name: dict = {}
    for child in children:
        name = child.data.tags.get("mlflow.runName", child.info.run_name)
        by_name.setdefault(name, []).append(_run_shape(client, child))
    inputs = sorted(
        (
            d.dataset.name,
            {t.key: t.value for t in d.tags}.get("mlflow.data.context", ""),
            {t.key: t.value for t in d.tags}.get("raypai.kind", ""),
        )
        for d in (run.inputs.dataset_inputs if run.inputs else [])
    )
    return {
        "status": run.info.status,
        "param_keys": sorted(run.data.params),
        "metric_keys": sorted(run.data.metrics),
        "tag_keys": sorted(run.data.tags),
        "inputs": [list(i) for i in inputs],
        "children": {k: sorted(v, key=repr) for k, v in sorted(by_name.items())},
    }


def registry_shape(tracker, name: str) -> dict:
    """A registered model's versions (tag keys, aliases, status, the run's name) without sources."""
    client = tracker.client
    aliases = dict(getattr(client.get_registered_model(name), "aliases", {}) or {})
    versions = []
    for mv in sorted(client.search_model_versions(f"name = '{name}'"), key=lambda v: int(v.version)):
        run_name = client.get_run(mv.run_id).data.tags.get("mlflow.runName") if mv.run_id else None
        versions.append(
            {
                "version": int(mv.version),
                "status": mv.status,
                "tag_keys": sorted(mv.tags or {}),
                "aliases": sorted(a for a, v in aliases.items() if str(v) == str(mv.version)),
                "run_name": run_name,
            }
        )
    return {"name": name, "versions": versions}


def differences(a, b, path: str = "") -> list[str]:
    """Where two shapes differ, as 'path: a != b' lines (empty when they are identical)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b), key=str):
            if k not in a or k not in b:
                left, right = (repr(x[k]) if k in x else "missing" for x in (a, b))
                out.append(f"{path}/{k}: {left} != {right}")
            else:
                out += differences(a[k], b[k], f"{path}/{k}")
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path or '/'}: {a!r} != {b!r}"]
