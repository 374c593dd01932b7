"""The router's limits over real HTTP (raypai.serving.limits): token and size refused from the
headers before the body is read, each field limit answered with its status and its name, the
concurrency per key, and valid requests still answered. Then serving under load and faults (issue #38
items 2-4): a client that disconnects frees its engine row within a second; a full queue answers 503 +
Retry-After and recovers; a failing request fails alone; a metadata-database outage (fault-injected, on
SQLite) leaves known tokens and models answered and is caught up after; a revoked token stops within
the token cache's lifetime.

One Ray + Serve + deployment for the module (starting them is nearly all of its time), serving
conftest.py's `slow_model_dir`: a 2000-token request keeps its engine row for seconds, and a prompt of
the tokenizer's last id fails its forward pass."""

import asyncio
import json
import os
import socket
import threading
import time

import httpx
import psutil
import pytest
import ray
from ray import serve

from raypai.serving.control import Controller, serve_port
from raypai.serving.limits import Limits
from raypai.serving.router import FAULTS_ENV, Freshness, app_name
from raypai.settings import Settings
from raypai.tracking import Tracker

BASE = f"http://127.0.0.1:{serve_port()}"
LIMITS = Limits(max_concurrent_per_key=2)  # the others at their defaults
HUGE = 200 * 2**20  # the attack: a 200 MB body
PROXY_HOOK = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
METRICS_EVERY = "RAY_metrics_report_interval_ms"
TTL_S = 2.0  # the router's token cache lifetime in this module (default 60 s)
FRESHNESS = Freshness(token_ttl_s=TTL_S, routes_refresh_s=0.5, max_backoff_s=1.0)
ONGOING, QUEUED = 2, 2  # requests per replica, and waiting at the router (the deployment spec's)
TIMEOUT_S = 5.0  # the deployment's request_timeout_s: LONG needs ~10 s, the other tests hold it < 3 s
LONG = {"prompt": "the quick", "max_tokens": 2000, "temperature": 0}  # seconds of decoding
BAD_PROMPT = "16"  # the tokenizer's last id, past the model's embedding (conftest.py: slow_model_dir)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, slow_model_dir):
    """(Named `stack` as test_serving.py's, so tests/conftest.py marks its users integration.)"""
    from raypai.store import MetadataStore

    home = tmp_path_factory.mktemp("limits-home")
    settings = Settings.load({"RAYPAI_HOME": str(home)})
    tracker = Tracker(settings.mlflow_tracking_uri, artifact_root=home / "mlartifacts")
    version = tracker.register_model(slow_model_dir, "tiny")
    store = MetadataStore(settings.database_url)
    tokens = {"infer": store.create_token("client", ["infer"]), "other": store.create_token("other", ["infer"])}
    # one token per held request below (the per-key limit is 2), and two whose story a test follows
    tokens |= {who: store.create_token(who, ["infer"]) for who in ("held0", "held1", "held2", "held3")}
    tokens |= {who: store.create_token(who, ["infer"]) for who in ("known", "revoked")}
    outage = home / "database-down"  # while this file exists, the router's database fails
    # Serve's proxy takes its callback from its node's environment, which a local Ray takes from here;
    # so do the replicas their fault injection
    os.environ[PROXY_HOOK] = "raypai.serving.limits.proxy_middlewares"
    os.environ[FAULTS_ENV] = json.dumps({"down_while_exists": str(outage)})
    os.environ[METRICS_EVERY] = "1000"  # Ray's metrics reported each second (default 10 s): the metrics test
    try:
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    finally:
        del os.environ[PROXY_HOOK], os.environ[FAULTS_ENV], os.environ[METRICS_EVERY]
    ctl = Controller(settings, store=store, tracker=tracker, limits=LIMITS, freshness=FRESHNESS)
    ctl.create(
        "lim",
        "tiny",
        version,
        max_ongoing_requests=ONGOING,
        max_queued_requests=QUEUED,
        request_timeout_s=TIMEOUT_S,
        max_batch_size=4,
    )
    yield {"tokens": tokens, "store": store, "outage": outage, "app": app_name("lim", version), "ctl": ctl}
    serve.shutdown()
    ray.shutdown()


