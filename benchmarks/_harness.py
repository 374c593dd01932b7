"""The honest harness of the alignment benchmarks (issue #36 item 4): every row in its own process.

    from _harness import run_row, wait_ray_free       # benchmarks/align_grpo.py, align_online.py

The parent (the script run by hand) imports neither torch, Ray nor raypai: it builds the workloads
and runs each row by re-invoking the script with `--one '<row spec as JSON>'`, then reads the row's
JSON line back. A raypai row starts its own local Ray and shuts it down before its process ends; a
TRL row never imports Ray (checked in the row: `ray_imported`). Before every row the parent waits
until no Ray process (raylet, gcs_server) is alive on the machine and records what it found
(`ray_processes_at_start`: 0 in an honest row; on a shared machine another user's Ray shows here).
`wall_s` is the parent's clock from spawning the process to its exit: interpreter start, imports,
model load, Ray start and stop (raypai), compiles and every step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

MARK = "@@row "  # a row's line on stdout (TRL prints its own logs there too)
RAY_NAMES = ("raylet", "gcs_server")


def emit(row: dict) -> None:
    print(json.dumps(row, default=float), flush=True)


def emit_child(row: dict) -> None:
    """The child's result: the one marked line the parent reads."""
    print(MARK + json.dumps(row, default=float), flush=True)


def ray_processes() -> list[dict]:
    """Ray's daemons alive on this machine, anyone's (psutil, by process name)."""
    import psutil

    found = []
    for p in psutil.process_iter(["pid", "name", "username"]):
        if p.info["name"] in RAY_NAMES:
            found.append({"pid": p.info["pid"], "name": p.info["name"], "user": p.info["username"]})
    return found


def wait_ray_free(timeout_s: float, foreign: frozenset = frozenset()) -> list[dict]:
    """Wait (≤ timeout_s) until no Ray daemon is alive but those in `foreign` (pids alive before the
    harness started, someone else's: waiting cannot end them): the last row's Ray can take a few
    seconds to exit after its driver. Returns every daemon still alive, foreign ones included
    (empty: the machine is free of Ray)."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = ray_processes()
        if not [p for p in alive if p["pid"] not in foreign] or time.monotonic() > deadline:
            return alive
        time.sleep(0.5)


def run_row(
    script: str,
    spec: dict,
    *,
    threads: int | None = None,
    timeout_s: float = 1800,
    ray_wait_s: float = 60,
    foreign: frozenset = frozenset(),
) -> dict:
    """Run one row in a fresh process of `script` and return its JSON row, with the parent's wall
    time and the Ray check added. `threads`: OMP/MKL threads of the child (the TRL rows; torch's own
    count is set inside as well). A failed row comes back as {"error": ...}, never raises."""
    alive = wait_ray_free(ray_wait_s, foreign)
    env = dict(os.environ)
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    # its own process group: a row that runs past timeout_s (or a parent stopped by ^C) takes its
    # whole group with it (the Ray it started too: its daemons stay in the group)
    proc = subprocess.Popen(
        [sys.executable, script, "--one", json.dumps(spec)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        _stop_group(proc)
        out, err = proc.communicate()
        rc = f"timeout after {timeout_s:.0f} s"
    except BaseException:
        _stop_group(proc)
        raise
    wall = time.perf_counter() - t0
    lines = [ln[len(MARK) :] for ln in out.splitlines() if ln.startswith(MARK)]
    row = json.loads(lines[-1]) if lines and rc == 0 else {"error": f"exit {rc}: {err.strip()[-2000:]}"}
    return {
        "result": spec["name"],
        **row,
        "wall_s": wall,  # process start to end, as the parent saw it
        "ray_processes_at_start": len(alive),  # anyone's; 0 in an honest row
        **({"ray_pids_at_start": [(p["pid"], p["name"], p["user"]) for p in alive]} if alive else {}),
        "load_avg_1m_at_start": load,
        "cpus": os.cpu_count(),
    }


def stop_rows_on_sigterm() -> None:
    """In the parent: a SIGTERM (`timeout`, `kill`) raises SystemExit, so the running row's process
    group is stopped too (`run_row`) instead of living on, orphaned, with its Ray. A row killed while
    DeepSpeed JIT-builds an op leaves torch's build lock behind (~/.cache/torch_extensions/.../lock),
    and later DeepSpeed starts wait on it: remove that file if a raypai row then hangs at start."""
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def _stop_group(proc: subprocess.Popen, grace_s: float = 10) -> None:
    """SIGTERM the row's process group, SIGKILL it after `grace_s`."""
    import signal

    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace_s)
            return
        except subprocess.TimeoutExpired:
            continue


class Steps:
    """A RunLogger stand-in that keeps the per-step metrics of a raypai run and when each step ended."""

    def __init__(self):
        self.rows, self.stamps = [], []

    def log_metrics(self, metrics, step=None):
        if step is not None:
            self.rows.append(metrics)
            self.stamps.append(time.perf_counter())


