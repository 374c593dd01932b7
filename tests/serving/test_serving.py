"""Serving end to end over real HTTP: deploy API (uvicorn) → Ray Serve router + model servers →
the official `openai` client. One Ray + Serve instance for the module."""

import json
import socket
import threading
import time

import httpx
import pytest
import ray
from ray import serve

from raypai.serving.control import serve_port
from raypai.settings import Settings
from raypai.tracking import Tracker


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# tests/conftest.py gives each test process a Serve port of its own (RAYPAI_SERVE_PORT)
OPENAI = f"http://127.0.0.1:{serve_port()}/v1"


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model_dir):
    import uvicorn

    from raypai.serving.api import create_app
    from raypai.store import MetadataStore

    home = tmp_path_factory.mktemp("serve-home")
    # every interface, as in the cluster manifests: a test below reaches the proxy by this machine's LAN address
    settings = Settings.load({"RAYPAI_HOME": str(home), "RAYPAI_SERVE_HOST": "0.0.0.0"})
    tracker = Tracker(settings.mlflow_tracking_uri, artifact_root=home / "mlartifacts")
    model_dir = tiny_model_dir
    v1 = tracker.register_model(model_dir, "tiny")
    v2 = tracker.register_model(model_dir, "tiny", alias="champion")
    store = MetadataStore(settings.database_url)
    tokens = {"deploy": store.create_token("deployer", ["deploy"]), "infer": store.create_token("client", ["infer"])}
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)

    def start_server():
        port = _free_port()
        server = uvicorn.Server(uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, log_level="warning"))
        t = threading.Thread(target=server.run, daemon=True)
        t.start()
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz").status_code == 200:
                    return server, f"http://127.0.0.1:{port}"
            except httpx.HTTPError:
                time.sleep(0.2)
        raise RuntimeError("deploy API did not start")

    server, api = start_server()
    yield {
        "api": api,
        "tokens": tokens,
        "v1": v1,
        "v2": v2,
        "restart": start_server,
        "tracker": tracker,
        "model_dir": model_dir,
        "server": server,
        "store": store,
        "settings": settings,
    }
    server.should_exit = True
    serve.shutdown()
    ray.shutdown()


def _api(stack, method, path, body=None, token="deploy"):
    return httpx.request(
        method,
        stack["api"] + path,
        json=body,
        timeout=300,
        headers={"Authorization": f"Bearer {stack['tokens'][token]}"},
    )


def test_serve_refuses_a_port_another_server_already_listens_on(stack):
    """Serve's proxy binds with SO_REUSEPORT, so on a port another server (another Ray's Serve) holds
    the same way, both would listen and the kernel would split requests between them: a client would
    reach the other endpoint (its tokens, its models) at random. Starting Serve refuses that port.
    First in this module: the deploy API has started Serve (with no deployments yet); it is stopped
    here, and started again at the end."""
    from raypai.errors import DeployError
    from raypai.serving.control import Controller

    serve.shutdown()
    with pytest.raises(ValueError):  # precondition: Serve has not started in this Ray yet
        ray.get_actor("SERVE_CONTROLLER_ACTOR", namespace="serve")
    with socket.socket() as other:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        other.bind(("0.0.0.0", 0))
        other.listen()
        port = other.getsockname()[1]
        ctl = Controller(stack["settings"].replace(serve_port=port), store=stack["store"], tracker=stack["tracker"])
        with pytest.raises(DeployError) as err:
            ctl.start()
    text = str(err.value)
    assert f"Serve port {port} is already in use" in text and "RAYPAI_SERVE_PORT" in text, text
    with pytest.raises(ValueError):  # nothing half-started: no Serve controller was created
        ray.get_actor("SERVE_CONTROLLER_ACTOR", namespace="serve")
    Controller(stack["settings"], store=stack["store"], tracker=stack["tracker"]).start()  # as the module had it


