"""LoRA against full fine-tuning (issue #34): DPO and GRPO with a KL term (so full fine-tuning needs a
reference model) on a ~10M-parameter Qwen2-shape model, raypai at its defaults but for `lora_r`.

    .venv/bin/python benchmarks/align_lora.py                    # 2 rounds × 4 runs: 27 min on a 2-vCPU VM at load 8-23
    .venv/bin/python benchmarks/align_lora.py --rounds 1 --grpo-steps 3 --dpo-steps 8   # smoke run
    .venv/bin/python benchmarks/align_lora.py --only grpo --rounds 3

The model: a random-init Qwen2 (hidden 384, 8 layers, 6 query / 2 key-value heads, MLP 768, tied
embeddings, a ChatML tokenizer of 365 tokens: 10.38 M parameters), `build_tiny_model(family="qwen2")`.
Each (algorithm × lora_r 0 / 16) runs in a subprocess of its own with its own local Ray, nothing else
of this script alive beside it; the configurations are interleaved over `--rounds` rounds (the order
flips every round). One JSON line per run, then one summary line per algorithm (medians over the
rounds, LoRA's ratio to full fine-tuning, the goals).
- DPO: `run_dpo` with DPOConfig's defaults (batch 8, β 0.1, lr 5e-4; LoRA: lr 10× by default) for
  `--dpo-steps` steps on 64 pairs from `a+b=` problems (chosen = the sum, rejected = a near miss);
  preference accuracy and margin on 16 held-out problems' pairs. No rollout, so no sync. Placement
  gives the full run's trainer 2 torch threads (its bundle holds the Reference's 0.5 CPU too) and
  the LoRA run's 1, so their rates also differ by thread count.
- GRPO: `run_grpo` with GRPOConfig's defaults (8 prompts × 8 samples, at most 6 new tokens,
  token-mean loss, synchronous, lr 5e-4) but β = 0.04 (DeepSeekMath's; the default 0 needs no
  reference at all) and no held-out evaluation inside the loop, for `--grpo-steps` steps on 64
  chat prompts. The reward is 1 / (1 + |n − (a+b)|) for a completion starting with an integer n, else
  0 (`closeness`: a random model never gets a sum exactly right, so the exact-answer rule would be 0
  everywhere and teach nothing); held-out reward = that reward of greedy completions of 16 held-out
  prompts after the last step.
Measured at the end of the last step, with every role still alive:
- tensor bytes, inside each role's process (`actor.__ray_call__`, no role method added): parameters
  and buffers (by storage, so tied weights count once), gradients (one per trainable parameter:
  each update allocates them and drops them after the step, so they are counted, not observed),
  the optimizer's state, and what a LoRA rollout keeps between syncs (`merge_base`: the last
  adapter factors of fp32 weights, a copy of the targeted base weights of lower precision;
  `lora.merge_into`). A synchronous full
  GRPO replica's parameters are the trainer's own shared pages: counted once, on the trainer;
- PSS (`/proc/<pid>/smaps_rollup`) of each role process minus that of an idle Ray actor of the same
  run, summed; `pss_anon_shmem_above_idle` is its anonymous + shared-memory part, which other
  processes mapping the same libraries (another torch on the machine) do not move;
- samples/s (GRPO: samples over the wall time of steps 2..N; DPO: pairs over the time from the end
  of step 1 to the end of the last), `sync_bytes` per step (GRPO's metric), the held-out metric, and
  the subprocess's whole wall time (Python and Ray start-up, the run, shutdown) beside the run's own.
Goals (issue #34): LoRA's tensor bytes ≤ 0.6× the full run's, its sync bytes ≤ 0.1×.
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
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

MODEL = dict(family="qwen2", hidden=384, layers=8, heads=6, kv_heads=2, vocab_size=512)
GRPO_BETA = 0.04
GOALS = {"tensor_bytes": 0.6, "sync_bytes": 0.1}  # LoRA over full fine-tuning, at most


def emit(row: dict) -> None:
    print(json.dumps(row, default=float), flush=True)


def closeness(prompts, completions, answer, **_) -> list[float]:
    """1 / (1 + |n − the sum|) for a completion that starts with an integer n, else 0: a reward a
    random model can climb (it never gets a sum exactly right, so the exact-answer rule is 0 everywhere
    and teaches nothing)."""
    from raypai.alignment.tasks.arithmetic import parse_answer
    from raypai.chat import text_of

    got = [parse_answer(text_of(c)) for c in completions]
    return [0.0 if n is None else 1.0 / (1.0 + abs(n - int(a))) for n, a in zip(got, answer)]


# ---- measured inside the run (the child process) ---------------------------------------------------


def role_tensors(role) -> dict:
    """Run in a role's own process (`actor.__ray_call__.remote(role_tensors)`): bytes of the tensors it
    holds for the model, by kind."""
    out = {"pid": os.getpid(), "role": type(role).__name__}
    out.update(params=0, grads=0, optimizer=0, merge_base=0, bound_to_trainer=0)
    if "torch" not in sys.modules:  # the Reward of Python reward functions loads no torch
        return out
    import torch

    seen: set = set()

    def nbytes(tensors) -> int:
        n = 0
        for t in tensors:
            s = t.untyped_storage()
            if s.device.type == "meta" or s.data_ptr() in seen:
                continue
            seen.add(s.data_ptr())
            n += s.nbytes()
        return n

    engine = getattr(role, "engine", None)  # a Trainer's DeepSpeed engine (a Rollout's is a name)
    engine = engine if hasattr(engine, "module") else None
    model = engine.module if engine is not None else getattr(role, "model", None)
    if model is None:
        return out
    params = list(model.parameters())
    if engine is None and getattr(role, "_live", False):  # a replica bound to the trainer's own pages
        out["bound_to_trainer"] = sum(p.numel() * p.element_size() for p in params)
        params = []
    out["params"] = nbytes([*params, *model.buffers()])
    if engine is not None:
        out["grads"] = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        opt = engine.optimizer
        while not isinstance(opt, torch.optim.Optimizer) and hasattr(opt, "optimizer"):
            opt = opt.optimizer
        out["optimizer"] = nbytes(t for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor))
    # what a LoRA replica keeps between syncs (`lora.merge_into`): the last factors (fp32), or a copy
    # of the targeted base weights (lower precision)
    kept = getattr(role, "_lora_base", {}).values()
    out["merge_base"] = nbytes(x for v in kept for x in ([v] if isinstance(v, torch.Tensor) else list(v[0].values())))
    return out


def pss(pid: int) -> dict:
    """PSS and its anonymous / file / shared-memory parts of a process, in bytes."""
    fields = {"Pss:": "pss", "Pss_Anon:": "anon", "Pss_File:": "file", "Pss_Shmem:": "shmem"}
    out = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        key, *rest = line.split()
        if key in fields:
            out[fields[key]] = int(rest[0]) * 1024  # kB
    return out


class Probe:
    """A RunLogger stand-in: keeps the step metrics and, at the last step, measures every role of
    the run (tensor bytes and PSS) while they are all alive."""

    def __init__(self, run_name: str, last_step: int, idle):
        self.run_name, self.last_step, self.idle = run_name, last_step, idle
        self.rows, self.stamps, self.roles, self.summary = [], [], None, None

    def log_metrics(self, metrics, step=None):
        if step is None:
            self.summary = metrics
            return
        self.rows.append(metrics)
        self.stamps.append(time.perf_counter())
        if step == self.last_step:
            self.roles = self.measure()

    def measure(self) -> list[dict]:
        import ray

        names = sorted(n for n in ray.util.list_named_actors() if n.startswith(f"{self.run_name}/"))
        if not names:
            raise RuntimeError(f"no actors named {self.run_name}/… to measure")
        idle = pss(ray.get(self.idle.pid.remote()))
        roles = []
        for name in names:
            row = ray.get(ray.get_actor(name).__ray_call__.remote(role_tensors))
            mem = pss(row["pid"])
            row.update(name=name.split("/", 1)[1], pss=mem["pss"], pss_idle=idle["pss"])
            row["pss_anon_shmem"] = mem["anon"] + mem["shmem"]
            row["pss_anon_shmem_idle"] = idle["anon"] + idle["shmem"]
            roles.append(row)
        return roles


def child(args) -> dict:
    """One run: its own local Ray, an idle actor for the PSS baseline, the driver, the measurements."""
    import ray

    from raypai.alignment import DPOConfig, GRPOConfig, run_dpo, run_grpo
    from raypai.alignment.data import preference_examples, prompt_examples
    from raypai.alignment.tasks import arithmetic as ar
    from raypai.runtime import ensure_ray
    from raypai.settings import Settings

    t0 = time.perf_counter()
    ensure_ray(Settings.load(), local=True, num_cpus=8, dashboard=False, log_to_driver=False)
    ray_start = time.perf_counter() - t0

    @ray.remote(num_cpus=0)
    class Idle:
        def pid(self) -> int:
            return os.getpid()

    idle = Idle.remote()
    ray.get(idle.pid.remote())
    train, held = workload(args.seed)
    run_name = f"bench-{args.child}-r{args.lora_r}"
    out = Path(args.out) / run_name
    steps = args.dpo_steps if args.child == "dpo" else args.grpo_steps
    probe = Probe(run_name, steps, idle)
    t1 = time.perf_counter()
    try:
        if args.child == "dpo":
            cfg = DPOConfig(steps=steps, seed=args.seed, lora_r=args.lora_r)
            summary = run_dpo(
                args.model,
                str(out),
                preference_examples(ar.preference_rows(train, seed=args.seed, per_problem=1)),
                preference_examples(ar.preference_rows(held, seed=args.seed, per_problem=1)),
                cfg,
                run_name=run_name,
                logger=probe,
            )
            steady = len(probe.stamps) - 1  # from the end of step 1 to the end of the last
            rate = cfg.batch_size * steady / (probe.stamps[-1] - probe.stamps[0])
            row = {
                "pairs_per_s": rate,
                "preference_accuracy_after": summary["preference_accuracy_after"],
                "margin_after": summary["margin_after"],
                "preference_accuracy_before": summary["preference_accuracy_before"],
                "sync_bytes": None,  # offline DPO has no rollout to sync
            }
        else:
            # eval_every past the last step: the driver measures the held-out reward after the last
            # step anyway, and an evaluation inside the loop would only repeat it (and run before the probe)
            cfg = GRPOConfig(steps=steps, beta=GRPO_BETA, seed=args.seed, eval_every=10**6, lora_r=args.lora_r)
            summary = run_grpo(
                args.model,
                str(out),
                prompt_examples(ar.prompt_rows(train)),
                prompt_examples(ar.prompt_rows(held)),
                cfg,
                run_name=run_name,
                rewards=[(closeness, 1.0)],
                logger=probe,
            )
            steady = probe.rows[1:]
            row = {
                "samples_per_s": sum(r["samples"] for r in steady) / sum(r["step_seconds"] for r in steady),
                "eval_reward_before": summary["eval_reward_before"],
                "eval_reward_after": summary["eval_reward_after"],
                "reward_mean": summary["mean_reward_mean"],
                "sync_bytes": statistics.median(r["sync_bytes"] for r in probe.rows),
            }
        run_s = time.perf_counter() - t1
    finally:
        ray.shutdown()
    roles = probe.roles
    tensor = {k: sum(r[k] for r in roles) for k in ("params", "grads", "optimizer", "merge_base")}
    return {
        "result": f"{args.child}_{'lora' if args.lora_r else 'full'}",
        "lora_r": args.lora_r,
        "steps": steps,
        **row,
        "tensor_bytes": sum(tensor.values()),
        **{f"tensor_{k}": v for k, v in tensor.items()},
        "pss_above_idle": sum(r["pss"] - r["pss_idle"] for r in roles),
        "pss_anon_shmem_above_idle": sum(r["pss_anon_shmem"] - r["pss_anon_shmem_idle"] for r in roles),
        "idle_pss": roles[0]["pss_idle"],
        "processes": len(roles),
        "roles": [
            {k: r[k] for k in ("name", "params", "grads", "optimizer", "merge_base", "bound_to_trainer", "pss")}
            for r in roles
        ],
        "trainable_params": summary["trainable_params"],
        "total_params": summary["total_params"],
        "ray_start_s": ray_start,
        "run_s": run_s,
    }


def workload(seed: int):
    """64 training and 16 held-out `a+b=` problems (a, b in 0..49), as `align_grpo.py` draws them."""
    import random

    from raypai.alignment.tasks import arithmetic as ar

    items = ar.problems(max_operand=49)
    random.Random(seed).shuffle(items)
    return items[:64], items[64:80]


# ---- the parent: builds the model, runs each configuration in a process of its own ----------------


def run_one(args, algo: str, lora_r: int, model: str, out: str) -> dict:
    cmd = [sys.executable, __file__, "--child", algo, "--lora-r", str(lora_r), "--model", model, "--out", out]
    cmd += ["--seed", str(args.seed), "--dpo-steps", str(args.dpo_steps), "--grpo-steps", str(args.grpo_steps)]
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"result"')]
    if proc.returncode or not rows:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-6000:])
        raise SystemExit(f"{algo} lora_r={lora_r} failed (exit {proc.returncode})")
    return {**rows[-1], "wall_s_incl_startup": wall, "load_avg_1m": [load_before, os.getloadavg()[0]]}


def summarize(rows: list[dict]) -> list[dict]:
    """Per algorithm: each figure's median over the rounds for full fine-tuning and LoRA, and LoRA's
    ratio to full (the goals are on tensor bytes and sync bytes)."""
    keys = (
        "tensor_bytes",
        "pss_above_idle",
        "pss_anon_shmem_above_idle",
        "sync_bytes",
        "samples_per_s",
        "pairs_per_s",
        "eval_reward_after",
        "preference_accuracy_after",
        "margin_after",
        "wall_s_incl_startup",
        "run_s",
    )
    out = []
    for algo in dict.fromkeys(r["result"].split("_")[0] for r in rows):
        med = {}
        for kind in ("full", "lora"):
            mine = [r for r in rows if r["result"] == f"{algo}_{kind}"]
            med[kind] = {k: statistics.median(r[k] for r in mine) for k in keys if mine and mine[0].get(k) is not None}
        if not med["full"] or not med["lora"]:
            continue
        row = {"result": f"summary_{algo}", "rounds": len([r for r in rows if r["result"] == f"{algo}_full"])}
        for k in keys:
            if k in med["full"] and k in med["lora"]:
                row[f"full_{k}"], row[f"lora_{k}"] = med["full"][k], med["lora"][k]
                if med["full"][k]:
                    row[f"lora_vs_full_{k}"] = med["lora"][k] / med["full"][k]
        for k, goal in GOALS.items():
            if f"lora_vs_full_{k}" in row:
                row[f"goal_{k}"] = goal
                row[f"met_{k}"] = row[f"lora_vs_full_{k}"] <= goal
        out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2, help="every configuration this many times, interleaved")
    ap.add_argument("--only", choices=("dpo", "grpo"), default=None)
    ap.add_argument("--dpo-steps", type=int, default=40)
    ap.add_argument("--grpo-steps", type=int, default=10)
    ap.add_argument("--lora-r", type=int, default=16, help="the LoRA runs' rank (the full runs: 0)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--child", choices=("dpo", "grpo"), help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        emit(child(args))
        return
    out = tempfile.mkdtemp(prefix="align-lora-")
    # the model is built in a process of its own: this one never loads torch, so it maps none of the
    # libraries whose pages the runs' PSS shares out
    build = f"from raypai.alignment.tasks.tiny import build_tiny_model as b; print(b({out + '/model'!r}, **{MODEL!r}))"
    model = subprocess.run([sys.executable, "-c", build], capture_output=True, text=True, check=True)
    model = model.stdout.strip().splitlines()[-1]
    configs = [(a, r) for a in ("dpo", "grpo") if args.only in (None, a) for r in (0, args.lora_r)]
    rows = []
    for rnd in range(1, args.rounds + 1):
        # the order flips every round, so a slow spell of the shared machine is not always one side's
        for algo, r in configs if rnd % 2 else configs[::-1]:
            row = {**run_one(args, algo, r, model, out), "round": rnd, "cpus": os.cpu_count()}
            rows.append(row)
            emit(row)
    for row in summarize(rows):
        emit(row)


if __name__ == "__main__":
    main()