def _auth(stack, who="infer") -> dict:
    return {"Authorization": f"Bearer {stack['tokens'][who]}"}


def _process(part: str) -> psutil.Process:
    """This test process's Ray worker whose title names `part` ("raypai-router": the router replica;
    "ProxyActor"): a descendant of this process (its raylet's child), not another test process's."""
    mine = psutil.Process().children(recursive=True)
    found = [p for p in mine if part in " ".join(p.cmdline())]
    assert len(found) == 1, (part, [p.info["cmdline"] for p in found])
    return found[0]


def _head(path: str, headers: dict) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _status(response: bytes) -> tuple[int, dict]:
    head, _, body = response.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body[: body.rfind(b"}") + 1] or b"{}")


def _declared_only(path: str, headers: dict, timeout: float = 20) -> tuple[int, dict]:
    """Send the headers only (the body they declare never comes): an answer proves the server decided
    from the headers; a server waiting for the body would time out here."""
    with socket.create_connection(("127.0.0.1", serve_port()), timeout=timeout) as s:
        s.sendall(_head(path, headers))
        data = b""
        while chunk := s.recv(65536):
            data += chunk
            if b"\r\n\r\n" in data and data.rstrip().endswith(b"}"):
                break
    return _status(data)


def _upload(path: str, headers: dict, total: int, chunked: bool = False) -> tuple[int, dict, int]:
    """POST `total` bytes as fast as the socket takes them while reading the answer; returns the status,
    the error body and how many body bytes the server accepted before it answered and closed.
    `chunked`: no Content-Length, the body in 1 MiB chunks (Transfer-Encoding: chunked)."""
    sent, answer = 0, b""
    with socket.create_connection(("127.0.0.1", serve_port()), timeout=30) as s:
        s.sendall(_head(path, {**headers, "Transfer-Encoding": "chunked"} if chunked else headers))
        chunk = b"x" * 2**20
        if chunked:
            chunk = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
        s.settimeout(0.05)
        while sent < total:
            try:
                sent += s.send(chunk[: min(len(chunk), total - sent)])
            except TimeoutError:
                pass
            except OSError:  # reset: the server answered and closed
                break
            try:
                if got := s.recv(65536):
                    answer += got
                    break
            except TimeoutError:
                pass
        s.settimeout(10)
        try:
            while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
                if not (got := s.recv(65536)):
                    break
                answer += got
        except OSError:
            pass
    return (*_status(answer), sent)


class PeakRSS:
    """Peak resident memory of some processes, sampled every 10 ms in a thread while the block runs."""

    def __init__(self, procs: dict[str, psutil.Process]):
        self.procs, self.peak, self.stop = procs, {}, threading.Event()

    def __enter__(self):
        self.before = {k: p.memory_info().rss for k, p in self.procs.items()}
        self.peak = dict(self.before)
        self.thread = threading.Thread(target=self._sample)
        self.thread.start()
        return self

    def _sample(self):
        while not self.stop.is_set():
            for k, p in self.procs.items():
                self.peak[k] = max(self.peak[k], p.memory_info().rss)
            time.sleep(0.01)

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()

    def growth_mb(self) -> dict[str, float]:
        return {k: round((self.peak[k] - self.before[k]) / 2**20, 1) for k in self.procs}


