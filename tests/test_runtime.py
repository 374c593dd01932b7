"""raypai.runtime: free ports for everything raypai starts, recorded under RAYPAI_HOME, found again by
later commands; `make demo-stop` stops raypai's Ray head and nothing else."""

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from raypai import runtime

ROOT = Path(__file__).resolve().parents[1]

PIPELINE = """
from raypai import Artifact, StepContext, pipeline, step
from raypai.serving.steps import deploy, register


@step(cpus=0.5)
def tiny_model(ctx: StepContext, seed: int = 0) -> Artifact:
    from raypai.alignment.tasks.tiny import build_tiny_model

    out = ctx.output_dir("model")
    build_tiny_model(out, hidden=32, layers=1, heads=2, kv_heads=1, seed=seed)
    return ctx.save(out, kind="model", name="tiny")


@pipeline
def ports(seed: int = 0):
    return deploy(register(tiny_model(seed=seed), name="tiny"), name="tiny", cpus=0.5)
"""


@contextlib.contextmanager
def hold(*ports):
    """Listening sockets on `ports`; yields the ports held here. A port another process listens on
    already (Redis on 6379) is left to it."""
    socks = []
    try:
        for port in ports:
            s = socket.socket()
            # as servers do: a port whose last server stopped moments ago (its connections in
            # TIME_WAIT, e.g. another test's Ray dashboard on 8265) can be held again
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
                s.listen()
                socks.append(s)
            except OSError:
                s.close()
            assert not runtime.port_is_free(port), port
        yield {s.getsockname()[1] for s in socks}
    finally:
        for s in socks:
            s.close()