def cpu_has_bf16() -> bool:
    """The CPU's bf16 units as the kernel lists them (the parent imports no torch):
    `roles._device.cpu_has_bf16` asks torch the same in the rows."""
    try:
        with open("/proc/cpuinfo") as f:
            return any(("avx512_bf16" in ln or "amx_bf16" in ln) for ln in f if ln.startswith("flags"))
    except OSError:
        return False


def process_age_s() -> float:
    """Seconds since this process was created (the child's own view of its start-up)."""
    import psutil

    return time.time() - psutil.Process().create_time()


def median_of(rows: list[dict], key) -> float | None:
    """The median of `key` (a field name, or a function of the row) over the rows that have it."""
    import statistics

    get = key if callable(key) else (lambda r: r.get(key))
    vals = [get(r) for r in rows if get(r) is not None]
    return statistics.median(vals) if vals else None


def length_mod_5(prompts, completions, **_) -> list[float]:
    """A reward that tells a random model's samples apart: the completion text's length mod 5 (the
    exact-answer rule would tie every group of a random model). Either dataset format: a chat
    completion is [{"role": "assistant", "content": text}]."""
    from raypai.alignment.tasks.arithmetic import text_of

    return [float(len(text_of(c)) % 5) for c in completions]


# The two workloads of issue #36: TRL's toy (issue #14's model) and a compute-bound ~10 M model.
# Each row names its workload; the model folders are built once per invocation, in a process of
# their own (building imports raypai's tokenizer trainer, which imports Ray, though it starts none).
WORKLOADS = {
    # a 0.63 M-parameter Llama, raypai's tokenizer and chat template; short prompts, ≤ 16 new tokens
    "toy": {
        "batches": "1x8,8x8",
        "max_new_tokens": 16,
        "steps": 20,
        "dpo_steps": 100,
        "reward": "exact_match",
        "hidden": 128,
    },
    # a 9.8 M-parameter Qwen2 (hidden 256, 6 layers, 4 heads / 2 KV heads, MLP 1024, vocab 7,600,
    # untied embeddings), ChatML: a random model of this vocabulary rarely stops, so ≈ 64 new tokens
    "compute": {
        "batches": "8x8",
        "max_new_tokens": 64,
        "steps": 10,
        "dpo_steps": 30,
        "reward": "length_mod_5",
        "hidden": 256,
    },
}
COMPUTE_SHAPE = {"hidden": 256, "layers": 6, "heads": 4, "kv_heads": 2, "intermediate": 1024, "vocab": 7600}


def build_workload(name: str, out: Path, seed: int) -> dict:
    """Writes the workload's HF model folder under `out`; returns its path and parameter count."""
    from raypai.alignment.tasks.tiny import build_tiny_model

    if name == "toy":
        path = build_tiny_model(out / "toy", hidden=128, layers=4, heads=4, kv_heads=2, vocab_size=512, seed=seed)
    elif name == "compute":
        import torch
        from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

        s = COMPUTE_SHAPE
        # the tiny Qwen2 family's tokenizer and ChatML template, its vocabulary padded with plain
        # added tokens to the model's (a BPE trained on the tiny corpus stops far short of 7,600)
        path = build_tiny_model(out / "compute", family="qwen2", vocab_size=512, seed=seed)
        tok = AutoTokenizer.from_pretrained(path)
        tok.add_tokens([f"<w{i}>" for i in range(s["vocab"] - len(tok))])
        tok.save_pretrained(path)
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(
            Qwen2Config(
                hidden_size=s["hidden"],
                intermediate_size=s["intermediate"],
                num_hidden_layers=s["layers"],
                num_attention_heads=s["heads"],
                num_key_value_heads=s["kv_heads"],
                max_position_embeddings=256,
                tie_word_embeddings=False,
                vocab_size=len(tok),
                bos_token_id=tok.bos_token_id,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
            )
        )
        model.save_pretrained(path)
    else:
        raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}")
    from transformers import AutoConfig, AutoModelForCausalLM

    n = sum(p.numel() for p in AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path)).parameters())
    return {"model_dir": str(path), "params": n}


def problems(n_prompts: int, seed: int):
    """(train, held-out) `a+b=` problems (a, b in 0..49), shuffled by `seed`: the prompts of every row."""
    import random

    from raypai.alignment.tasks import arithmetic as ar

    items = ar.problems(max_operand=49)
    random.Random(seed).shuffle(items)
    return items[:n_prompts], items[n_prompts : n_prompts + 16]


def reward_fn(name: str):
    from raypai.alignment.tasks import arithmetic as ar

    return {"exact_match": ar.exact_match_reward, "length_mod_5": length_mod_5}[name]