def test_an_oversized_body_is_refused_from_its_headers_before_it_is_read(stack):
    chat = "/v1/chat/completions"
    # the declared body never comes: each answer was decided from the headers alone
    status, body = _declared_only(chat, {"Content-Length": HUGE})
    assert status == 401 and body["error"]["code"] == "missing_token", body
    status, body = _declared_only(chat, {"Content-Length": HUGE, "Authorization": "Bearer nope"})
    assert status == 413 and "4194304 bytes (RAYPAI_SERVE_MAX_BODY_BYTES)" in body["error"]["message"], body
    status, body = _declared_only(chat, {"Content-Length": HUGE, **_auth(stack)})
    assert status == 413 and body["error"]["code"] == "request_too_large", body
    status, body = _declared_only(chat, {"Content-Length": 40, "Authorization": "Bearer nope"})
    assert status == 401 and body["error"]["code"] == "invalid_token", body

    # the attack, sent for real: 200 MB without a token, as fast as loopback takes it
    procs = {"router": _process("raypai-router"), "proxy": _process("ProxyActor")}
    _upload(chat, {"Content-Length": 2**20}, 2**20)  # warm both paths up
    with PeakRSS(procs) as rss:
        status, body, sent = _upload(chat, {"Content-Length": HUGE}, HUGE)
    growth = rss.growth_mb()
    print(json.dumps({"unauthenticated_200MB": {"status": status, "accepted_mb": round(sent / 2**20, 1), **growth}}))
    assert status == 401, body
    assert sent < HUGE // 4, f"the server read {sent} bytes of a body it refused"
    assert growth["router"] <= 8 and growth["proxy"] <= 8, growth


def test_a_chunked_body_is_counted_and_refused_past_the_cap(stack):
    """No Content-Length to refuse from: the router counts the bytes as it reads them."""
    procs = {"router": _process("raypai-router"), "proxy": _process("ProxyActor")}
    with PeakRSS(procs) as rss:  # 64 MiB, 16 times the cap
        status, body, sent = _upload("/v1/completions", _auth(stack), 64 * 2**20, chunked=True)
    growth = rss.growth_mb()
    print(json.dumps({"chunked_64MiB": {"status": status, "accepted_mb": round(sent / 2**20, 1), **growth}}))
    assert status == 413 and "RAYPAI_SERVE_MAX_BODY_BYTES" in body["error"]["message"], body
    assert sent < 32 * 2**20, f"the server read {sent} bytes of a body past its cap"
    assert growth["proxy"] <= 24 and growth["router"] <= 24, growth  # the cap (4 MiB) and its copies, not 64 MiB


