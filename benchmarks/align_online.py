"""Online DPO and PPO step time on issue #14's benchmark model (raypai only: no TRL baseline, and
no target of the issue; the figures compare raypai's own versions, run from frozen copies of the
tree, interleaved).

    .venv/bin/python benchmarks/align_online.py                  # both loops, 3 rounds; one JSON line per run
    .venv/bin/python benchmarks/align_online.py --only online_dpo --rounds 6

The model and prompts are `align_grpo.py`'s (0.79 M-parameter Llama, raypai's tokenizer and chat
template, `a+b=` prompts), 8 prompts a step, at most 16 new tokens, lr 1e-6.
- online DPO: 4 samples a prompt, 40 steps, best vs worst of each group. The reward is the
  completion text's length mod 5, so that a random model's samples are told apart (the exact-answer
  rule would tie every group, and a tied step makes no update);
- PPO: one sample a prompt, 2 epochs (the default), 20 steps, the exact-answer rule.
`step_ms`: from the end of the first logged step to the end of the last, per logged step.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")


def length_mod_5(prompts, completions, **_) -> list[float]:
    """A reward that tells a random model's samples apart: the completion's text length mod 5."""
    return [float(len(str(c)) % 5) for c in completions]


def main() -> None:
    import align_grpo as bench

    from raypai.alignment import DPOConfig, PPOConfig, run_dpo, run_ppo
    from raypai.alignment.data import preference_examples, prompt_examples
    from raypai.alignment.tasks import arithmetic as ar
    from raypai.alignment.tasks.tiny import build_tiny_model
    from raypai.runtime import ensure_ray
    from raypai.settings import Settings

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=("online_dpo", "ppo"), default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import ray

    out = Path(tempfile.mkdtemp(prefix="align-online-"))
    model = build_tiny_model(out / "model", hidden=128, layers=4, heads=4, kv_heads=2, vocab_size=512, seed=args.seed)
    ensure_ray(Settings.load(), local=True, num_cpus=8, dashboard=False, log_to_driver=False)
    train, held = bench.workload(64, args.seed)
    prompts, held_prompts = (prompt_examples(ar.prompt_rows(x, True)) for x in (train, held))
    pairs = preference_examples(ar.preference_rows(held, seed=args.seed, per_problem=1))
    loops = {
        "online_dpo": lambda log, k: run_dpo(
            model,
            str(out / f"odpo-{k}"),
            [],
            pairs,
            DPOConfig(steps=40, batch_size=8, num_samples=4, lr=1e-6, online=True, max_new_tokens=16),
            prompts=prompts,
            held_out=held_prompts[:4],
            rewards=[length_mod_5],
            run_name="bench-online-dpo",
            logger=log,
        ),
        "ppo": lambda log, k: run_ppo(
            model,
            str(out / f"ppo-{k}"),
            prompts,
            held_prompts[:4],
            PPOConfig(steps=20, prompts_per_step=8, max_new_tokens=16, lr=1e-6),
            rewards=[ar.exact_match_reward],
            run_name="bench-ppo",
            logger=log,
        ),
    }
    try:
        for rnd in range(1, args.rounds + 1):
            for name, loop in loops.items():
                if args.only not in (None, name):
                    continue
                log, t0 = bench.Steps(), time.perf_counter()
                loop(log, rnd)
                steady = len(log.stamps) - 1
                bench.emit(
                    {
                        "result": f"raypai_{name}",
                        "step_ms": (log.stamps[-1] - log.stamps[0]) / steady * 1000,
                        "steps_logged": len(log.stamps),
                        "wall_s_incl_startup": time.perf_counter() - t0,
                        "round": rnd,
                        "cpus": os.cpu_count(),
                        "load_avg_1m": os.getloadavg()[0],
                    }
                )
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