def _env(home: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAYPAI_", "MLFLOW_TRACKING", "RAY_ADDRESS"))}
    env.update(RAYPAI_HOME=str(home), RAYPAI_DASHBOARD="1", COLUMNS="200")
    return env


def test_pick_port_keeps_a_free_default_and_replaces_a_taken_one():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    assert runtime.port_is_free(free) and runtime.pick_port(free) == free
    with hold(free):
        other = runtime.pick_port(free)
        assert other != free and runtime.port_is_free(other)
        assert runtime.pick_port(free, avoid={other}) not in (free, other)
    assert runtime.port_is_free(free)  # released


def _stopped_server_port() -> tuple[int, bool]:
    """(port, whether `port_is_free` said free while its server listened): a loopback server that
    accepted one connection, closed its end first (which then waits in TIME_WAIT) and stopped."""
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    port = srv.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = srv.accept()
    free_while_serving = runtime.port_is_free(port)
    accepted.close()  # the server side closes first: its end waits in TIME_WAIT
    srv.close()
    client.close()
    return port, free_while_serving


def test_a_stopped_servers_time_wait_connections_do_not_hold_its_port():
    """After a server (Ray's GCS) stops, its closed connections linger in TIME_WAIT; a new server
    binds with SO_REUSEADDR regardless, so the port counts as free again."""
    port, free_while_serving = _stopped_server_port()
    assert not free_while_serving
    assert runtime.port_is_free(port)


def test_hold_takes_a_port_whose_stopped_server_left_time_wait_connections():
    """CI failed with `hold(8265)` refused: another test's Ray dashboard had stopped on 8265 moments
    before and its connections waited in TIME_WAIT. A free port (by `port_is_free`) must be holdable."""
    port, _ = _stopped_server_port()
    assert runtime.port_is_free(port)
    with hold(port) as held:
        assert held == {port} and not runtime.port_is_free(port)


def test_a_pinned_port_that_is_taken_is_one_clear_error(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.listen()
        out = subprocess.run(
            [sys.executable, "-m", "raypai.cli", "server", "--port", str(port)],
            cwd=tmp_path,
            env=_env(tmp_path / "home"),
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"deploy API port {port} is in use" in out.stdout and "Traceback" not in out.stdout + out.stderr


def test_stop_without_a_head_stops_nothing(tmp_path):
    from raypai.settings import Settings

    settings = Settings.load({"RAYPAI_HOME": str(tmp_path)})
    assert runtime.load_state(settings).head is None
    assert runtime.stop_head(settings) == []


@pytest.mark.scale  # a demo beside other Rays on taken ports: make test-scale
def test_demo_runs_with_every_default_port_taken_and_demo_stop_spares_other_rays(tmp_path):
    """The demo's start-up path (`raypai ray start`, what `make demo` runs first) with Ray's 6379,
    8265, 10001, Serve's 8000 and the deploy API's 8080 all taken; a pipeline joins that head and
    deploys a tiny model that answers over HTTP on the recorded Serve port; `raypai server` and
    `raypai deploy` find each other; `make demo-stop` stops that head, and a Ray this test started
    itself keeps running."""
    import ray

    from raypai.settings import Settings
    from raypai.store import MetadataStore

    home = tmp_path / "home"
    env = _env(home)
    settings = Settings.load({"RAYPAI_HOME": str(home)})
    (tmp_path / "ports.py").write_text(PIPELINE)

    def raypai(*args, ok=True, timeout=600):
        out = subprocess.run(
            [sys.executable, "-m", "raypai.cli", *args],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert (out.returncode == 0) == ok, out.stdout + out.stderr
        return out

    # another Ray on this machine, started without raypai: demo-stop must leave it alone
    _start_other_ray()
    other_gcs = ray.get_runtime_context().gcs_address
    server = None
    try:
        with hold(6379, 8265, 10001, 8000, 8080) as held:
            # a default some other process held may have been freed meanwhile: check the ones held here
            # (and 6379, which is held here or by this machine's Redis)
            taken = held | {6379}
            started = raypai("ray", "start", "--num-cpus", "6")
            head = runtime.load_state(settings).head
            assert head is not None, started.stdout
            gcs_port = int(head.address.rsplit(":", 1)[1])
            dashboard_port = int(head.dashboard_url.rsplit(":", 1)[1])
            chosen = {gcs_port, dashboard_port, head.client_port, head.serve_port}
            assert len(chosen) == 4 and not chosen & taken, (chosen, taken)
            for shown in (
                head.address,
                head.dashboard_url,
                f"ray://127.0.0.1:{head.client_port}",
                f"http://127.0.0.1:{head.serve_port}/v1",
            ):
                assert shown in started.stdout, started.stdout  # what was chosen is printed
            assert httpx.get(head.dashboard_url, timeout=30).status_code == 200

            assert runtime.start_head(settings) == head  # a second `make demo` reuses the head

            run = raypai("run", str(tmp_path / "ports.py"))
            assert "deploy succeeded" in run.stdout, run.stdout
            assert f"raypai's Ray head at {head.address}" in run.stdout  # the run joined the head
            store = MetadataStore(settings.database_url)
            token = store.create_token("client", ["infer"])
            r = httpx.post(
                f"http://127.0.0.1:{head.serve_port}/v1/chat/completions",
                timeout=120,
                headers={"Authorization": f"Bearer {token}"},
                json={"model": "tiny", "messages": [{"role": "user", "content": "3+4="}], "max_tokens": 3},
            )
            assert r.status_code == 200 and r.headers["x-raypai-model-version"] == "tiny/1", r.text

            # a re-run while the deployment serves that version: every step a cache hit, deploy included
            # (a health check of the deployment instead of a redeploy)
            again = raypai("run", str(tmp_path / "ports.py"))
            for node in ("tiny_model", "register", "deploy"):
                assert f"{node} cached" in again.stdout, again.stdout
            assert "deploy succeeded" not in again.stdout

            # the deploy API: 8080 is taken, so it records the port it took; `raypai deploy` finds it there
            log = open(tmp_path / "server.log", "w")
            server = subprocess.Popen(
                [sys.executable, "-m", "raypai.cli", "server"],
                cwd=tmp_path,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            api = _wait_for(lambda: runtime.load_state(settings).endpoints.get("api"), 120, tmp_path / "server.log")
            assert int(api.url.rsplit(":", 1)[1]) not in taken
            _wait_for(lambda: _healthy(api.url + "/healthz"), 120, tmp_path / "server.log")
            env["RAYPAI_TOKEN"] = store.create_token("ops", ["deploy"])
            listed = raypai("deploy", "list")
            assert '"name": "tiny"' in listed.stdout and '"RUNNING"' in listed.stdout, listed.stdout
            assert f'"endpoint": "http://127.0.0.1:{head.serve_port}/v1"' in listed.stdout  # the server joined the head
            server.terminate()
            server.wait(30)

        head_pids = [p for p in head.pids if runtime._pid_alive(p)]
        assert head_pids
        stop = subprocess.run(
            ["make", "-C", str(ROOT), "demo-stop"], env=env, capture_output=True, text=True, timeout=120
        )
        assert stop.returncode == 0, stop.stdout + stop.stderr
        assert "stopped raypai's Ray head" in stop.stdout
        assert not any(runtime._pid_alive(p) for p in head_pids)
        assert runtime.load_state(settings).head is None and runtime.port_is_free(gcs_port)
        # the other Ray still runs and still answers
        assert ray.get_runtime_context().gcs_address == other_gcs
        assert ray.get(ray.remote(lambda: 41 + 1).remote(), timeout=60) == 42
    finally:
        if server is not None and server.poll() is None:
            server.kill()
        runtime.stop_head(settings)
        ray.shutdown()


def _start_other_ray(attempts: int = 2) -> None:
    """On a loaded machine Ray's own start can time out (its raylet waits 15 s for the dashboard
    agent): that is set-up, not what this test checks, so it gets a second try."""
    import ray

    for attempt in range(attempts):
        try:
            ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
            return
        except Exception:  # noqa: BLE001
            ray.shutdown()
            if attempt == attempts - 1:
                raise


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def _wait_for(check, timeout_s: float, log: Path):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.5)
    pytest.fail(f"timed out; log:\n{log.read_text()[-3000:]}")


def test_runtime_json_is_what_load_state_reads(tmp_path):
    """A recorded head whose processes are gone is not reported as running."""
    from raypai.settings import Settings

    settings = Settings.load({"RAYPAI_HOME": str(tmp_path)})
    runtime.state_path(settings).write_text(
        json.dumps(
            {
                "head": {
                    "address": "127.0.0.1:1",
                    "dashboard_url": None,
                    "client_port": 1,
                    "serve_port": 1,
                    "temp_dir": "/nope",
                    "session_dir": "/nope/session_x",
                    "pids": [os.getpid()],
                    "num_cpus": 1,
                    "auth_mode": "token",
                    "started_at": 0.0,
                },
                "endpoints": {
                    "api": {"url": "http://127.0.0.1:1", "pid": os.getpid()},
                    "mlflow_ui": {"url": "http://127.0.0.1:2", "pid": 2**22 + 1},
                },
            }
        )
    )
    state = runtime.load_state(settings)
    assert state.head is None  # this pid runs pytest, not that head's GCS
    assert list(state.endpoints) == ["api"]  # the UI's pid does not exist


def test_services_move_off_taken_default_ports_unless_pinned(tmp_path):
    from raypai.tools.services import ServicesConfig, with_free_ports

    cfg = ServicesConfig(home=tmp_path)
    with hold(cfg.mlflow_port, cfg.s3_port):
        moved = with_free_ports(cfg)
        assert moved.mlflow_port != 5000 and moved.s3_port != 9000 and moved.mlflow_port != moved.s3_port
        assert runtime.port_is_free(moved.mlflow_port) and runtime.port_is_free(moved.s3_port)
        assert with_free_ports(cfg, pinned={"mlflow_port"}).mlflow_port == 5000  # `up` then names the conflict


def test_ui_takes_a_free_port_when_5000_is_taken_and_records_it(tmp_path):
    import signal

    from raypai.settings import Settings

    settings = Settings.load({"RAYPAI_HOME": str(tmp_path / "home")})
    with hold(5000) as held, open(tmp_path / "ui.log", "w") as log:
        ui = subprocess.Popen(
            [sys.executable, "-m", "raypai.cli", "ui"],
            cwd=tmp_path,
            env=_env(tmp_path / "home"),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            ep = _wait_for(lambda: runtime.load_state(settings).endpoints.get("mlflow_ui"), 120, tmp_path / "ui.log")
            port = int(ep.url.rsplit(":", 1)[1])
            assert port != 5000 or 5000 not in held
            # the recorded process is the MLflow server on that port (its first start migrates a fresh
            # database for a minute on this machine, so the test does not wait for it to answer)
            assert f"--port {port}" in runtime._cmdline(ep.pid) and "mlflow" in runtime._cmdline(ep.pid)
            _wait_for(
                lambda: f"MLflow UI:      {ep.url}" in (tmp_path / "ui.log").read_text(), 30, tmp_path / "ui.log"
            )  # the chosen port is printed
        finally:
            os.killpg(ui.pid, signal.SIGTERM)  # the CLI and the MLflow server it started
            ui.wait(30)


def test_a_local_ray_without_dashboard_does_not_name_another_rays_dashboard(tmp_path):
    """Ray records an API server address even with no dashboard (127.0.0.1:8265 by default), and its
    state API — which Ray Train's placement-group cleaner asks whether the run's controller lives —
    goes there. With another Ray's dashboard on 8265 that answer is "no such actor", and the cleaner
    removed a running pretrain's workers (seen in a fresh-clone `make test`). The address a local
    Ray records must be no other process's: with 8265 held, not 8265 and nothing listening."""
    import ray
    from ray._private import ray_constants
    from ray.experimental.internal_kv import _internal_kv_get

    from raypai.settings import Settings

    settings = Settings.load({"RAYPAI_HOME": str(tmp_path)})
    with hold(runtime.DEFAULT_PORTS["dashboard"]):
        try:
            runtime.ensure_ray(settings, local=True, num_cpus=1, dashboard=False, log_to_driver=False)
            api = _internal_kv_get(
                ray_constants.DASHBOARD_ADDRESS, namespace=ray_constants.KV_NAMESPACE_DASHBOARD
            ).decode()
            port = int(api.rsplit(":", 1)[1])
            assert port != runtime.DEFAULT_PORTS["dashboard"] and runtime.port_is_free(port), api
        finally:
            ray.shutdown()
    # raypai's head without a dashboard (`raypai ray start` with RAYPAI_DASHBOARD=0): with 8265 free
    # now, it must still not record 8265, which another Ray's dashboard may take later
    try:
        runtime.start_head(settings, num_cpus=1, dashboard=False)
        runtime.ensure_ray(settings, log_to_driver=False)  # joins that head
        api = _internal_kv_get(ray_constants.DASHBOARD_ADDRESS, namespace=ray_constants.KV_NAMESPACE_DASHBOARD).decode()
        assert int(api.rsplit(":", 1)[1]) != runtime.DEFAULT_PORTS["dashboard"], api
    finally:
        ray.shutdown()
        runtime.stop_head(settings)


def test_ensure_ray_local_starts_its_own_ray_with_the_options_asked(tmp_path):
    """`local=True` (the benchmarks') ignores RAY_ADDRESS and starts a Ray in this process with the
    CPU count and object store asked for."""
    import ray
    from ray._private.ray_constants import OBJECT_STORE_MINIMUM_MEMORY_BYTES as store_bytes

    from raypai.settings import Settings

    # nothing listens there: joining it would fail, so a local Ray shows RAY_ADDRESS was skipped
    settings = Settings.load({"RAYPAI_HOME": str(tmp_path), "RAY_ADDRESS": f"127.0.0.1:{runtime.pick_port()}"})
    try:
        info = runtime.ensure_ray(
            settings, local=True, num_cpus=3, dashboard=False, log_to_driver=False, object_store_memory=store_bytes
        )
        assert info.kind == "local" and info.dashboard_url is None
        resources = ray.cluster_resources()
        assert resources["CPU"] == 3
        assert resources["object_store_memory"] == store_bytes
    finally:
        ray.shutdown()
