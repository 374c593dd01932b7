"""A trained role across ranks (issue #35): 1 against 2 trainer ranks on the same workload, against
the machine's ceiling for two ranks.

    .venv/bin/python benchmarks/align_scale.py                   # 2 rounds: ~6 min on a 2-vCPU VM
    .venv/bin/python benchmarks/align_scale.py --rounds 1 --steps 4   # smoke run

The workload: SFT updates (the objective every algorithm's policy shares the trainer role with) of a
random-init Qwen2 (hidden 256, 6 layers, 4 query / 2 key-value heads, MLP 768: ~6 M parameters)
on fixed batches of `--rows` rows × `--tokens` tokens, AdamW, fp32, one torch thread per rank.
- ceiling: two processes started together (multiprocessing, no Ray, no DeepSpeed), each a plain
  PyTorch loop of forward, backward and AdamW step over its half of the rows: what two ranks can do
  on this machine at best, with no communication at all. Tokens/s per process.
- raypai: `Run(...).place_policy` with `SFTConfig(ranks=1 | 2, zero_stage=0 | 2 | 3)`, defaults
  otherwise, each configuration in a subprocess of its own with its own local Ray (nothing else
  alive beside it). The driver hands the whole batch to the role and waits for each update; a step
  is timed at the driver, over steps 3..N. Tokens/s per rank = the batch's tokens / ranks / step.
  The 1-rank row is the same batch on one rank (the ceiling's per-process rate at twice the rows).
- memory: each rank's model state after the last step (`Trainer.rank_memory`: its parameters or
  parameter partitions, the optimizer's state and fp32 master partitions, the gradients it holds).
Each row: one JSON line; then one summary line with the ratios and the goals: ZeRO-2 ≥ 0.9× and
ZeRO-3 ≥ 0.8× of the ceiling's tokens/s per rank, ZeRO-3's model state per rank ≤ 0.6× one rank's.
The rounds interleave every configuration (the order flips each round); the summary takes medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

MODEL = dict(family="qwen2", hidden=256, layers=6, heads=4, kv_heads=2, vocab_size=512)
CONFIGS = [(1, 0), (2, 2), (2, 3), (1, 3)]  # (ranks, ZeRO stage)
GOALS = {"zero2_of_ceiling": 0.9, "zero3_of_ceiling": 0.8, "zero3_memory_per_rank": 0.6}


def build(folder: Path) -> str:
    from raypai.alignment.tasks.tiny import build_tiny_model

    if not (folder / "config.json").exists():
        build_tiny_model(folder, **MODEL)
    return str(folder)


def batch(model_dir: str, rows: int, tokens: int, seed: int = 0) -> dict:
    """Random token rows, the second half of each row a response (its loss counted)."""
    import torch
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (rows, tokens), generator=g)
    mask = torch.zeros(rows, tokens - 1, dtype=torch.long)
    mask[:, tokens // 2 :] = 1
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "response_mask": mask}


# ---- the ceiling: plain PyTorch loops, no Ray, no DeepSpeed --------------------------------------
def _plain_loop(model_dir: str, rows: int, tokens: int, steps: int, seed: int, out) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from raypai.alignment._tensors import token_logprobs

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    b = batch(model_dir, rows, tokens, seed)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        m = b["response_mask"]
        loss = -(token_logprobs(model, b["input_ids"], b["attention_mask"], where=m) * m).sum() / m.sum()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    out.put(statistics.median(times[2:]))


def ceiling(model_dir: str, rows: int, tokens: int, steps: int) -> dict:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_plain_loop, args=(model_dir, rows // 2, tokens, steps, i, q)) for i in range(2)]
    for p in procs:
        p.start()
    step = [q.get() for _ in procs]
    for p in procs:
        p.join()
    per = [(rows // 2) * tokens / s for s in step]
    return {"result": "ceiling_two_plain_loops", "tokens_per_s_per_rank": statistics.mean(per), "step_seconds": step}


# ---- raypai: one configuration, in a process of its own -----------------------------------------
def raypai_run(model_dir: str, ranks: int, stage: int, rows: int, tokens: int, steps: int) -> dict:
    import ray

    from raypai.alignment import SFTConfig
    from raypai.alignment._driver import Run
    from raypai.alignment.losses.objectives import SFT
    from raypai.alignment.placement import RoleSpec

    t_start = time.perf_counter()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    cfg = SFTConfig(ranks=ranks, zero_stage=stage, lr=1e-4)
    b = batch(model_dir, rows, tokens)
    objective = SFT()
    with Run(f"scale-{ranks}r-z{stage}", {"policy": RoleSpec(cpus=1, replicas=ranks)}) as run:
        policy = run.place_policy(model_dir, cfg)
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            ray.get(policy.update.remote(objective, objective.assemble(b)))
            times.append(time.perf_counter() - t0)
        actors = getattr(policy, "actors", [policy])
        memory = ray.get([a.rank_memory.remote() for a in actors])
    ray.shutdown()
    step = statistics.median(times[2:])
    state = [m["params"] + m["optimizer"] + m["grads"] for m in memory]
    return {
        "result": f"raypai_{ranks}rank_zero{stage}",
        "ranks": ranks,
        "zero_stage": stage,
        "tokens_per_s_per_rank": rows * tokens / ranks / step,
        "step_seconds": step,
        "first_step_seconds": times[0],
        "model_state_bytes_per_rank": max(state),
        "memory": memory,
        "wall_s_incl_startup": time.perf_counter() - t_start,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # "ranks,stage": run one configuration here
    ap.add_argument("--model", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        ranks, stage = map(int, args.one.split(","))
        print(json.dumps(raypai_run(args.model, ranks, stage, args.rows, args.tokens, args.steps)), flush=True)
        return
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build(Path(tmp) / "model")
        rows: list[dict] = []
        for rnd in range(1, args.rounds + 1):
            order = ["ceiling"] + CONFIGS if rnd % 2 else list(reversed(CONFIGS)) + ["ceiling"]
            for what in order:
                t0 = time.perf_counter()
                if what == "ceiling":
                    row = ceiling(model_dir, args.rows, args.tokens, args.steps)
                    row["wall_s_incl_startup"] = time.perf_counter() - t0
                else:
                    cmd = [sys.executable, __file__, "--one", f"{what[0]},{what[1]}", "--model", model_dir]
                    cmd += ["--rows", str(args.rows), "--tokens", str(args.tokens), "--steps", str(args.steps)]
                    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
                    row = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
                row.update(round=rnd, load_avg_1m=os.getloadavg()[0], cpus=os.cpu_count())
                rows.append(row)
                print(json.dumps(row), flush=True)
        med = {
            r: statistics.median(x["tokens_per_s_per_rank"] for x in rows if x["result"] == r)
            for r in {x["result"] for x in rows}
        }
        mem = {
            r: statistics.median(x["model_state_bytes_per_rank"] for x in rows if x["result"] == r)
            for r in {x["result"] for x in rows if "model_state_bytes_per_rank" in x}
        }
        ceil = med["ceiling_two_plain_loops"]
        summary = {
            "result": "summary",
            "rounds": args.rounds,
            "ceiling_tokens_per_s_per_rank": ceil,
            "one_rank_of_ceiling": med["raypai_1rank_zero0"] / ceil,
            "zero2_of_ceiling": med["raypai_2rank_zero2"] / ceil,
            "zero3_of_ceiling": med["raypai_2rank_zero3"] / ceil,
            "zero3_memory_per_rank": mem["raypai_2rank_zero3"] / mem["raypai_1rank_zero3"],
            "zero3_memory_per_rank_vs_zero0": mem["raypai_2rank_zero3"] / mem["raypai_1rank_zero0"],
            "goals": GOALS,
        }
        summary["met"] = {k: (summary[k] >= v if "of_ceiling" in k else summary[k] <= v) for k, v in GOALS.items()}
        print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
