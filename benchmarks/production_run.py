"""Production backends vs embedded: the small tinychat configuration (the e2e test's SMALL parameters)
run once against `raypai services` (metadata in PostgreSQL, an MLflow server with its backend in
PostgreSQL and artifacts proxied to S3, raypai artifacts on s3://) and once with the embedded defaults
(SQLite, local MLflow, a local folder), each ending with a deployed, queried endpoint; then the
lineage from the deployment back to the raw files, the MLflow records and the registry compared.

    .venv/bin/python benchmarks/production_run.py        # ≈ 10 min on 2 cores; one JSON line per result
    .venv/bin/python benchmarks/production_run.py --postgres-url postgresql+psycopg://postgres@127.0.0.1:5432/postgres

The services run on free ports with their own databases and bucket (dropped afterwards unless
`--keep`). Each mode runs in its own process with its own RAYPAI_HOME, local Ray and Serve port, one
after the other (the embedded run is the baseline, measured in the same invocation).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

# The e2e test's SMALL configuration (tests/e2e/test_tinychat.py), repeated here: benchmarks don't import tests.
SMALL = dict(
    docs=800,
    vocab_size=512,
    block_size=64,
    hidden=64,
    pretrain_steps=30,
    sft_steps=100,
    sft_lr=3e-3,
    rm_steps=60,
    align_steps=6,
)
MAIN_PATH = ("sft_model", "base_model", "shards", "dataset", "raw")  # the input followed from model to raw files


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def emit(**fields) -> None:
    print(json.dumps({"bench": "production_run", **fields}), flush=True)


# ---- one mode, in its own process ---------------------------------------------------------------


def _expanded(tree: dict, index: dict | None = None) -> dict:
    """artifact id -> its expanded node (an upstream tree shows a shared input in full only once)."""
    index = {} if index is None else index
    if not tree.get("repeated"):
        index[tree["artifact"]["id"]] = tree
    for inp in (tree.get("produced_by") or {}).get("inputs", []):
        _expanded(inp["lineage"], index)
    return index


def _chain(tree: dict) -> list[str]:
    """Step names along the main input path, from the deployed model to the step that read the raw files."""
    index, out, node = _expanded(tree), [], tree
    while node is not None and node.get("produced_by"):
        step = node["produced_by"]
        out.append(step["node"])
        inputs = {i["name"]: i["lineage"]["artifact"]["id"] for i in step["inputs"]}
        node = next((index[inputs[k]] for k in MAIN_PATH if k in inputs), None)
    return out


def _kinds(tree: dict, path: str = "") -> dict[str, str]:
    """The artifact kind at each path of `raypai.tools.parity.lineage_digests`."""
    here = path or tree["artifact"]["name"]
    out = {here: tree["artifact"]["kind"]}
    for inp in (tree.get("produced_by") or {}).get("inputs", []):
        out.update(_kinds(inp["lineage"], f"{here}<-{inp['name']}"))
    return out


def _uris(tree: dict) -> list[str]:
    step = tree.get("produced_by")
    return [tree["artifact"]["uri"]] + [u for i in (step or {}).get("inputs", []) for u in _uris(i["lineage"])]


def run_mode(mode: str, out_path: Path) -> None:
    import httpx
    import ray
    from ray import serve

    from raypai.lineage.deploy import deployment_lineage
    from raypai.pipelines.tinychat import tinychat
    from raypai.runner import Runner, tracker_for
    from raypai.serving.control import serve_port
    from raypai.settings import Settings
    from raypai.store import MetadataStore
    from raypai.tools.parity import lineage_digests, lineage_shape, mlflow_shape, registry_shape

    settings = Settings.load()
    rec: dict = {"mode": mode, "settings": {k: v for k, v in settings.to_env().items() if k != "RAYPAI_HOME"}}
    t0 = time.time()
    result = Runner(settings).run(tinychat.build(**SMALL, require_improvement=False))  # always an endpoint to compare
    try:
        rec.update(
            ok=result.ok,
            pipeline_s=round(result.seconds, 1),
            steps={n: [s.state, round(s.seconds, 1)] for n, s in result.steps.items()},
            errors={n: s.error for n, s in result.steps.items() if s.error},
        )
        if result.ok:
            store = MetadataStore(settings.database_url)
            token = store.create_token(f"bench-{uuid.uuid4().hex[:6]}", ["infer"])
            r = httpx.post(
                f"http://127.0.0.1:{serve_port()}/v1/chat/completions",
                timeout=120,
                headers={"Authorization": f"Bearer {token}"},
                json={"model": "tinychat", "messages": [{"role": "user", "content": "3+4="}], "max_tokens": 4},
            )
            rec["query"] = {"status": r.status_code, "served_version": r.headers.get("x-raypai-model-version")}
            graph = deployment_lineage(store, settings, "tinychat")
            stable = graph["models"][0]
            tracker = tracker_for(settings)
            rec.update(
                deployment={
                    "model": stable["model"],
                    "version": stable["version"],
                    "role": stable["role"],
                    "tag_keys": sorted(stable["tags"]),
                    "mlflow_source": stable["mlflow_source"],
                },
                chain=_chain(stable["lineage"]),
                lineage_shape=lineage_shape(stable["lineage"]),
                digests=lineage_digests(stable["lineage"]),
                digest_kinds=_kinds(stable["lineage"]),
                raw_sources=[{k: a[k] for k in ("kind", "name", "digest")} for a in stable["raw_sources"]],
                uri_prefixes=sorted({u.rsplit("/", 2)[0] for u in _uris(stable["lineage"]) if "/" in u}),
                registry={m.name: registry_shape(tracker, m.name) for m in tracker.client.search_registered_models()},
                mlflow=mlflow_shape(tracker, result.mlflow_run_id),
                mlflow_run_id=result.mlflow_run_id,
                run_id=result.run_id,
                register=result["register"].value,
                evaluate={k: v for k, v in result["evaluate"].value.items() if k.startswith(("accuracy", "improved"))},
            )
    finally:
        rec["wall_s"] = round(time.time() - t0, 1)
        out_path.write_text(json.dumps(rec))
        serve.shutdown()
        ray.shutdown()


# ---- the comparison ------------------------------------------------------------------------------


def _counts(cfg, env: dict, prod: dict) -> dict:
    """Where the production run's records are: objects in the bucket, rows in the two databases."""
    import boto3
    from sqlalchemy import create_engine, text

    s3 = boto3.client(
        "s3",
        endpoint_url=env["AWS_ENDPOINT_URL"],
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        region_name=env["AWS_REGION"],
    )
    objects: dict = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=cfg.bucket):
        for o in page.get("Contents", []):
            top = o["Key"].split("/", 1)[0]
            n, size = objects.get(top, (0, 0))
            objects[top] = (n + 1, size + o["Size"])
    out = {"s3_objects": {k: {"objects": n, "mib": round(b / 2**20, 1)} for k, (n, b) in sorted(objects.items())}}
    queries = {
        cfg.mlflow_db: {
            "mlflow_runs": "SELECT count(*) FROM runs",
            "mlflow_model_versions": "SELECT count(*) FROM model_versions",
        },
        cfg.metadata_db: {
            "step_runs": "SELECT count(*) FROM step_runs WHERE run_id = :r",
            "artifacts_on_s3": "SELECT count(*) FROM artifacts WHERE uri LIKE 's3://%'",
            "artifacts_total": "SELECT count(*) FROM artifacts",
            "deployments": "SELECT count(*) FROM deployments",
        },
    }
    for db, qs in queries.items():
        engine = create_engine(cfg.db_url(db))
        with engine.connect() as conn:
            for name, q in qs.items():
                out[name] = conn.execute(text(q), {"r": prod.get("run_id")}).scalar()
        engine.dispose()
    return out


