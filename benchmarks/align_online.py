"""Online DPO and PPO step time, raypai only, every row in its own process (issue #36 item 4).

    .venv/bin/python benchmarks/align_online.py                   # both loops, both workloads, 3 rounds: ≈ 10-15 min on 2 quiet cores
    .venv/bin/python benchmarks/align_online.py --smoke           # each row once, tiny: a few minutes
    .venv/bin/python benchmarks/align_online.py --only online_dpo --workload toy --rounds 6

No TRL baseline and no target: the figures compare raypai's own versions (run from frozen copies of
the tree, interleaved). TRL's online DPO (`trl.experimental.OnlineDPOTrainer`) samples two
completions a prompt where raypai's samples `num_samples` and pairs best with worst, so it is not
the same workload. The rules are `align_grpo.py`'s (benchmarks/RESULTS.md, "How the alignment
figures are measured"): each row a process of its own that starts and stops its own Ray (the parent
imports neither Ray nor torch and records the Ray daemons alive at each row's start), raypai at its
defaults but the workload's sizes (`precision="auto"`: bf16 on a CPU with bf16 units, fp32 on
others; the row records `compute_dtype`), `wall_s` from process
start to exit beside the steady-state `step_ms` (from the end of the first logged step to the end
of the last, per logged step).

Workloads (`--workload toy|compute|both`, `_harness.WORKLOADS`), `a+b=` chat prompts, 8 prompts a
step, lr 1e-6, at most the workload's new tokens (16 toy, 64 compute):
- online DPO: 4 samples a prompt, best vs worst of each group, 40 steps (toy) or 10 (compute). The
  reward is the completion text's length mod 5, so that a random model's samples are told apart
  (the exact-answer rule would tie every group, and a tied step makes no update);
- PPO: one sample a prompt, 2 epochs (the default), 20 steps (toy) or 10 (compute), the workload's
  GRPO reward (exact answer on toy, length mod 5 on compute).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

import _harness as h  # noqa: E402

LOOPS = ("online_dpo", "ppo")
STEPS = {"toy": {"online_dpo": 40, "ppo": 20}, "compute": {"online_dpo": 10, "ppo": 10}}


def row_loop(s: dict) -> dict:
    """One raypai run of `s["loop"]` on a local Ray of this process; its step time."""
    import ray

    from raypai.alignment import DPOConfig, PPOConfig, run_dpo, run_ppo
    from raypai.alignment.data import preference_examples, prompt_examples
    from raypai.alignment.tasks import arithmetic as ar
    from raypai.runtime import ensure_ray
    from raypai.settings import Settings

    train, held = h.problems(64, s["seed"])
    prompts, held_prompts = (prompt_examples(ar.prompt_rows(x, True)) for x in (train, held))
    out, log = str(Path(s["out"]) / s["name"]), h.Steps()
    ensure_ray(Settings.load(), local=True, num_cpus=8, dashboard=False, log_to_driver=False)  # free ports
    try:
        if s["loop"] == "online_dpo":
            pairs = preference_examples(ar.preference_rows(held, seed=s["seed"], per_problem=1))
            cfg = DPOConfig(
                steps=s["steps"], batch_size=8, num_samples=4, lr=1e-6, online=True, max_new_tokens=s["max_new_tokens"]
            )
            run_dpo(
                s["model_dir"],
                out,
                [],
                pairs,
                cfg,
                prompts=prompts,
                held_out=held_prompts[:4],
                rewards=[h.length_mod_5],
                run_name="bench-online-dpo",
                logger=log,
            )
        else:
            cfg = PPOConfig(steps=s["steps"], prompts_per_step=8, max_new_tokens=s["max_new_tokens"], lr=1e-6)
            run_ppo(
                s["model_dir"],
                out,
                prompts,
                held_prompts[:4],
                cfg,
                rewards=[h.reward_fn(s["reward"])],
                run_name="bench-ppo",
                logger=log,
            )
    finally:
        ray.shutdown()
    steady = len(log.stamps) - 1
    return {
        "step_ms": (log.stamps[-1] - log.stamps[0]) / steady * 1000,
        "steps_logged": len(log.stamps),
        "in_process_s": h.process_age_s(),
        "compute_dtype": cfg.dtype(s["model_dir"]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--one", help=argparse.SUPPRESS)  # child mode: one row, spec as JSON
    ap.add_argument("--workload", choices=("toy", "compute", "both"), default="both")
    ap.add_argument("--only", choices=LOOPS, default=None)
    ap.add_argument("--rounds", type=int, default=3, help="every row this many times, interleaved")
    ap.add_argument("--steps", type=int, default=0, help="steps of every loop (0: 40/20 toy, 10/10 compute)")
    ap.add_argument("--max-new-tokens", type=int, default=0, help="0: the workload's (16 toy / 64 compute)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ray-wait", type=float, default=60, help="seconds a row waits for the last row's Ray to exit")
    ap.add_argument("--row-timeout", type=float, default=1800)
    ap.add_argument(
        "--smoke", action="store_true", help="each row once at tiny sizes: proves the harness, measures nothing"
    )
    args = ap.parse_args()
    if args.one:
        s = json.loads(args.one)
        row = h.build_workload(s["workload"], Path(s["out"]), s["seed"]) if s["kind"] == "build" else row_loop(s)
        return h.emit_child(row)
    if args.smoke:
        args.rounds, args.steps, args.max_new_tokens = 1, 3, args.max_new_tokens or 8
    h.stop_rows_on_sigterm()
    script = str(Path(__file__).resolve())
    out = tempfile.mkdtemp(prefix="align-online-")  # model folders and run outputs, removed at the end
    try:
        parent(args, script, out)
    finally:
        shutil.rmtree(out, ignore_errors=True)


def parent(args, script: str, out: str) -> None:
    """The rows of every round, each in its own process, then the summaries."""
    workloads = ["toy", "compute"] if args.workload == "both" else [args.workload]
    foreign = frozenset(p["pid"] for p in h.ray_processes())  # someone else's Ray: counted in each row
    if foreign:
        h.emit({"result": "warning", "ray_processes_before_start": len(foreign), "note": "not a quiet machine"})
    models = {}
    for wl in workloads:
        built = h.run_row(
            script,
            {"kind": "build", "name": f"build_{wl}", "workload": wl, "out": out, "seed": args.seed},
            foreign=foreign,
        )
        if "error" in built:
            raise SystemExit(f"building the {wl} workload failed: {built['error']}")
        h.emit({**built, "result": f"workload_{wl}"})
        models[wl] = built["model_dir"]
    rows = []
    for rnd in range(1, args.rounds + 1):
        for wl in workloads:
            w = h.WORKLOADS[wl]
            for loop in LOOPS if args.only is None else (args.only,):
                spec = {
                    "kind": "loop",
                    "name": f"{wl}_raypai_{loop}",
                    "loop": loop,
                    "workload": wl,
                    "model_dir": models[wl],
                    "out": out,
                    "seed": args.seed,
                    "reward": w["reward"],
                    "steps": args.steps or STEPS[wl][loop],
                    "max_new_tokens": args.max_new_tokens or w["max_new_tokens"],
                }
                row = h.run_row(script, spec, timeout_s=args.row_timeout, ray_wait_s=args.ray_wait, foreign=foreign)
                keep = ("workload", "loop", "steps", "max_new_tokens")
                row = {**row, "round": rnd, "dtype": "fp32", **{k: spec[k] for k in keep}}
                rows.append(row)
                h.emit(row)
    for name in dict.fromkeys(r["result"] for r in rows):
        mine = [r for r in rows if r["result"] == name]
        h.emit(
            {
                "result": f"summary_{name}",
                "rounds": len(mine),
                "step_ms": h.median_of(mine, "step_ms"),
                "wall_s": h.median_of(mine, "wall_s"),
                "rows_started_with_ray_alive": sum(1 for r in mine if r.get("ray_processes_at_start")),
                "failed_rows": sum(1 for r in mine if "error" in r),
            }
        )


if __name__ == "__main__":
    main()
