"""Structure of the deployment files in infra/: KubeRay, compose, the Ray cluster launcher, the
local-cluster helper. No Kubernetes or Docker runs here: the manifests are parsed with pyyaml and
checked for what makes them work together (same image, same services, settings raypai accepts);
the launcher config is validated with Ray's own schema."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import tomllib
import yaml

from raypai.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
INFRA = ROOT / "infra"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
VERSION = PYPROJECT["project"]["version"]
RAY_VERSION = next(d for d in PYPROJECT["project"]["dependencies"] if d.startswith("ray[")).split("==")[1]


def _docs(name: str) -> dict[str, dict]:
    return {d["kind"]: d for d in yaml.safe_load_all((INFRA / "k8s" / name).read_text())}


def _pod_containers(template: dict) -> list[dict]:
    return template["spec"]["containers"]


def _cluster_env() -> dict[str, str]:
    return dict(_docs("config.yaml")["ConfigMap"]["data"])


# what every raypai container reads from the Secret `raypai-secrets`, one key each (secretKeyRef)
SECRET_KEYS = {
    "PGPASSWORD",
    "RAY_AUTH_TOKEN",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "MLFLOW_TRACKING_USERNAME",
    "MLFLOW_TRACKING_PASSWORD",
}


def _secret_refs(container: dict) -> dict[str, str]:
    return {
        e["name"]: e["valueFrom"]["secretKeyRef"]["key"]
        for e in container.get("env", [])
        if "secretKeyRef" in e.get("valueFrom", {}) and e["valueFrom"]["secretKeyRef"]["name"] == "raypai-secrets"
    }


def test_config_holds_production_settings_that_raypai_accepts_and_no_credentials():
    public = _cluster_env()
    for key in SECRET_KEYS:
        assert key not in public, key  # credentials come from the Secret only
    settings = Settings.load(public)  # raises ConfigError listing every bad value
    assert settings.database_url == "postgresql+psycopg://raypai@postgres:5432/raypai"  # password: PGPASSWORD
    assert settings.mlflow_tracking_uri.startswith("http://") and settings.artifact_uri.startswith("s3://")
    assert public["AWS_ENDPOINT_URL"] == public["MLFLOW_S3_ENDPOINT_URL"] and public["RAY_AUTH_MODE"] == "token"


def test_raycluster_runs_the_raypai_image_with_the_shared_settings_everywhere():
    cluster = _docs("raycluster.yaml")["RayCluster"]
    assert cluster["apiVersion"] == "ray.io/v1" and cluster["spec"]["rayVersion"] == RAY_VERSION
    head = cluster["spec"]["headGroupSpec"]
    groups = cluster["spec"]["workerGroupSpecs"]
    containers = _pod_containers(head["template"]) + [c for g in groups for c in _pod_containers(g["template"])]
    for c in containers:
        image, tag = c["image"].rsplit(":", 1)
        assert image.endswith("/raypai") and tag.startswith(f"{VERSION}-"), c["image"]
        sources = {next(iter(s)): s[next(iter(s))]["name"] for s in c["envFrom"]}
        assert sources == {"configMapRef": "raypai-config"}, c["name"]
        refs = _secret_refs(c)
        assert set(refs) == SECRET_KEYS and all(k == v for k, v in refs.items()), c["name"]
    ports = {p["containerPort"] for p in _pod_containers(head["template"])[0]["ports"]}
    assert {6379, 8265, 10001, 8000} <= ports  # GCS, dashboard/Jobs API, client, Serve HTTP
    assert head["rayStartParams"]["dashboard-host"] == "0.0.0.0"
    for g in groups:
        assert g["minReplicas"] <= g["replicas"] <= g["maxReplicas"], g["groupName"]
    gpu = next(g for g in groups if g["groupName"] == "gpu")
    gpu_c = _pod_containers(gpu["template"])[0]
    assert gpu_c["image"].endswith("-cu128") and gpu_c["resources"]["limits"]["nvidia.com/gpu"] == "1"


def test_rayjob_runs_tinychat_on_the_raycluster_with_valid_parameters():
    job = _docs("rayjob.yaml")["RayJob"]
    cluster = _docs("raycluster.yaml")["RayCluster"]
    assert job["apiVersion"] == "ray.io/v1"
    assert job["spec"]["clusterSelector"]["ray.io/cluster"] == cluster["metadata"]["name"]
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[:3] == ["python", "-m", "raypai.pipelines.tinychat"]
    # every --param names a parameter of the tinychat pipeline (the module ships in the wheel)
    from raypai.pipelines.tinychat import tinychat

    params = dict(a.split("=", 1) for a in argv[3:] if a != "--param")
    assert params and tinychat.coerce_params(params)  # raises on unknown names or ill-typed values
    assert yaml.safe_load(job["spec"]["runtimeEnvYAML"])["env_vars"]["RAY_OVERRIDE_JOB_RUNTIME_ENV"] == "1"
    submitter = _pod_containers(job["spec"]["submitterPodTemplate"])[0]
    assert {next(iter(s)) for s in submitter["envFrom"]} == {"configMapRef"}
    assert _secret_refs(submitter)["RAY_AUTH_TOKEN"] == "RAY_AUTH_TOKEN"  # the token for the Jobs API


def _compose() -> dict:
    return yaml.safe_load((INFRA / "compose.yaml").read_text())


def test_compose_wires_mlflow_to_postgres_and_the_s3_bucket():
    services = _compose()["services"]
    assert {"postgres", "minio", "minio-init", "mlflow"} <= set(services)
    cmd = services["mlflow"]["command"]
    opt = dict(a.split("=", 1) for a in cmd if a.startswith("--") and "=" in a)
    backend = opt["--backend-store-uri"]
    assert backend.startswith("postgresql+psycopg://raypai@postgres:5432/")  # password: PGPASSWORD
    assert services["mlflow"]["environment"]["PGPASSWORD"] == services["postgres"]["environment"]["POSTGRES_PASSWORD"]
    # the database MLflow uses is created by the init script mounted into postgres
    db = backend.rsplit("/", 1)[1]
    init = next(v for v in services["postgres"]["volumes"] if "docker-entrypoint-initdb.d" in v)
    sql = (INFRA / init.split(":")[0]).read_text()
    assert re.search(rf"CREATE DATABASE {db}\b", sql)
    # artifacts go to the bucket minio-init creates, through the minio endpoint
    bucket = opt["--artifacts-destination"].removeprefix("s3://").split("/")[0]
    assert f"local/{bucket}" in " ".join(services["minio-init"]["command"])
    assert services["mlflow"]["environment"]["MLFLOW_S3_ENDPOINT_URL"] == "http://minio:9000"
    assert services["mlflow"]["depends_on"] == {
        "postgres": {"condition": "service_healthy"},
        "minio-init": {"condition": "service_completed_successfully"},
    }
    assert (INFRA / services["mlflow"]["build"]["dockerfile"]).exists()


def test_compose_ports_and_exports_match_raypai_services_defaults():
    """`docker compose up` and `raypai services up` are interchangeable for a client."""
    from raypai.tools.services import ServicesConfig, service_env

    services = _compose()["services"]
    published = {int(p.split(":")[-2]) for s in services.values() for p in s.get("ports", [])}  # IP:HOST:CONTAINER
    defaults = ServicesConfig(home=Path("/unused"))
    assert {defaults.mlflow_port, defaults.s3_port, 5432} <= published
    exports = dict(
        re.findall(
            r"(\w+)=(\S+)",
            "\n".join(
                line for line in (INFRA / "compose.yaml").read_text().splitlines() if line.startswith("#   export")
            ),
        )
    )
    env = service_env(defaults)
    for key in ("MLFLOW_TRACKING_URI", "RAYPAI_ARTIFACT_URI", "AWS_ENDPOINT_URL"):
        assert exports[key] == env[key], key
    assert Settings.load(exports).database_url.startswith("postgresql+psycopg://")


def test_cluster_launcher_config_passes_rays_schema_and_uses_the_image():
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml.safe_load((INFRA / "ray-cluster.yaml").read_text())
    validate_config(prepare_config(dict(config)))  # raises on any schema violation
    assert (
        config["docker"]["image"]
        == _pod_containers(_docs("raycluster.yaml")["RayCluster"]["spec"]["headGroupSpec"]["template"])[0]["image"]
    )
    # every node sources the env file before `ray start`, and the example file holds valid settings
    env_file = next(iter(config["file_mounts"]))
    for cmd in config["head_start_ray_commands"][1:] + config["worker_start_ray_commands"][1:]:
        assert f". {env_file}" in cmd and "ray start" in cmd
    example = dict(
        line.split("=", 1)
        for line in (INFRA / "raypai.env.example").read_text().splitlines()
        if line and not line.startswith("#")
    )
    assert Settings.load(example).artifact_uri.startswith("s3://") and example["RAY_AUTH_MODE"] == "token"


def test_local_cluster_script_parses_and_never_stops_every_ray_on_the_machine(tmp_path):
    script = INFRA / "local-cluster.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    code = [line.split("#", 1)[0] for line in script.read_text().splitlines()]
    assert not any(re.search(r"\bray\b.*\bstop\b|\$RAY\"? stop", line) for line in code), (
        "use the pid files, not ray stop"
    )
    bad = subprocess.run(
        [str(script), "sideways"],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "RAY": str(ROOT / ".venv" / "bin" / "ray"), "RAYPAI_CLUSTER_DIR": str(tmp_path)},
    )
    assert bad.returncode == 2 and "usage:" in bad.stderr