@pytest.mark.parametrize(
    "path,extra,param,named",
    [
        ("/v1/completions", {"prompt": "a" * 100_001}, "prompt", "limit is 100000 (RAYPAI_SERVE_MAX_PROMPT_CHARS)"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "a" * 60_000}] * 2},
            "messages",
            "has 120000 characters: the limit is 100000 (RAYPAI_SERVE_MAX_PROMPT_CHARS)",
        ),
        ("/v1/completions", {"prompt": "a", "stop": list("abcde")}, "stop", "limit is 4 (RAYPAI_SERVE_MAX_STOP)"),
        ("/v1/completions", {"prompt": "a", "stop": "s" * 65}, "stop", "limit is 64 (RAYPAI_SERVE_MAX_STOP_CHARS)"),
        ("/v1/completions", {"prompt": "a", "user": "u" * 257}, "user", "limit is 256 (RAYPAI_SERVE_MAX_USER_CHARS)"),
    ],
)
def test_each_field_limit_answers_400_naming_it(stack, path, extra, param, named):
    base = {"model": "lim", "messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"model": "lim"}
    r = httpx.post(BASE + path, json={**base, **extra}, headers=_auth(stack), timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and named in err["message"], err


def test_prompt_tokens_past_the_context_window_answer_400_naming_it(stack):
    r = httpx.post(
        BASE + "/v1/completions",
        json={"model": "lim", "prompt": "word " * 5000, "max_tokens": 8},
        headers=_auth(stack),
        timeout=60,
    )
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded", r.text
    assert "exceeds the context window of 4096 tokens" in err["message"], err


def test_requests_at_the_limits_are_answered(stack):
    """The negative control: the same fields just under each limit are served."""
    h = _auth(stack)
    r = httpx.post(
        BASE + "/v1/completions",
        json={
            "model": "lim",
            "prompt": "the quick",
            "max_tokens": 4,
            "stop": ["s" * 64, "b", "c", "d"],
            "user": "u" * 256,
        },
        headers=h,
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 4, r.text
    r = httpx.post(
        BASE + "/v1/chat/completions",
        json={"model": "lim", "messages": [{"role": "user", "content": "1+2="}], "max_tokens": 3, "stop": "\n"},
        headers=h,
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant", r.text
    assert httpx.get(BASE + "/v1/models", headers=h, timeout=60).json()["data"][0]["id"] == "lim"


def test_concurrency_per_key_answers_429_with_retry_after(stack):
    """Two requests of one key held open (headers sent, body pending) take its two slots: the third
    gets 429 + Retry-After, another key is unaffected, and a slot frees when a request ends."""
    held = []
    for _ in range(LIMITS.max_concurrent_per_key):
        s = socket.create_connection(("127.0.0.1", serve_port()), timeout=30)
        s.sendall(_head("/v1/completions", {"Content-Length": 100, **_auth(stack)}) + b'{"model": ')
        held.append(s)
    try:
        body = {"model": "lim", "prompt": "a", "max_tokens": 1}
        deadline = time.time() + 10
        while (
            r := httpx.post(BASE + "/v1/completions", json=body, headers=_auth(stack), timeout=60)
        ).status_code == 200:
            assert time.time() < deadline, "the held requests never took their slots"
            time.sleep(0.1)
        assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
        assert "RAYPAI_SERVE_MAX_CONCURRENT_PER_KEY" in r.json()["error"]["message"], r.text
        assert (
            httpx.post(BASE + "/v1/completions", json=body, headers=_auth(stack, "other"), timeout=60).status_code
            == 200
        )
    finally:
        for s in held:
            s.close()
    deadline = time.time() + 10
    while (r := httpx.post(BASE + "/v1/completions", json=body, headers=_auth(stack), timeout=60)).status_code != 200:
        assert time.time() < deadline, f"the slots were not freed: {r.status_code} {r.text}"
        time.sleep(0.1)


class _Owner:
    """What RequestGuard asks of the Router replica: a real TokenCheck on a SQLite store."""

    def __init__(self, store, limits):
        from raypai.serving.auth import TokenCheck
        from raypai.serving.limits import InFlight

        self.auth, self.limits, self.in_flight = TokenCheck(store), limits, InFlight()


def _drive(app, headers: list[tuple[bytes, bytes]], body: bytes = b"{}") -> tuple[int, int]:
    """One ASGI request through `app`: (status answered, bytes of body the app asked for)."""
    asked, sent = [0], []

    async def receive():
        asked[0] += len(body)
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers, "query_string": b""}
    asyncio.run(app(scope, receive, send))
    return sent[0]["status"], asked[0]


def test_the_router_guard_answers_from_the_headers_without_receiving(tmp_path):
    """RequestGuard alone (as where the proxy runs without raypai's callback): the refusals never call
    `receive()`; a valid request reaches the app, which reads its body."""
    from raypai.serving.limits import RequestGuard
    from raypai.store import MetadataStore

    store = MetadataStore(f"sqlite:///{tmp_path}/meta.db")
    token = store.create_token("client", ["infer"])

    async def app(scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    owner = _Owner(store, Limits())
    guard = RequestGuard(app, owner=lambda: owner)
    good = (b"authorization", f"Bearer {token}".encode())
    huge = (b"content-length", str(HUGE).encode())
    assert _drive(guard, [huge]) == (401, 0)
    assert _drive(guard, [huge, (b"authorization", b"Bearer nope")]) == (413, 0)
    assert _drive(guard, [(b"content-length", b"2"), (b"authorization", b"Bearer nope")]) == (401, 0)
    assert _drive(guard, [huge, good]) == (413, 0)
    assert _drive(guard, [(b"content-length", b"2"), good]) == (200, 2)  # the negative control
    assert not owner.in_flight.count  # every slot given back


# ---- back-pressure, cancellation, failures and a database outage (issue #38 items 2-4) --------------


def _info(stack) -> dict:
    return serve.get_app_handle(stack["app"]).info.remote().result(timeout_s=30)


def _open(stack, body: dict, who: str = "held0") -> socket.socket:
    """A completion request sent on a raw socket, left open: the test reads what it wants and closes it
    (the client disconnecting)."""
    data = json.dumps({"model": "lim", **body}).encode()
    head = ["POST /v1/completions HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json"]
    head += [f"Content-Length: {len(data)}", f"Authorization: Bearer {stack['tokens'][who]}"]
    s = socket.create_connection(("127.0.0.1", serve_port()), timeout=30)
    s.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + data)
    return s


def _read_events(s: socket.socket, n: int) -> bytes:
    """Read until `n` server-sent events have arrived (or the stream ends)."""
    got = b""
    while got.count(b"data: ") < n:
        chunk = s.recv(65536)
        if not chunk:
            break
        got += chunk
    return got


def _read_for(s: socket.socket, seconds: float) -> bytes:
    """Whatever arrives on `s` during `seconds`."""
    got, end = b"", time.monotonic() + seconds
    s.settimeout(0.05)
    try:
        while time.monotonic() < end:
            try:
                chunk = s.recv(65536)
            except TimeoutError:
                continue
            if not chunk:
                break
            got += chunk
    finally:
        s.settimeout(30)
    return got


def _read_until(s: socket.socket, marker: bytes, timeout: float) -> bytes:
    """Read until `marker` has arrived (or the stream ends, or `timeout`)."""
    got, end = b"", time.monotonic() + timeout
    while marker not in got and time.monotonic() < end:
        chunk = s.recv(65536)
        if not chunk:
            break
        got += chunk
    return got


def _wait(cond, timeout: float, every: float = 0.05) -> float:
    """Seconds until `cond()` held; fails after `timeout`."""
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, f"not within {timeout} s"
        time.sleep(every)
    return time.monotonic() - t0


def _complete(stack, who="infer", **body) -> httpx.Response:
    body = {"model": "lim", "prompt": "1+2=", "max_tokens": 2, **body}
    return httpx.post(BASE + "/v1/completions", json=body, headers=_auth(stack, who), timeout=60)


@pytest.mark.parametrize("stream", [True, False])
def test_a_disconnected_client_frees_its_engine_row_within_a_second(stack, stream):
    """The replica's engine thread stamps when it drops a cancelled row (`last_cancel_at`, this machine's
    clock): that, not the polling here (a handle call each, slow on a loaded machine), is timed."""
    before = _info(stack)["cancelled"]
    s = _open(stack, {**LONG, "stream": stream})
    try:
        if stream:
            assert b"200 OK" in _read_events(s, 3)  # decoding: deltas arrive
        _wait(lambda: _info(stack)["active_rows"] == 1, timeout=30)
    finally:
        closed = time.time()
        s.close()
    seen = _wait(lambda: _info(stack)["active_rows"] == 0, timeout=10)  # a 2000-token request takes longer
    info = _info(stack)
    freed = info["last_cancel_at"] - closed
    print(json.dumps({"stream": stream, "row_freed_after_s": round(freed, 3), "seen_after_s": round(seen, 2)}))
    assert info["cancelled"] == before + 1 and freed < 1.0, (freed, info)
    assert info["listeners"] == 0 and info["waiting"] == 0, info


def test_a_full_queue_answers_503_with_retry_after_and_recovers(stack):
    """ONGOING long requests fill the replica, QUEUED more wait at the router: the next is refused at
    once with 503 + Retry-After instead of waiting behind them; when they go, requests are served."""
    running = [_open(stack, {**LONG, "stream": True}, f"held{i}") for i in range(ONGOING)]
    queued = []
    try:
        for s in running:
            assert b"200 OK" in _read_events(s, 2)
        queued = [_open(stack, {**LONG, "stream": True}, f"held{ONGOING + i}") for i in range(QUEUED)]
        time.sleep(1.0)  # they reach the router and wait there for a replica slot
        t0 = time.monotonic()
        r = _complete(stack)
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        assert r.json()["error"]["code"] == "overloaded" and "max_queued_requests" in r.text, r.text
        assert time.monotonic() - t0 < 5  # refused, not queued
    finally:
        for s in running + queued:
            s.close()
    recovered = _wait(lambda: _complete(stack).status_code == 200, timeout=30, every=0.2)
    print(json.dumps({"recovered_after_s": round(recovered, 2)}))
    _wait(lambda: _info(stack)["active_rows"] == 0, timeout=10)


def test_a_failing_request_fails_alone(stack):
    """A prompt whose forward pass fails (a token past the model's embedding) gets a 500 that names no
    cause, while a stream decoding beside it goes on, row and all."""
    s = _open(stack, {**LONG, "stream": True})
    try:
        assert b"200 OK" in _read_events(s, 3)
        r = _complete(stack, prompt=BAD_PROMPT)
        assert r.status_code == 500, r.text
        err = r.json()["error"]
        assert err["code"] == "internal_error" and "reference" in err["message"], err
        assert "Index" not in r.text and "embedding" not in r.text and "Traceback" not in r.text, r.text
        _read_for(s, 0.5)  # what the stream sent before the failure
        after = _read_for(s, 1.0)  # and after it: tokens still coming, no error event, not closed
        assert after.count(b"data: ") >= 10 and b'"error"' not in after, after[-300:]
        assert _info(stack)["active_rows"] == 1  # the stream's row, still decoding
        assert _complete(stack).status_code == 200  # and the replica serves others
    finally:
        s.close()
    _wait(lambda: _info(stack)["active_rows"] == 0, timeout=10)


def test_an_answer_past_the_request_timeout_is_cut_and_its_row_freed(stack):
    """A 2000-token stream and a 2000-token completion, both past the deployment's 5-s
    request_timeout_s: the completion gets 504 `timeout`, the stream's last event is that error (its
    headers were sent), both within a few seconds of the limit, and their engine rows are gone."""
    s = _open(stack, {**LONG, "stream": True})
    try:
        t0 = time.monotonic()
        r = _complete(stack, **LONG)
        took = time.monotonic() - t0
        streamed = _read_until(s, b"data: [DONE]", timeout=10)
    finally:
        s.close()
    assert r.status_code == 504 and r.json()["error"]["code"] == "timeout", r.text
    assert "request_timeout_s" in r.json()["error"]["message"] and TIMEOUT_S <= took < TIMEOUT_S + 4, took
    assert b'"code": "timeout"' in streamed.rsplit(b"data: ", 2)[-2], streamed[-300:]  # the last event before [DONE]
    _wait(lambda: _info(stack)["active_rows"] == 0, timeout=2)


def test_a_database_outage_keeps_known_tokens_and_models_answered_then_catches_up(stack):
    store, h = stack["store"], _auth(stack, "known")
    assert _complete(stack, "known").status_code == 200  # the router has seen this token
    stack["outage"].touch()
    try:
        time.sleep(TTL_S + 0.5)  # every cached token is past its lifetime: the router must ask, and fails
        late = store.create_token("late", ["infer"])  # written while the router cannot read
        from raypai.deployment import DeploymentSpec

        store.save_deployment("ghost", DeploymentSpec(model="tiny", version=1), "running")
        for _ in range(3):
            assert _complete(stack, "known").status_code == 200
            models = httpx.get(BASE + "/v1/models", headers=h, timeout=60)
            assert models.status_code == 200 and [m["id"] for m in models.json()["data"]] == ["lim"], models.text
        r = httpx.post(
            BASE + "/v1/completions",
            json={"model": "lim", "prompt": "1", "max_tokens": 1},
            headers={"Authorization": f"Bearer {late}"},
            timeout=60,
        )
        assert r.status_code == 503 and r.json()["error"]["code"] == "auth_unavailable", r.text
        assert "db.internal" not in r.text and "5432" not in r.text and "sqlite" not in r.text.lower(), r.text
    finally:
        stack["outage"].unlink()
    caught_up = _wait(
        lambda: (
            httpx.get(BASE + "/v1/models", headers={"Authorization": f"Bearer {late}"}, timeout=60).status_code == 200
        ),
        timeout=15,
        every=0.2,
    )
    _wait(lambda: "ghost" in httpx.get(BASE + "/v1/models", headers=h, timeout=60).text, timeout=10, every=0.2)
    print(json.dumps({"caught_up_after_s": round(caught_up, 2)}))
    store.delete_deployment("ghost")


def test_the_deploy_api_answers_503_naming_the_database_without_its_url(stack, tmp_path):
    """The deploy API (uvicorn, in this process) on a store whose database fails: 503, the database
    named as unavailable, no URL, host or driver text; and 200 again once it answers."""
    import uvicorn

    from raypai.serving.api import create_app
    from raypai.serving.router import _inject_faults
    from raypai.store import MetadataStore

    down = tmp_path / "down"
    store = MetadataStore(stack["store"].url)
    os.environ[FAULTS_ENV] = json.dumps({"down_while_exists": str(down)})
    try:
        _inject_faults(store)
    finally:
        del os.environ[FAULTS_ENV]
    deploy = store.create_token("deployer", ["deploy"])
    ctl = Controller(stack["ctl"].settings, store=store, tracker=stack["ctl"].tracker, freshness=FRESHNESS)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(create_app(ctl.settings, ctl, reconcile=False), host="127.0.0.1", port=port, log_level="error")
    )
    threading.Thread(target=server.run, daemon=True).start()
    api, h = f"http://127.0.0.1:{port}/api/v1/deployments", {"Authorization": f"Bearer {deploy}"}
    try:
        _wait(lambda: server.started, timeout=30)
        down.touch()
        for r in (httpx.get(api, headers=h, timeout=60), httpx.get(api + "/lim", headers=h, timeout=60)):
            assert r.status_code == 503, r.text
            err = r.json()["error"]
            assert err["code"] == "database_unavailable" and "metadata database is unavailable" in err["message"]
            assert "db.internal" not in r.text and "5432" not in r.text and str(tmp_path.parent) not in r.text
        down.unlink()
        r = httpx.get(api + "/lim", headers=h, timeout=60)
        assert r.status_code == 200 and r.json()["name"] == "lim", r.text
    finally:
        server.should_exit = True


def test_a_revoked_token_stops_working_within_the_cache_lifetime(stack):
    assert _complete(stack, "revoked").status_code == 200  # looked up and cached now
    stack["store"].revoke_token("revoked")
    stopped = _wait(lambda: _complete(stack, "revoked", max_tokens=1).status_code == 401, timeout=15, every=0.1)
    print(json.dumps({"revoked_after_s": round(stopped, 2), "ttl_s": TTL_S}))
    assert stopped <= TTL_S + 1.0, f"the revoked token still worked {stopped:.2f} s later (lifetime {TTL_S} s)"
    assert _complete(stack).status_code == 200  # others unaffected


def test_the_token_cache_lifetime_defaults_to_a_minute_and_is_read_from_the_environment():
    from raypai.errors import ConfigError

    assert Freshness().token_ttl_s == 60.0
    assert Freshness.from_env({"RAYPAI_SERVE_TOKEN_TTL_S": "2"}).token_ttl_s == 2.0
    with pytest.raises(ConfigError, match="RAYPAI_SERVE_TOKEN_TTL_S='0'"):
        Freshness.from_env({"RAYPAI_SERVE_TOKEN_TTL_S": "0"})


def _scrape(names: list[str], timeout: float = 60) -> str:
    """The node's Prometheus text (Ray's metrics agent) once every one of `names` is in it."""
    port = ray._private.worker._global_node.metrics_export_port
    deadline, text = time.monotonic() + timeout, ""
    while time.monotonic() < deadline:
        try:
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        except httpx.HTTPError:
            text = ""
        if all(n in text for n in names):
            return text
        time.sleep(1)
    missing = [n for n in names if n not in text]
    raise AssertionError(f"not exported within {timeout} s: {missing}")


def _value(text: str, name: str, **labels) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_serving_metrics_reach_prometheus_through_rays_metrics(stack):
    """Queue depth, in-flight rows, rejections by reason, time to first token and tokens/s per
    deployment and version, scraped from the node's metrics agent as Prometheus would."""
    version = stack["app"].rsplit("-v", 1)[1]
    answer = _complete(stack, max_tokens=6)
    assert answer.status_code == 200
    produced = answer.json()["usage"]["completion_tokens"]
    assert httpx.post(BASE + "/v1/completions", json={"model": "lim", "prompt": "x"}, timeout=30).status_code == 401
    text = _scrape(
        [
            "ray_raypai_serve_ttft_seconds_count",
            "ray_raypai_serve_rejections_total",
            "ray_raypai_serve_inflight_rows",
            "ray_raypai_serve_queue_depth",
            "ray_raypai_serve_generated_tokens_total",
        ]
    )
    tags = {"deployment": "lim", "version": version}
    assert _value(text, "ray_raypai_serve_ttft_seconds_count", **tags) >= 1
    assert _value(text, "ray_raypai_serve_generated_tokens_total", **tags) >= produced >= 1
    assert _value(text, "ray_raypai_serve_rejections_total", reason="missing_token") >= 1
    # nothing is decoding now: the last values sent are an idle replica's
    assert _value(text, "ray_raypai_serve_inflight_rows", **tags) == 0
    assert _value(text, "ray_raypai_serve_queue_depth", **tags) == 0


def test_a_rollback_under_load_loses_no_in_flight_request(stack, slow_model_dir):
    """A canary taking all the traffic is rolled back while a stream decodes on it: Serve drains its
    replica (the spec's drain_timeout_s) rather than cutting it, so the rollback returns only once
    the stream has finished, whole; the requests after it go to the stable version. (A deployment of
    its own: a request timeout long enough for seconds of decoding on a loaded machine.)"""
    ctl = stack["ctl"]
    stable = int(stack["app"].rsplit("-v", 1)[1])
    ctl.create("drain", "tiny", stable, request_timeout_s=120, max_batch_size=4)
    canary = ctl.tracker.register_model(slow_model_dir, "tiny")
    ctl.update("drain", canary_version=canary, canary_percent=100)
    canary_app = app_name("drain", canary)

    def answered_by() -> str:
        r = _complete(stack, model="drain")
        return str(r.json().get("raypai_model_version")) if r.status_code == 200 else ""

    # the router takes the new table at its next refresh: until a request is answered by the canary
    _wait(lambda: answered_by().endswith(f"/{canary}"), timeout=60, every=0.2)
    body = {"model": "drain", "prompt": "the quick", "max_tokens": 1500, "temperature": 0, "stream": True}
    started, got = threading.Event(), {"events": [], "status": None, "done_at": None}

    def stream() -> None:
        with httpx.stream("POST", BASE + "/v1/completions", json=body, headers=_auth(stack, "held0"), timeout=120) as r:
            got["status"] = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    got["events"].append(json.loads(line[len("data: ") :]))
                    started.set()
        got["done_at"] = time.monotonic()

    client = threading.Thread(target=stream)
    client.start()
    assert started.wait(60)
    rows = serve.get_app_handle(canary_app).info.remote().result(timeout_s=30)["active_rows"]
    ctl.rollback("drain")  # returns once Serve deleted the canary's app, its replica drained first
    rolled_at = time.monotonic()
    client.join(timeout=120)
    assert rows == 1  # the stream was decoding on the canary when the rollback began
    assert got["status"] == 200 and not any("error" in e for e in got["events"]), got["events"][-1:]
    assert got["events"][-1]["usage"]["completion_tokens"] == 1500  # whole: not cut
    assert got["done_at"] <= rolled_at + 0.5  # the rollback waited for it
    assert canary_app not in serve.status().applications
    assert answered_by().endswith(f"/{stable}")  # the stable version answers on
    ctl.delete("drain")
