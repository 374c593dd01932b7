"""The router's limits over real HTTP (raypai.serving.limits): token and size refused from the
headers before the body is read, each field limit answered with its status and its name, the
concurrency per key, and valid requests still answered. One Ray + Serve + deployment for the module."""

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
from raypai.settings import Settings
from raypai.tracking import Tracker

BASE = f"http://127.0.0.1:{serve_port()}"
LIMITS = Limits(max_concurrent_per_key=2)  # the others at their defaults
HUGE = 200 * 2**20  # the attack: a 200 MB body
PROXY_HOOK = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model_dir):
    """(Named `stack` as test_serving.py's, so tests/conftest.py marks its users integration.)"""
    from raypai.store import MetadataStore

    home = tmp_path_factory.mktemp("limits-home")
    settings = Settings.load({"RAYPAI_HOME": str(home)})
    tracker = Tracker(settings.mlflow_tracking_uri, artifact_root=home / "mlartifacts")
    version = tracker.register_model(tiny_model_dir, "tiny")
    store = MetadataStore(settings.database_url)
    tokens = {"infer": store.create_token("client", ["infer"]), "other": store.create_token("other", ["infer"])}
    # Serve's proxy takes its callback from its node's environment, which a local Ray takes from here
    os.environ[PROXY_HOOK] = "raypai.serving.limits.proxy_middlewares"
    try:
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    finally:
        del os.environ[PROXY_HOOK]
    ctl = Controller(settings, store=store, tracker=tracker, limits=LIMITS)
    ctl.create("lim", "tiny", version)
    yield {"tokens": tokens, "store": store}
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
        json={"model": "lim", "prompt": "word " * 200, "max_tokens": 8},
        headers=_auth(stack),
        timeout=60,
    )
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded", r.text
    assert "exceeds the context window of 64 tokens" in err["message"], err


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
