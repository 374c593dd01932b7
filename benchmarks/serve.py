"""Serving throughput: the Ray Serve stack (HTTP proxy → router → batching model server) under 1, 4 and
16 concurrent clients, against the same model answering one request at a time and a plain batched
`model.generate` call on the same prompts (the ceiling), all in the same run.

    .venv/bin/python benchmarks/serve.py
    .venv/bin/python benchmarks/serve.py --max-tokens 64 --hidden 384 --layers 6 --batch-wait-ms 50

Prints one JSON line per measurement, then a summary line with the two ratios the targets name
(concurrency 16 vs one-at-a-time ≥ 4×, vs the batched ceiling ≥ 0.7×). The load comes from a separate
process (this script re-run with `--load`) over loopback, as a client would send it. Greedy decoding,
the same prompts everywhere; throughput counts the completion tokens actually returned.

raypai's engine against vLLM's CPU build (issue #38), each in a process of its own with its own Ray
and Serve, on the same random-init model folder (vLLM's rows run under `.venv-vllm`, `make test-vllm`):

    .venv/bin/python benchmarks/serve.py --compare-vllm

Streaming completions at concurrency 1 and 16: output tokens/s, p50/p99 time to first token (sending
to the first event with text), and each engine's wall time including start-up; then a summary line
with the vllm/raypai ratios. Without `.venv-vllm` the vLLM rows are skipped with a line saying so.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORDS = (
    "the quick brown fox jumps over the lazy dog while seven small birds sing about rivers mountains "
    "and a long road home under bright winter stars"
).split()


def prompts(n: int, seed: int = 0) -> list[str]:
    """`n` prompts of 3 to 24 words (different lengths, so batches need padding)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 24))) for _ in range(n)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def summary(name: str, latencies: list[float], tokens: int, wall_s: float, **extra) -> dict:
    return {
        "bench": "serve",
        "mode": name,
        "requests": len(latencies),
        "wall_s": round(wall_s, 3),
        "req_per_s": round(len(latencies) / wall_s, 2),
        "tokens_per_s": round(tokens / wall_s, 1),
        "p50_ms": round(1000 * percentile(latencies, 50), 1),
        "p99_ms": round(1000 * percentile(latencies, 99), 1),
        **extra,
    }


# ---- the load generator (a separate process) ---------------------------------------------------


async def _load(url: str, token: str, model: str, texts: list[str], concurrency: int, max_tokens: int) -> dict:
    import httpx

    queue: asyncio.Queue = asyncio.Queue()
    for t in texts[:concurrency]:
        queue.put_nowait(t)
    latencies, tokens, errors = [], 0, 0

    async def worker(client):
        nonlocal tokens, errors
        while not queue.empty():
            text = queue.get_nowait()
            t0 = time.perf_counter()
            r = await client.post(
                url, json={"model": model, "prompt": text, "max_tokens": max_tokens, "temperature": 0}
            )
            latencies.append(time.perf_counter() - t0)
            if r.status_code == 200:
                tokens += r.json()["usage"]["completion_tokens"]
            else:
                errors += 1

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=300, limits=limits, headers={"Authorization": f"Bearer {token}"}) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))  # warm-up: one round per client
        for t in texts:
            queue.put_nowait(t)
        latencies.clear()
        tokens = errors = 0
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return {"latencies": latencies, "tokens": tokens, "errors": errors, "wall_s": wall}


def run_load(url, token, model, texts, concurrency, max_tokens, stream: bool = False) -> dict:
    """Run the load generator in a fresh process and return its measurements."""
    cmd = [
        sys.executable,
        __file__,
        "--stream-load" if stream else "--load",
        json.dumps(
            {
                "url": url,
                "token": token,
                "model": model,
                "texts": texts,
                "concurrency": concurrency,
                "max_tokens": max_tokens,
            }
        ),
    ]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


async def _stream_load(url: str, token: str, model: str, texts: list[str], concurrency: int, max_tokens: int) -> dict:
    """Streaming completions: time to first token (request sent to the first event with text) and
    the output tokens, counted as the events that carry text (both engines send one per token)."""
    import httpx

    queue: asyncio.Queue = asyncio.Queue()
    ttfts, latencies, tokens, errors = [], [], 0, 0

    async def worker(client):
        nonlocal tokens, errors
        while not queue.empty():
            text = queue.get_nowait()
            body = {"model": model, "prompt": text, "max_tokens": max_tokens, "temperature": 0, "stream": True}
            t0 = time.perf_counter()
            first, n = None, 0
            async with client.stream("POST", url, json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    errors += 1
                    continue
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    choices = json.loads(line[6:]).get("choices") or [{}]
                    if choices[0].get("text"):
                        n += 1
                        first = first or time.perf_counter()
            latencies.append(time.perf_counter() - t0)
            ttfts.append((first or time.perf_counter()) - t0)
            tokens += n

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits, headers={"Authorization": f"Bearer {token}"}) as client:
        for t in texts[:concurrency]:  # warm-up: one round per client
            queue.put_nowait(t)
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        ttfts.clear()
        latencies.clear()
        tokens = errors = 0
        for t in texts:
            queue.put_nowait(t)
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return {"latencies": latencies, "ttfts": ttfts, "tokens": tokens, "errors": errors, "wall_s": wall}