def _without_aliases(registry: dict | None) -> dict | None:
    if registry is None:
        return None
    return {
        m: {**r, "versions": [{k: v for k, v in ver.items() if k != "aliases"} for ver in r["versions"]]}
        for m, r in registry.items()
    }


def _alias_ok(rec: dict) -> bool:
    """The deployed model's version carries `champion` exactly when the run's evaluation promoted it."""
    reg = rec.get("register") or {}
    versions = (rec.get("registry") or {}).get(reg.get("model"), {}).get("versions", [])
    aliases = next((v["aliases"] for v in versions if v["version"] == reg.get("version")), None)
    return aliases is not None and ("champion" in aliases) == bool(reg.get("promoted"))


def compare(prod: dict, emb: dict) -> None:
    from raypai.tools.parity import differences

    for key in ("lineage_shape", "mlflow"):
        diffs = differences(prod.get(key), emb.get(key))
        emit(check=key, identical=not diffs, differences=diffs[:20], n_differences=len(diffs))
    # The `champion` alias follows each run's own evaluation gate (a trained model beats its baseline
    # or not), so it is compared with that run's `register` result, and left out of the shape.
    diffs = differences(_without_aliases(prod.get("registry")), _without_aliases(emb.get("registry")))
    emit(
        check="registry",
        identical=not diffs,
        differences=diffs[:20],
        n_differences=len(diffs),
        **{f"{m}_alias_follows_evaluation": _alias_ok(r) for m, r in (("production", prod), ("embedded", emb))},
        evaluate={"production": prod.get("evaluate"), "embedded": emb.get("evaluate")},
    )
    same = [p for p in prod.get("digests", {}) if emb.get("digests", {}).get(p) == prod["digests"][p]]
    # Expected to differ by construction, not by backend: model folders carry raypai.json with lineage
    # ids, and ingest's manifest names the raw folder's absolute path (each mode has its own home).
    kinds = prod.get("digest_kinds", {})
    emit(
        check="digests",
        equal=len(same),
        total=len(prod.get("digests", {})),
        equal_kinds=sorted({kinds.get(p) for p in same}),
        differing=[[p, kinds.get(p)] for p in sorted(set(prod.get("digests", {})) - set(same))],
    )
    emit(
        check="chain",
        production=prod.get("chain"),
        embedded=emb.get("chain"),
        identical=prod.get("chain") == emb.get("chain"),
    )
    emit(
        check="raw_sources",
        production=prod.get("raw_sources"),
        embedded=emb.get("raw_sources"),
        identical=prod.get("raw_sources") == emb.get("raw_sources"),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--postgres-url",
        default=os.environ.get("RAYPAI_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"),
    )
    ap.add_argument("--keep", action="store_true", help="leave the services, databases and homes in place")
    ap.add_argument("--mode-run", help=argparse.SUPPRESS)  # internal: run one mode in this process
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.mode_run:
        return run_mode(args.mode_run, Path(args.out))

    from raypai.tools.parity import differences
    from raypai.tools.services import ServicesConfig, down, up

    work = Path(tempfile.mkdtemp(prefix="raypai-prodrun-"))
    tag = uuid.uuid4().hex[:8]
    cfg = ServicesConfig(
        home=work / "services-home",
        postgres_url=args.postgres_url,
        mlflow_db=f"raypai_mlflow_b{tag}",
        metadata_db=f"raypai_b{tag}",
        mlflow_port=free_port(),
        s3_port=free_port(),
        bucket=f"raypai-b{tag}",
    )
    t0 = time.time()
    env = up(cfg)
    emit(
        event="services_up",
        seconds=round(time.time() - t0, 1),
        mlflow=cfg.mlflow_uri,
        s3=cfg.s3_endpoint,
        metadata_db=cfg.metadata_db,
        mlflow_db=cfg.mlflow_db,
        bucket=cfg.bucket,
    )
    base = {
        k: v
        for k, v in os.environ.items()
        if k
        not in ("RAYPAI_DATABASE_URL", "MLFLOW_TRACKING_URI", "RAYPAI_ARTIFACT_URI", "RAY_ADDRESS", "RAYPAI_CONFIG")
    }
    base.update(RAYPAI_DASHBOARD="0", RAY_USAGE_STATS_ENABLED="0", MLFLOW_DISABLE_TELEMETRY="true")
    records = {}
    try:
        for mode in ("production", "embedded"):
            out = work / f"{mode}.json"
            mode_env = {
                **base,
                "RAYPAI_HOME": str(work / mode),
                "RAYPAI_SERVE_PORT": str(free_port()),
                **(env if mode == "production" else {}),
            }
            t1 = time.time()
            proc = subprocess.run(
                [sys.executable, __file__, "--mode-run", mode, "--out", str(out)],
                env=mode_env,
                stdout=subprocess.DEVNULL,
                stderr=open(work / f"{mode}.log", "wb"),
            )
            rec = json.loads(out.read_text()) if out.exists() else {"mode": mode, "ok": False}
            rec["process_s"], rec["exit_code"] = round(time.time() - t1, 1), proc.returncode
            records[mode] = rec
            emit(
                mode=mode,
                ok=rec.get("ok"),
                exit_code=proc.returncode,
                process_s=rec["process_s"],
                pipeline_s=rec.get("pipeline_s"),
                steps=rec.get("steps"),
                errors=rec.get("errors"),
                query=rec.get("query"),
                deployment=rec.get("deployment"),
                uri_prefixes=rec.get("uri_prefixes"),
                settings=rec.get("settings"),
                log=str(work / f"{mode}.log"),
            )
        prod, emb = records["production"], records["embedded"]
        compare(prod, emb)
        emit(check="production_storage", **_counts(cfg, env, prod))
        ok = bool(prod.get("ok") and emb.get("ok"))
        emit(
            summary=True,
            both_ok=ok,
            production_vs_embedded_pipeline_s=(round(prod["pipeline_s"] / emb["pipeline_s"], 2) if ok else None),
            lineage_identical=not differences(prod.get("lineage_shape"), emb.get("lineage_shape")),
            served=[r.get("query", {}).get("served_version") for r in (prod, emb)],
        )
    finally:
        if not args.keep:
            down(cfg)
            from sqlalchemy import create_engine, text

            engine = create_engine(args.postgres_url, isolation_level="AUTOCOMMIT")
            with engine.connect() as conn:
                for db in (cfg.mlflow_db, cfg.metadata_db):
                    conn.execute(text(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)'))
            engine.dispose()
            for mode in records:  # the homes (models, caches); the logs stay
                shutil.rmtree(work / mode, ignore_errors=True)
        else:
            emit(event="kept", work=str(work), services_home=str(cfg.home))


if __name__ == "__main__":
    main()
