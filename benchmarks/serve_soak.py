"""Serving under load and abuse (issue #38): a bounded soak of the whole stack on loopback.

    .venv/bin/python benchmarks/serve_soak.py                  # 180 s of load, then stops
    .venv/bin/python benchmarks/serve_soak.py --seconds 30     # a short one

Starts a Ray of its own (4 logical CPUs, Serve's proxy with raypai's callback), Serve on a free port,
and one deployment of a tiny random-init Llama it builds (raypai.alignment.tasks.tiny), in a
temporary RAYPAI_HOME. Then 32 concurrent clients, each drawing every request from this mix:
valid chats and completions (35% each), streams cancelled half way (15%: the client reads half of
its tokens and hangs up), bodies over the 4 MiB cap declared with a valid token (7.5%: 413, sent as
headers plus 64 KiB, the rest never comes) and requests without a token or with a wrong one (7.5%).

Prints one JSON line per figure: the valid requests' success rate and 5xx count (goal 100%, 0), their
p50/p99 latency, the abuse answers by status, RSS of the Serve proxy, the router replica and the
model replica after warm-up and at the end of the load (goal: growth <= 5%), and the engine rows
left one second after the load stops (goal 0); then a summary line with pass/miss per goal.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import tempfile
import time
from pathlib import Path

CLIENTS = 32
MIX = {"chat": 0.35, "completion": 0.35, "stream_cancel": 0.15, "oversize": 0.075, "unauthenticated": 0.075}
WORDS = "the quick brown fox jumps over the lazy dog say hello what is the capital of france".split()
OVERSIZE = 5 * 2**20  # declared body: past the 4 MiB default cap (RAYPAI_SERVE_MAX_BODY_BYTES)
RSS_EVERY_S = 5.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] if xs else float("nan")


def _text(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 20)))


class Tally:
    """What the clients saw: per kind, the statuses and (valid requests) the latencies."""

    def __init__(self):
        self.statuses: dict[str, dict[str, int]] = {k: {} for k in MIX}
        self.latencies: list[float] = []
        self.cancelled = 0  # streams actually cut half way (the rest ended before their half)
        self.errors: dict[str, str] = {}  # the first error body of each (kind, status), for the notes

    def add(self, kind: str, status: int | str, latency: float | None = None) -> None:
        self.statuses[kind][str(status)] = self.statuses[kind].get(str(status), 0) + 1
        if latency is not None:
            self.latencies.append(latency)


async def _valid(client, kind: str, rng: random.Random, tally: Tally) -> None:
    body = {"model": "soak", "max_tokens": rng.randint(8, 32), "temperature": rng.choice([0.0, 0.8])}
    if kind == "chat":
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": _text(rng)}]
    else:
        path, body["prompt"] = "/v1/completions", _text(rng)
    t0 = time.perf_counter()
    try:
        r = await client.post(path, json=body)
        latency = time.perf_counter() - t0
        # a 200 is an answer (the random model may end its turn at once: 0 tokens is still one)
        ok = r.status_code == 200 and "choices" in r.json()
        tally.add(kind, r.status_code if ok or r.status_code != 200 else "200_malformed", latency)
        if r.status_code != 200:
            tally.errors.setdefault(f"{kind} {r.status_code}", r.text[:300])
    except Exception as exc:  # noqa: BLE001 - a transport failure is a failed valid request, counted
        tally.add(kind, type(exc).__name__)


async def _stream_cancel(client, rng: random.Random, tally: Tally) -> None:
    """A completion streamed for 48 tokens; the client reads 24 events and hangs up."""
    body = {"model": "soak", "prompt": _text(rng), "max_tokens": 48, "temperature": 0.8, "stream": True}
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                tally.add("stream_cancel", r.status_code)
                tally.errors.setdefault(f"stream_cancel {r.status_code}", (await r.aread()).decode()[:300])
                return
            events = 0
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    break
                if '"error"' in line:
                    tally.add("stream_cancel", "error_event")
                    return
                events += 1
                if events >= 24:
                    tally.cancelled += 1
                    break  # leaving the block closes the connection mid-stream
            tally.add("stream_cancel", 200)
    except Exception as exc:  # noqa: BLE001
        tally.add("stream_cancel", type(exc).__name__)


async def _raw(port: int, path: str, headers: dict, body: bytes) -> int:
    """A POST as raw bytes (a body shorter than the declared one is how an attacker holds a server);
    returns the answer's status."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        head = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json"]
        head += [f"{k}: {v}" for k, v in headers.items()]
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), timeout=60)
        return int(line.split()[1])
    finally:
        writer.close()