# ---- the model and the in-process baselines -----------------------------------------------------


def build_model(folder: Path, hidden: int, layers: int, context: int) -> Path:
    """A random Llama with a BPE tokenizer trained on the benchmark's words (no downloads)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from raypai.data.tokenizer import train_tokenizer

    (folder / "ds").mkdir(parents=True)
    texts = prompts(400, seed=1)
    pq.write_table(
        pa.table({"doc_id": [str(i) for i in range(len(texts))], "text": texts, "source": ["bench"] * len(texts)}),
        folder / "ds" / "part-00000.parquet",
    )
    train_tokenizer(folder / "ds", folder / "m", vocab_size=512, min_frequency=1)
    tok = AutoTokenizer.from_pretrained(folder / "m")
    heads = max(1, hidden // 64)
    LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(tok),
            hidden_size=hidden,
            intermediate_size=hidden * 8 // 3,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=heads,
            max_position_embeddings=context,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
        )
    ).save_pretrained(folder / "m")
    return folder / "m"


class InProcess:
    """The same generation code the model server runs, without Serve, one torch thread (as a replica)."""

    def __init__(self, model_dir: Path):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(1)
        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir).eval()

    def run(self, texts: list[str], max_tokens: int, batch: int) -> dict:
        """`batch`=1 answers one request at a time; `batch`=16 is one padded `model.generate` per 16
        prompts (the ceiling: no HTTP, no scheduling, every batch full)."""
        from raypai.serving.generation import GenRequest, generate_batch

        reqs = [GenRequest(self.tok(t, add_special_tokens=False)["input_ids"], max_tokens, 0.0) for t in texts]
        stop = {self.tok.eos_token_id}
        generate_batch(self.model, self.tok, reqs[:batch], stop)  # warm-up
        latencies, tokens = [], 0
        start = time.perf_counter()
        for i in range(0, len(reqs), batch):
            t0 = time.perf_counter()
            res = generate_batch(self.model, self.tok, reqs[i : i + batch], stop)
            latencies += [time.perf_counter() - t0] * len(res)  # every request in a batch waits for all of it
            tokens += sum(r.completion_tokens for r in res)
        return {"latencies": latencies, "tokens": tokens, "wall_s": time.perf_counter() - start}


# ---- raypai's engine against vLLM's CPU build (issue #38) ---------------------------------------

VLLM_PYTHON = Path(__file__).resolve().parent.parent / ".venv-vllm" / "bin" / "python"


def engine_rows(args) -> None:
    """One engine alone: its own Ray and Serve, the model at `args.model_dir` registered afresh, then
    streaming load at concurrency 1 and 16; one JSON line per concurrency and one for the wall time."""
    t_start = time.perf_counter()
    import ray
    from ray import serve

    from raypai.runtime import ensure_ray
    from raypai.serving.control import Controller, serve_port
    from raypai.settings import Settings
    from raypai.store import MetadataStore
    from raypai.tracking import Tracker

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    home = Path(tempfile.mkdtemp(prefix=f"raypai-bench-serve-{args.engine}-"))
    port = os.environ.get("RAYPAI_SERVE_PORT") or str(free_port())
    settings = Settings.load({"RAYPAI_HOME": str(home), "RAYPAI_SERVE_PORT": port})
    version = Tracker(settings.mlflow_tracking_uri).register_model(Path(args.model_dir), "bench")
    token = MetadataStore(settings.database_url).create_token("bench", ["infer"])
    texts = prompts(args.requests)
    base = {"bench": "serve", "engine": args.engine, "max_tokens": args.max_tokens, "model_dir": args.model_dir}
    ensure_ray(settings, local=True, num_cpus=4, dashboard=False, log_to_driver=False)
    try:
        Controller(settings).create(
            "bench",
            "bench",
            version,
            engine=args.engine,
            cpus=1.0,
            max_batch_size=16,
            batch_wait_timeout_s=args.batch_wait_ms / 1000,
        )
        ready_s = time.perf_counter() - t_start
        url = f"http://127.0.0.1:{serve_port(settings)}/v1/completions"
        for c in (1, 16):
            n = args.single_requests if c == 1 else args.requests
            r = run_load(url, token, "bench", texts[:n], c, args.max_tokens, stream=True)
            line = summary(f"stream_c{c}", r["latencies"], r["tokens"], r["wall_s"], **base)
            line.update(
                concurrency=c,
                errors=r["errors"],
                ttft_p50_ms=round(1000 * percentile(r["ttfts"], 50), 1),
                ttft_p99_ms=round(1000 * percentile(r["ttfts"], 99), 1),
                loadavg_1m=round(os.getloadavg()[0], 1),  # the machine is shared: say how busy
            )
            print(json.dumps(line), flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    wall = {"mode": "wall", "ready_s": round(ready_s, 1), "wall_s": round(time.perf_counter() - t_start, 1)}
    print(json.dumps({**base, **wall, "loadavg_1m": round(os.getloadavg()[0], 1)}), flush=True)


def compare_vllm(args) -> None:
    """Build one model folder, then run each engine's rows in a fresh process (vLLM's under .venv-vllm)."""
    folder = Path(tempfile.mkdtemp(prefix="raypai-bench-serve-model-"))
    model_dir = build_model(folder, args.hidden, args.layers, context=256)
    common = ["--model-dir", str(model_dir), "--max-tokens", str(args.max_tokens), "--requests", str(args.requests)]
    common += ["--single-requests", str(args.single_requests), "--batch-wait-ms", str(args.batch_wait_ms)]
    rows: dict[str, dict[str, dict]] = {}
    for engine, python in (("raypai", sys.executable), ("vllm", str(VLLM_PYTHON))):
        if not Path(python).exists():
            print(
                json.dumps(
                    {
                        "bench": "serve",
                        "engine": engine,
                        "skipped": f"vLLM rows skipped: {python} is absent (`make test-vllm` builds it)",
                    }
                )
            )
            continue
        proc = subprocess.run([python, __file__, "--engine", engine, *common], capture_output=True, text=True)
        for raw in proc.stdout.splitlines():
            if raw.startswith("{"):
                print(raw, flush=True)
                line = json.loads(raw)
                rows.setdefault(engine, {})[line["mode"]] = line
        if proc.returncode != 0:
            print(json.dumps({"bench": "serve", "engine": engine, "failed": proc.stderr[-2000:]}), flush=True)
    out = {"bench": "serve", "mode": "summary_vllm_vs_raypai", "hidden": args.hidden, "layers": args.layers}
    if {"raypai", "vllm"} <= rows.keys():
        r, v = rows["raypai"], rows["vllm"]
        for c in (1, 16):
            m = f"stream_c{c}"
            if m in r and m in v:
                out[f"tokens_per_s_c{c}"] = round(v[m]["tokens_per_s"] / r[m]["tokens_per_s"], 2)
                out[f"ttft_p50_c{c}"] = round(v[m]["ttft_p50_ms"] / r[m]["ttft_p50_ms"], 2)
                out[f"ttft_p99_c{c}"] = round(v[m]["ttft_p99_ms"] / r[m]["ttft_p99_ms"], 2)
        if "wall" in r and "wall" in v:
            out["wall_s"] = round(v["wall"]["wall_s"] / r["wall"]["wall_s"], 2)
    print(json.dumps(out), flush=True)


# ---- the served stack ---------------------------------------------------------------------------


def main(args) -> None:
    import ray
    from ray import serve

    from raypai.runtime import ensure_ray
    from raypai.serving.control import Controller, serve_port
    from raypai.serving.router import app_name
    from raypai.settings import Settings
    from raypai.store import MetadataStore
    from raypai.tracking import Tracker

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    home = Path(tempfile.mkdtemp(prefix="raypai-bench-serve-"))
    # not 8000: Serve binds with SO_REUSEPORT, so another server there would share the load
    port = os.environ.get("RAYPAI_SERVE_PORT") or str(free_port())
    settings = Settings.load({"RAYPAI_HOME": str(home), "RAYPAI_SERVE_PORT": port})
    model_dir = build_model(home / "model", args.hidden, args.layers, context=256)
    Tracker(settings.mlflow_tracking_uri).register_model(model_dir, "bench", alias="champion")
    token = MetadataStore(settings.database_url).create_token("bench", ["infer"])
    conf = {
        "hidden": args.hidden,
        "layers": args.layers,
        "max_tokens": args.max_tokens,
        "max_batch_size": 16,
        "batch_wait_ms": args.batch_wait_ms,
    }
    texts = prompts(args.requests)
    local = InProcess(model_dir)
    lines = []

    def record(mode: str, r: dict, round_: int, **extra) -> None:
        lines.append(
            summary(
                mode,
                r["latencies"],
                r["tokens"],
                r["wall_s"],
                round=round_,
                **extra,
                **conf,
                loadavg_1m=round(os.getloadavg()[0], 1),
            )
        )  # the machine is shared: say how busy
        print(json.dumps(lines[-1]), flush=True)

    # a Ray of this benchmark's own (never RAY_ADDRESS or raypai's recorded head), 4 logical CPUs
    ensure_ray(settings, local=True, num_cpus=4, dashboard=False, log_to_driver=False)
    try:
        Controller(settings).create(
            "bench",
            "bench",
            alias="champion",
            cpus=1.0,
            max_batch_size=16,
            batch_wait_timeout_s=args.batch_wait_ms / 1000,
        )
        url = f"http://127.0.0.1:{serve_port(settings)}/v1/completions"
        server = serve.get_app_handle(app_name("bench", 1))
        # Rounds interleave every mode, so a burst of load from elsewhere hits all of them alike;
        # the summary compares each mode's best round.
        for round_ in range(args.rounds):
            record("one_at_a_time", local.run(texts[: args.single_requests], args.max_tokens, batch=1), round_)
            record("batched_generate_ceiling", local.run(texts, args.max_tokens, batch=16), round_)
            for c in (1, 4, 16):
                n = args.single_requests if c == 1 else args.requests
                before = server.info.remote().result()
                r = run_load(url, token, "bench", texts[:n], c, args.max_tokens)
                after = server.info.remote().result()
                steps = after["decode_steps"] - before["decode_steps"]
                batch = (after["decode_tokens"] - before["decode_tokens"]) / max(1, steps)  # mean rows per step
                record(f"served_c{c}", r, round_, concurrency=c, errors=r["errors"], mean_decode_batch=round(batch, 2))
    finally:
        serve.shutdown()
        ray.shutdown()
    best = {}
    for line in lines:
        if line["tokens_per_s"] > best.get(line["mode"], {}).get("tokens_per_s", -1):
            best[line["mode"]] = line
    c16 = best["served_c16"]["tokens_per_s"]
    print(
        json.dumps(
            {
                "bench": "serve",
                "mode": "summary",
                "rounds": args.rounds,
                "best_tokens_per_s": {m: line["tokens_per_s"] for m, line in best.items()},
                "c16_vs_one_at_a_time": round(c16 / best["one_at_a_time"]["tokens_per_s"], 2),
                "c16_vs_served_c1": round(c16 / best["served_c1"]["tokens_per_s"], 2),
                "c16_vs_ceiling": round(c16 / best["batched_generate_ceiling"]["tokens_per_s"], 2),
                "targets": {"c16_vs_one_at_a_time": 4.0, "c16_vs_ceiling": 0.7},
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--load", help=argparse.SUPPRESS)  # internal: run as the load-generator process
    p.add_argument("--requests", type=int, default=96, help="requests per measurement at concurrency 4 and 16")
    p.add_argument("--single-requests", type=int, default=16, help="requests one at a time / at concurrency 1")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3, help="interleaved repetitions; the best of each mode counts")
    p.add_argument("--batch-wait-ms", type=float, default=10.0, help="how long an arriving group waits to fill")
    p.add_argument("--compare-vllm", action="store_true", help="raypai's engine against vLLM's CPU build")
    p.add_argument("--engine", choices=("raypai", "vllm"), help="internal: one engine's rows (--compare-vllm)")
    p.add_argument("--model-dir", help="internal: the model folder both engines serve")
    p.add_argument("--stream-load", help=argparse.SUPPRESS)  # internal: the streaming load generator
    a = p.parse_args()
    if a.stream_load:
        spec = json.loads(a.stream_load)
        print(json.dumps(asyncio.run(_stream_load(**spec))))
    elif a.compare_vllm:
        compare_vllm(a)
    elif a.engine:
        engine_rows(a)
    elif a.load:
        spec = json.loads(a.load)
        print(
            json.dumps(
                asyncio.run(
                    _load(
                        spec["url"],
                        spec["token"],
                        spec["model"],
                        spec["texts"],
                        spec["concurrency"],
                        spec["max_tokens"],
                    )
                )
            )
        )
    else:
        main(a)