def test_deploy_query_canary_rollback_delete(stack):
    import openai

    r = _api(stack, "POST", "/api/v1/deployments", {"name": "chat", "model": "tiny", "version": stack["v1"]})
    assert r.status_code == 201, r.text
    assert r.json()["live"] == {str(stack["v1"]): "RUNNING"}
    client = openai.OpenAI(base_url=OPENAI, api_key=stack["tokens"]["infer"])
    assert [m.id for m in client.models.list().data] == ["chat"]
    chat = client.chat.completions.create(model="chat", messages=[{"role": "user", "content": "1+2="}], max_tokens=5)
    assert chat.choices[0].finish_reason in ("stop", "length") and chat.usage.completion_tokens <= 5
    assert chat.system_fingerprint == f"tiny/{stack['v1']}"
    comp = client.completions.create(model="chat", prompt="the quick", max_tokens=4, temperature=0)
    assert comp.usage.prompt_tokens > 0 and comp.usage.completion_tokens <= 4
    raw = client.completions.with_raw_response.create(model="chat", prompt="the", max_tokens=2)
    assert raw.headers["x-raypai-model-version"] == f"tiny/{stack['v1']}"
    chunks = list(
        client.chat.completions.create(
            model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=6, stream=True, temperature=0
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices[0].finish_reason in ("stop", "length")
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    same = client.chat.completions.create(
        model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0
    )
    assert streamed == same.choices[0].message.content  # streaming and batching agree (greedy)

    # the manual rollback is under test here: the router's own rollback of a `worse` canary
    # (test_a_failing_canary_is_refused_promotion_and_rolled_back_by_itself) is turned off, or a slow
    # moment on a loaded machine can judge the canary's latency worse and remove it first (CI, 11-28)
    r = _api(
        stack,
        "PATCH",
        "/api/v1/deployments/chat",
        {"canary_version": stack["v2"], "canary_percent": 50, "canary_policy": {"auto_rollback": False}},
    )
    assert r.status_code == 200, r.text
    assert r.json()["spec"]["canary_percent"] == 50 and r.json()["spec"]["canary_version"] == stack["v2"]
    time.sleep(1.5)  # the router refreshes its table every second
    served = [
        client.completions.with_raw_response.create(model="chat", prompt="a", max_tokens=1).headers[
            "x-raypai-model-version"
        ]
        for _ in range(40)
    ]
    assert set(served) == {f"tiny/{stack['v1']}", f"tiny/{stack['v2']}"}
    assert 8 <= served.count(f"tiny/{stack['v2']}") <= 32

    r = _api(stack, "POST", "/api/v1/deployments/chat/rollback")
    assert r.status_code == 200 and r.json()["spec"]["canary_version"] is None
    time.sleep(1.5)
    assert {
        client.completions.with_raw_response.create(model="chat", prompt="a", max_tokens=1).headers[
            "x-raypai-model-version"
        ]
        for _ in range(8)
    } == {f"tiny/{stack['v1']}"}
    assert _api(stack, "DELETE", "/api/v1/deployments/chat").status_code == 204
    assert _api(stack, "GET", "/api/v1/deployments/chat").status_code == 404


def _lan_address() -> str:
    """This machine's address on its default route (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.254", 9))
        return s.getsockname()[0]


def test_the_serve_proxy_binds_the_configured_host(stack):
    """RAYPAI_SERVE_HOST=0.0.0.0 (the cluster manifests' value): the proxy answers on the machine's
    LAN address, as a Kubernetes Service or load balancer reaches it, not only on loopback."""
    lan = _lan_address()
    assert not lan.startswith("127."), f"no non-loopback address on this machine ({lan}) to test with"
    h = {"Authorization": f"Bearer {stack['tokens']['infer']}"}
    assert httpx.get(f"http://{lan}:{serve_port()}/v1/models", headers=h, timeout=30).status_code == 200


def test_auth_and_registry_only(stack):
    body = {"name": "x", "model": "tiny", "version": stack["v1"]}
    assert httpx.post(stack["api"] + "/api/v1/deployments", json=body).status_code == 401
    r = httpx.post(stack["api"] + "/api/v1/deployments", json=body, headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_token"
    r = _api(stack, "POST", "/api/v1/deployments", body, token="infer")
    assert r.status_code == 403 and "deploy" in r.json()["error"]["message"]
    for model in ("/etc/passwd", "../models/x", "s3://bucket/evil.pkl", "http://evil/model"):
        r = _api(stack, "POST", "/api/v1/deployments", {**body, "model": model})
        assert r.status_code == 400 and "registry" in r.text, model
    r = _api(stack, "POST", "/api/v1/deployments", {**body, "model": "never-registered"})
    assert r.status_code == 400 and "Only models registered" in r.json()["error"]["message"]
    r = httpx.get(OPENAI + "/models", headers={"Authorization": f"Bearer {stack['tokens']['deploy']}"})
    assert r.status_code == 403
    temp = stack["store"].create_token("short-lived", ["deploy"])
    assert (
        httpx.get(stack["api"] + "/api/v1/deployments", headers={"Authorization": f"Bearer {temp}"}).status_code == 200
    )
    stack["store"].revoke_token("short-lived")
    assert (
        httpx.get(stack["api"] + "/api/v1/deployments", headers={"Authorization": f"Bearer {temp}"}).status_code == 401
    )


def test_bad_requests_get_openai_errors_never_500(stack):
    # "val" (the registry's champion alias) also serves the restart and replica-kill tests below.
    r = _api(stack, "POST", "/api/v1/deployments", {"name": "val", "model": "tiny", "alias": "champion"})
    assert r.status_code == 201 and r.json()["spec"]["version"] == stack["v2"], r.text
    h = {"Authorization": f"Bearer {stack['tokens']['infer']}"}
    cases = [
        (b"{not json", 400),
        (json.dumps({"model": "nope", "prompt": "x"}).encode(), 404),
        (json.dumps({"model": "val", "prompt": "x", "max_tokens": -1}).encode(), 400),
        (json.dumps({"model": "val", "prompt": "x", "max_tokens": 10**9}).encode(), 400),
        (json.dumps({"model": "val", "prompt": "word " * 500, "max_tokens": 8}).encode(), 400),
        (json.dumps({"model": "val", "prompt": 12, "max_tokens": "many"}).encode(), 400),
        (json.dumps({"model": "val", "prompt": "x", "temperature": 9}).encode(), 400),
    ]
    for body, status in cases:
        r = httpx.post(OPENAI + "/completions", content=body, headers={**h, "content-type": "application/json"})
        assert r.status_code == status, (body[:60], r.status_code, r.text)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.post(OPENAI + "/completions", json={"model": "val", "prompt": "word " * 500, "max_tokens": 8}, headers=h)
    assert r.json()["error"]["code"] == "context_length_exceeded"
    long_chat = {"model": "val", "messages": [{"role": "user", "content": "word " * 500}], "stream": True}
    r = httpx.post(OPENAI + "/chat/completions", json=long_chat, headers=h)  # refused before the stream starts
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    r = _api(stack, "POST", "/api/v1/deployments", {"name": "val", "model": "tiny", "version": stack["v1"]})
    assert r.status_code == 409 and r.json()["error"]["code"] == "conflict"
    r = _api(
        stack,
        "POST",
        "/api/v1/deployments",
        {
            "name": "auto",
            "model": "tiny",
            "version": stack["v1"],
            "autoscaling": {"min_replicas": 3, "max_replicas": 1},
        },
    )
    assert r.status_code == 400 and "min_replicas" in r.json()["error"]["message"]


def test_cli_mirrors_the_api(stack):
    """`raypai token …` writes the store; `raypai deploy …` talks HTTP to the deploy API."""
    from typer.testing import CliRunner

    from raypai.serving.cli import deploy_app, token_app

    cli = CliRunner()
    made = cli.invoke(
        token_app,
        ["create", "cli-user", "--scope", "infer", "--scope", "deploy"],
        env={"RAYPAI_HOME": str(stack["settings"].home)},
    )
    assert made.exit_code == 0, made.output
    token = made.stdout.strip().splitlines()[0]
    assert httpx.get(OPENAI + "/models", headers={"Authorization": f"Bearer {token}"}).status_code == 200
    env = {"RAYPAI_API_URL": stack["api"], "RAYPAI_TOKEN": token}
    listed = cli.invoke(deploy_app, ["list"], env=env)
    assert listed.exit_code == 0 and '"val"' in listed.stdout, listed.output
    missing = cli.invoke(deploy_app, ["get", "nope"], env=env)
    assert missing.exit_code == 1 and "error 404" in missing.output
    bad = cli.invoke(token_app, ["create", "x", "--scope", "admin"], env={"RAYPAI_HOME": str(stack["settings"].home)})
    assert bad.exit_code == 2 and "unknown scope" in bad.output


def test_schemathesis_finds_no_5xx_in_either_api(stack):
    """Property-based requests generated from both OpenAPI schemas, valid (positive) and invalid
    (negative); half of the router's bodies name the live deployment so generation runs too."""
    import schemathesis
    from hypothesis import HealthCheck, Phase, given
    from hypothesis import settings as hsettings
    from hypothesis import strategies as st

    checked = {}
    for base, token in ((f"http://127.0.0.1:{serve_port()}", "infer"), (stack["api"], "deploy")):
        schema = schemathesis.openapi.from_url(base + "/openapi.json")
        headers = {"Authorization": f"Bearer {stack['tokens'][token]}"}
        for result in schema.get_all_operations():
            op = result.ok()
            # Invalid (negative) cases for JSON bodies; a string path parameter has no invalid value.
            has_body = op.body is not None and len(op.body) > 0
            for mode in schemathesis.GenerationMode if has_body else [schemathesis.GenerationMode.POSITIVE]:

                @hsettings(
                    max_examples=25,
                    deadline=None,
                    phases=[Phase.generate],
                    database=None,
                    suppress_health_check=list(HealthCheck),
                )
                @given(case=op.as_strategy(generation_mode=mode), live=st.booleans())
                def fuzz(case, live):
                    if live and isinstance(case.body, dict) and "model" in case.body and "/v1/" in op.path:
                        case.body["model"] = "val"
                    r = case.call(base_url=base, headers=headers, timeout=60)
                    assert r.status_code < 500, (op.label, r.status_code, r.text[-600:], case.body)
                    checked[op.label] = checked.get(op.label, 0) + 1

                fuzz()
    assert {"POST /v1/completions", "POST /v1/chat/completions", "PATCH /api/v1/deployments/{name}"} <= set(checked)


def test_restarted_deploy_server_reconciles_from_the_store(stack):
    serve.delete(f"raypai-val-v{stack['v2']}")  # Serve "loses" the application
    assert f"raypai-val-v{stack['v2']}" not in serve.status().applications
    stack["server"].should_exit = True
    stack["server"], stack["api"] = stack["restart"]()  # a new server process does the same on start
    app = serve.status().applications[f"raypai-val-v{stack['v2']}"]
    assert app.status.value == "RUNNING"
    assert _api(stack, "GET", "/api/v1/deployments/val").json()["live"] == {str(stack["v2"]): "RUNNING"}
    r = httpx.post(
        OPENAI + "/completions",
        json={"model": "val", "prompt": "the", "max_tokens": 2},
        headers={"Authorization": f"Bearer {stack['tokens']['infer']}"},
    )
    assert r.status_code == 200 and r.headers["x-raypai-model-version"] == f"tiny/{stack['v2']}"


def test_killed_replica_under_load_is_replaced_with_a_brief_error_spike(stack):
    """Scale to 2 replicas, load with 4 client threads, kill one replica: the router retries a request
    that died with its replica, Serve starts a replacement; measure errors and the latency spike."""
    r = _api(stack, "PATCH", "/api/v1/deployments/val", {"replicas": 2})
    assert r.status_code == 200 and r.json()["spec"]["replicas"] == 2, r.text
    app = f"raypai-val-v{stack['v2']}"

    def replicas():
        return sorted(
            a["name"]
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(f"SERVE_REPLICA::{app}#")
        )

    before = replicas()
    assert len(before) == 2, before
    h = {"Authorization": f"Bearer {stack['tokens']['infer']}"}
    log, stop = [], threading.Event()

    def client():
        with httpx.Client(timeout=60) as c:
            while not stop.is_set():
                t0 = time.time()
                try:
                    code = c.post(
                        OPENAI + "/completions",
                        headers=h,
                        json={"model": "val", "prompt": "the quick", "max_tokens": 8},
                    ).status_code
                except httpx.HTTPError:
                    code = 0
                log.append((t0, time.time() - t0, code))

    threads = [threading.Thread(target=client) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(3)
    killed_at = time.time()
    ray.kill(ray.get_actor(before[0], namespace="serve"), no_restart=True)
    deadline = time.time() + 90
    while time.time() < deadline and (before[0] in replicas() or len(replicas()) < 2):
        time.sleep(0.5)
    replaced_at = time.time()
    time.sleep(2)
    stop.set()
    for t in threads:
        t.join()
    after = replicas()
    assert len(after) == 2 and before[0] not in after, after  # Serve replaced the dead replica
    errors = [(t, code) for t, _, code in log if code != 200]
    during = [lat for t, lat, _ in log if killed_at <= t <= replaced_at]
    steady = sorted(lat for t, lat, _ in log if t < killed_at)
    print(
        json.dumps(
            {
                "requests": len(log),
                "errors": len(errors),
                "error_codes": sorted({c for _, c in errors}),
                "error_window_s": round(max(t for t, _ in errors) - min(t for t, _ in errors), 2) if errors else 0,
                "replacement_s": round(replaced_at - killed_at, 1),
                "steady_p50_s": round(steady[len(steady) // 2], 3),
                "max_latency_during_s": round(max(during), 3) if during else None,
            }
        )
    )
    assert len(log) > 40 and len(errors) <= 0.05 * len(log), errors  # at most a brief spike
    assert all(code in (0, 503) for _, code in errors)  # never a 500: a dead replica is "retry later"
    assert all(code == 200 for t, _, code in log if t > replaced_at)  # and none once replaced


def test_a_short_request_does_not_wait_for_a_long_batch_mate(stack):
    """No head-of-line blocking, through a Serve replica: two requests sent together (prefilled in
    one batch, or the second joining the running batch); the one that needs one token returns while
    the other still decodes. Measured on the replica's own clock, its decode-step counter, which each
    result carries (`finished_at_step`): the short request finished while most of the long one's
    decode steps were still to come (a list-in/list-out batch handler would finish both together).
    The replica's clock, not the caller's: the caller's view adds its own round-trip latency, during
    which the long request keeps decoding (on a slow machine that took up to 19 of its steps)."""
    import asyncio

    from raypai.serving.generation import GenRequest
    from raypai.serving.router import app_name

    r = _api(
        stack,
        "POST",
        "/api/v1/deployments",
        {"name": "hol", "model": "tiny", "version": stack["v1"], "batch_wait_timeout_s": 0.3},
    )
    assert r.status_code == 201, r.text
    handle = serve.get_app_handle(app_name("hol", stack["v1"]))

    async def race():
        long_req = None
        for seed in range(40):  # a seeded sample that runs (almost) to max_tokens without an end token
            req = GenRequest([], max_tokens=48, temperature=1.0, seed=seed)
            if (await handle.generate.remote(req, prompt="the quick")).completion_tokens >= 40:
                long_req = req
                break
        assert long_req is not None, "no seed in 0..39 gives a long completion from the tiny model"
        long_call = handle.generate.remote(long_req, prompt="the quick")
        short = await handle.generate.remote(GenRequest([], max_tokens=1, temperature=0), prompt="the quick")
        return short, await long_call

    try:
        short, long = asyncio.run(race())
    finally:
        assert _api(stack, "DELETE", "/api/v1/deployments/hol").status_code == 204
    assert short.completion_tokens == 1 and long.completion_tokens >= 40
    steps_after_short = long.finished_at_step - short.finished_at_step
    assert steps_after_short >= 30, (
        f"the short request finished only {steps_after_short} decode steps before its long batch-mate: it waited for it"
    )


def _broken_copy(model_dir, out):
    """The tiny model's tokenizer over a model whose vocabulary is 5 tokens: it loads and deploys,
    and every generation fails (token ids past the embedding table)."""
    import shutil

    from transformers import AutoConfig, LlamaForCausalLM

    shutil.copytree(model_dir, out)
    config = AutoConfig.from_pretrained(out)
    config.vocab_size, config.pad_token_id, config.eos_token_id, config.bos_token_id = 5, 0, 1, None
    LlamaForCausalLM(config).save_pretrained(out)
    return out


def test_a_failing_canary_is_refused_promotion_and_rolled_back_by_itself(stack, tmp_path):
    h = {"Authorization": f"Bearer {stack['tokens']['infer']}"}
    v3 = stack["tracker"].register_model(_broken_copy(stack["model_dir"], tmp_path / "broken"), "tiny")
    assert (
        _api(
            stack, "POST", "/api/v1/deployments", {"name": "guarded", "model": "tiny", "version": stack["v1"]}
        ).status_code
        == 201
    )
    r = _api(
        stack,
        "PATCH",
        "/api/v1/deployments/guarded",
        {"canary_version": v3, "canary_percent": 50, "canary_policy": {"min_requests": 5, "auto_rollback": False}},
    )
    assert r.status_code == 200, r.text
    r = _api(stack, "PATCH", "/api/v1/deployments/guarded", {"promote": True})  # nothing measured yet
    assert r.status_code == 409 and "no traffic measured yet" in r.json()["error"]["message"], r.text
    time.sleep(1.5)  # the router refreshes its table every second

    def query() -> httpx.Response:
        return httpx.post(
            OPENAI + "/completions", json={"model": "guarded", "prompt": "a", "max_tokens": 1}, headers=h, timeout=60
        )

    def described() -> dict:
        got = _api(stack, "GET", "/api/v1/deployments/guarded")
        assert got.status_code == 200, got.text
        return got.json()

    answers = [query() for _ in range(30)]
    assert {a.status_code for a in answers} == {200, 500}, [a.status_code for a in answers]
    assert all(
        a.headers.get("x-raypai-model-version") == f"tiny/{stack['v1']}" for a in answers if a.status_code == 200
    )
    deadline = time.time() + 30
    while (check := described()["canary_check"])["decision"] != "worse" and time.time() < deadline:
        query()  # the router judges after answering, at most once a second
        time.sleep(0.5)
    assert check["decision"] == "worse" and "error rate" in check["reason"], check
    assert (
        check["stats"]["canary"]["errors"] >= 5
        and check["stats"]["stable"]["errors"] == 0
        and check["action"] == "none"
    )

    r = _api(stack, "PATCH", "/api/v1/deployments/guarded", {"promote": True})
    assert r.status_code == 409 and "refused" in r.json()["error"]["message"] and "error rate" in r.text, r.text
    assert described()["spec"]["version"] == stack["v1"]  # nothing changed

    r = _api(stack, "PATCH", "/api/v1/deployments/guarded", {"canary_policy": {"min_requests": 5}})  # auto rollback on
    assert r.status_code == 200 and r.json()["spec"]["canary_policy"]["auto_rollback"] is True, r.text
    time.sleep(1.5)
    deadline = time.time() + 30
    while (state := described())["spec"]["canary_version"] is not None and time.time() < deadline:
        query()
        time.sleep(0.5)
    assert state["spec"]["canary_version"] is None and state["spec"]["version"] == stack["v1"], state
    assert any("rolled back automatically" in e and "error rate" in e for e in state["events"]), state["events"]
    rows = stack["store"].latest_canary_check("guarded", v3)
    assert rows["action"] == "rolled_back" and rows["decision"] == "worse"
    time.sleep(1.5)
    after = [query() for _ in range(10)]
    assert all(a.status_code == 200 and a.headers["x-raypai-model-version"] == f"tiny/{stack['v1']}" for a in after)
    r = _api(stack, "POST", "/api/v1/deployments/guarded/rollback")  # the next control action collects v3's app
    assert r.status_code == 400 and "neither a canary nor a previous version" in r.text, r.text
    assert f"raypai-guarded-v{v3}" not in serve.status().applications
    assert _api(stack, "DELETE", "/api/v1/deployments/guarded").status_code == 204