async def _abuse(port: int, token: str, kind: str, rng: random.Random, tally: Tally) -> None:
    try:
        if kind == "oversize":  # a valid token, a declared body past the cap, 64 KiB of it sent
            status = await _raw(
                port,
                "/v1/chat/completions",
                {"Authorization": f"Bearer {token}", "Content-Length": OVERSIZE},
                b"x" * 2**16,
            )
        else:  # no token (the proxy refuses it) or a wrong one (the router does), small or oversize body
            body = json.dumps({"model": "soak", "prompt": _text(rng), "max_tokens": 8}).encode()
            headers = {} if rng.random() < 0.5 else {"Authorization": "Bearer not-a-token"}
            big = rng.random() < 0.5
            headers["Content-Length"] = OVERSIZE if big else len(body)
            status = await _raw(port, "/v1/completions", headers, body[: 2**16])
        tally.add(kind, status)
    except Exception as exc:  # noqa: BLE001
        tally.add(kind, type(exc).__name__)


async def load(port: int, token: str, seconds: float, warmup_s: float, sample_rss) -> tuple[Tally, dict]:
    import httpx

    tally, rss = Tally(), {}
    deadline = time.monotonic() + seconds
    kinds, weights = list(MIX), list(MIX.values())

    async def client_loop(i: int, client) -> None:
        rng = random.Random(i)
        while time.monotonic() < deadline:
            kind = rng.choices(kinds, weights)[0]
            if kind in ("chat", "completion"):
                await _valid(client, kind, rng, tally)
            elif kind == "stream_cancel":
                await _stream_cancel(client, rng, tally)
            else:
                await _abuse(port, token, kind, rng, tally)

    async def sampler() -> None:
        """RSS every few seconds under load: the warm-up figure is the first sample past warm-up, the
        end figure the last sample before the load stops."""
        start = time.monotonic()
        while time.monotonic() < deadline:
            now = sample_rss()
            if "warm" not in rss and time.monotonic() - start >= warmup_s:
                rss["warm"] = now
            rss["end"] = now
            await asyncio.sleep(RSS_EVERY_S)

    limits = httpx.Limits(max_connections=CLIENTS)
    async with httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{port}",
        timeout=120,
        limits=limits,
        headers={"Authorization": f"Bearer {token}"},
    ) as client:
        await asyncio.gather(sampler(), *(client_loop(i, client) for i in range(CLIENTS)))
    return tally, rss


def find_processes(app: str) -> dict:
    """This script's Ray workers for the Serve proxy, the router replica and the model replica, by
    their process titles (descendants of this process: not another Ray's on a shared machine)."""
    import psutil

    mine = psutil.Process().children(recursive=True)
    out = {}
    for role, part in (("proxy", "ProxyActor"), ("router", "raypai-router"), ("model", app)):
        found = [p for p in mine if part in " ".join(p.cmdline())]
        if len(found) != 1:
            raise RuntimeError(f"expected one process titled *{part}*, found {[p.cmdline() for p in found]}")
        out[role] = found[0]
    return out


