"""A 2-node Ray cluster on this machine (infra/local-cluster.sh, token auth on), a job submitted
through the Ray Jobs API with raypai shipped as a wheel, tasks on both nodes, then both nodes
stopped; and `raypai submit` of a pipeline file there."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest

from raypai.errors import PipelineError
from raypai.tools.cluster import build_wheel, submit

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "infra" / "local-cluster.sh"

JOB = """
import json, ray
import raypai, raypai.data, raypai.serving

@ray.remote(num_cpus=1)
def where():
    import raypai, raypai.data
    return {"node": ray.get_runtime_context().get_node_id(), "raypai": raypai.__file__, "data": raypai.data.__file__}

ray.init()
refs = [where.remote() for _ in range(2)] + [where.options(resources={"worker_node": 1}).remote() for _ in range(2)]
print("RESULT " + json.dumps({"driver": raypai.__file__, "serving": raypai.serving.__file__, "tasks": ray.get(refs)}))
"""


@pytest.fixture(scope="module")
def cluster(free_port):
    """(dashboard address, env with the token path) of a fresh 2-node cluster; both nodes stopped after."""
    # a short folder: Ray's socket paths under it must stay within AF_UNIX's 107 bytes
    state = Path(tempfile.mkdtemp(prefix="rpc-", dir="/tmp"))
    env = {
        **os.environ,
        "RAY": str(Path(sys.executable).parent / "ray"),
        "RAYPAI_CLUSTER_DIR": str(state),
        "RAYPAI_CLUSTER_PORT": str(free_port()),
        "RAYPAI_DASHBOARD_PORT": str(free_port()),
        "RAYPAI_CLIENT_PORT": str(free_port()),
        "RAYPAI_AGENT_PORT": str(free_port()),
    }
    up = subprocess.run([str(SCRIPT), "up"], env=env, capture_output=True, text=True, timeout=240)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        pids = [int((state / f"{n}.pid").read_text()) for n in ("head", "worker")]
        yield {
            "address": f"http://127.0.0.1:{env['RAYPAI_DASHBOARD_PORT']}",
            "token": state / "auth_token",
            "pids": pids,
            "env": env,
        }
    finally:
        down = subprocess.run([str(SCRIPT), "down"], env=env, capture_output=True, text=True, timeout=120)
        assert down.returncode == 0, down.stderr
    # nothing of either node survives: no process still runs from this cluster's temp dirs
    left = [p.pid for p in psutil.process_iter(["cmdline"]) if str(state) in " ".join(p.info["cmdline"] or [])]
    assert not left, f"processes left by the local cluster: {left}"
    shutil.rmtree(state, ignore_errors=True)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    return build_wheel(out_dir=tmp_path_factory.mktemp("wheels"))


def test_job_with_the_wheel_runs_tasks_on_both_nodes(cluster, wheel, tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(cluster["token"]))
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    (job_dir / "where.py").write_text(JOB)
    job = submit("python where.py", cluster["address"], wheel=wheel, working_dir=job_dir, timeout_s=240)
    assert job.status == "SUCCEEDED", job.logs[-3000:]
    result = json.loads(next(line for line in job.logs.splitlines() if line.startswith("RESULT "))[len("RESULT ") :])
    tasks = result["tasks"]
    assert len({t["node"] for t in tasks}) == 2  # head and worker node both ran tasks
    # every process imported raypai, mapped subpackages included, from the shipped wheel package,
    # not from this checkout (the venv's editable install would point into ROOT/platform)
    for path in [result["driver"], result["serving"]] + [t[k] for t in tasks for k in ("raypai", "data")]:
        assert "runtime_resources/py_modules_files/" in path and not path.startswith(str(ROOT)), path


def test_jobs_api_refuses_a_client_without_the_token(cluster, wheel, tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.ray/auth_token either
    with pytest.raises(PipelineError, match="RAY_AUTH_TOKEN"):
        submit("python -c 'print(1)'", cluster["address"], wheel=wheel)


def test_raypai_submit_ships_the_pipeline_file_and_reports_the_jobs_outcome(cluster, wheel, tmp_path, monkeypatch):
    """`raypai submit FILE`: the file travels alone, `raypai run` executes it on the cluster with the
    shipped raypai, and the job's failure comes back as the exit code. A bad parameter makes the job
    fail fast, which keeps this test cheap; the full toy run on this cluster is a manual check
    (infra/README.md)."""
    import typer
    from typer.testing import CliRunner

    from raypai.tools.cluster import submit_command

    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(cluster["token"]))
    monkeypatch.setenv("RAYPAI_HOME", str(tmp_path / "home"))
    for var in ("RAYPAI_DATABASE_URL", "MLFLOW_TRACKING_URI", "RAYPAI_ARTIFACT_URI", "RAY_ADDRESS", "RAYPAI_CONFIG"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(ROOT)
    app = typer.Typer()
    app.command()(submit_command)  # mounted as `raypai submit` by raypai.cli
    app.command("unused")(lambda: None)  # two commands: typer keeps `submit` as a subcommand name
    result = CliRunner().invoke(
        app,
        [
            "submit-command",
            "pipelines/toy.py",
            "--address",
            cluster["address"],
            "--wheel",
            str(wheel),
            "--param",
            "no_such_param=1",
        ],
    )
    out = result.stdout + result.stderr
    assert result.exit_code == 1, out[-3000:]
    assert "python -m raypai.cli run toy.py --param=no_such_param=1" in out  # the file, alone
    assert "pipeline 'toy': unknown parameter 'no_such_param'" in out  # raised on the cluster
    assert "FAILED" in out