def main(args) -> None:
    import ray
    from ray import serve

    from raypai.alignment.tasks.tiny import build_tiny_model
    from raypai.runtime import ensure_ray
    from raypai.serving.control import Controller, serve_port
    from raypai.serving.router import app_name
    from raypai.settings import Settings
    from raypai.store import MetadataStore
    from raypai.tracking import Tracker

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    home = Path(tempfile.mkdtemp(prefix="raypai-serve-soak-"))
    # never a default port: Serve binds with SO_REUSEPORT, so another server there would share the load
    port = os.environ.get("RAYPAI_SERVE_PORT") or str(free_port())
    settings = Settings.load({"RAYPAI_HOME": str(home), "RAYPAI_SERVE_PORT": port})
    # 512 positions: this byte-level tokenizer spends up to ~5 tokens a word, and every request must fit
    model_dir = build_tiny_model(home / "model", context=512)
    tracker = Tracker(settings.mlflow_tracking_uri, artifact_root=home / "mlartifacts")
    version = tracker.register_model(model_dir, "soak", alias="champion")
    token = MetadataStore(settings.database_url).create_token("soak", ["infer"])
    note = "shared machine: other agents' jobs ran meanwhile (loadavg_1m is this machine's, not the soak's)"
    emit = lambda d: print(json.dumps({"bench": "serve_soak", **d}), flush=True)  # noqa: E731

    # a Ray of this benchmark's own (never RAY_ADDRESS or raypai's recorded head); local=True also sets
    # Serve's proxy callback (raypai.serving.limits.proxy_middlewares) in this process's environment
    ensure_ray(settings, local=True, num_cpus=4, dashboard=False, log_to_driver=False)
    try:
        Controller(settings, tracker=tracker).create("soak", "soak", version)
        app = app_name("soak", version)
        procs = find_processes(app)

        def sample_rss() -> dict:
            return {k: p.memory_info().rss for k, p in procs.items()}

        loadavg_start = os.getloadavg()[0]
        t0 = time.monotonic()
        tally, rss = asyncio.run(
            load(serve_port(settings), token, args.seconds, args.warmup or args.seconds / 6, sample_rss)
        )
        wall = time.monotonic() - t0
        time.sleep(1.0)  # a hung-up stream's row is freed within a second (issue #38)
        info = serve.get_app_handle(app).info.remote().result(timeout_s=30)
        rss_idle = sample_rss()
    finally:
        serve.shutdown()
        ray.shutdown()

    conf = {"seconds": args.seconds, "clients": CLIENTS, "loadavg_1m_start": round(loadavg_start, 1)}
    conf["loadavg_1m_end"] = round(os.getloadavg()[0], 1)
    valid = {k: tally.statuses[k] for k in ("chat", "completion")}
    total = sum(n for s in valid.values() for n in s.values())
    ok = sum(s.get("200", 0) for s in valid.values())
    five = sum(n for s in valid.values() for st, n in s.items() if st.startswith("5"))
    rate = ok / total if total else 0.0
    emit({"figure": "valid_requests", "requests": total, "ok": ok, "success_rate": round(rate, 5),
          "http_5xx": five, "statuses": valid, "req_per_s": round(total / wall, 1), **conf, "note": note})  # fmt: skip
    lat = tally.latencies
    emit({"figure": "valid_latency", "p50_ms": round(1000 * percentile(lat, 50), 1),
          "p99_ms": round(1000 * percentile(lat, 99), 1), "max_ms": round(1000 * max(lat, default=0), 1),
          "note": note})  # fmt: skip
    emit({"figure": "streams_cancelled_half_way", "started": sum(tally.statuses["stream_cancel"].values()),
          "cut": tally.cancelled, "statuses": tally.statuses["stream_cancel"]})  # fmt: skip
    emit({"figure": "first_error_bodies", "errors": tally.errors})
    emit({"figure": "abuse", "oversize": tally.statuses["oversize"],
          "unauthenticated": tally.statuses["unauthenticated"]})  # fmt: skip
    growth = {}
    for role in procs:
        warm, end = rss["warm"][role], rss["end"][role]
        growth[role] = (end - warm) / warm
        emit({"figure": "rss", "process": role, "after_warmup_mb": round(warm / 2**20, 1),
              "end_mb": round(end / 2**20, 1), "idle_after_mb": round(rss_idle[role] / 2**20, 1),
              "growth_pct": round(100 * growth[role], 2)})  # fmt: skip
    rows_left = info["active_rows"] + info["waiting"]
    emit({"figure": "engine_rows_left", "active_rows": info["active_rows"], "waiting": info["waiting"],
          "listeners": info["listeners"], "cancelled_by_engine": info["cancelled"]})  # fmt: skip
    abuse_ok = all(st in ("401", "413") for k in ("oversize", "unauthenticated") for st in tally.statuses[k]) and all(
        st == "413" for st in tally.statuses["oversize"]
    )
    goals = {
        "valid_success_100pct": rate == 1.0 and total > 0,
        "valid_zero_5xx": five == 0,
        "rss_growth_le_5pct": all(g <= 0.05 for g in growth.values()),
        "engine_rows_left_0": rows_left == 0,
        "abuse_refused_401_413": abuse_ok,
    }
    emit({"figure": "summary", "goals": {k: "pass" if v else "miss" for k, v in goals.items()},
          "wall_s": round(wall, 1), **conf})  # fmt: skip


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=180.0, help="how long the load runs")
    p.add_argument("--warmup", type=float, default=None, help="seconds before the first RSS figure [seconds/6]")
    main(p.parse_args())
