"""Small pieces every RL driver loop shares: sampling across rollout replicas, reward rows, a
section timer and the run summary."""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import dataclass

import ray
import torch

from raypai.alignment._order import gather_completions
from raypai.alignment._order import sample_rows as _sample_rows
from raypai.alignment._tensors import pad, select_rows
from raypai.errors import RaypaiError


@dataclass
class Samples:
    batch: dict  # right-padded input_ids / attention_mask (B, T), response_mask (B, T−1)
    prompts: list  # (B,) the prompt of every sample (a string or messages), n consecutive samples per prompt
    completions: list[str]  # (B,) decoded completions (without the stop token)
    rows: dict  # per-sample extra dataset columns for the reward functions, e.g. {"answer": [...]}
    behaviour_lp: torch.Tensor | None = None  # (B, T−1) log-probs under the weights that sampled them
    weights_version: int = 0  # the oldest trainer update count among the replicas that sampled


@dataclass
class Pending:
    """Generation in flight on the rollout replicas (`launch`), not yet waited for (`collect`)."""

    refs: list  # one ObjectRef per replica that got work
    order: list  # the problems, in the order of the samples after `collect`
    n: int
    rows: list | None = None  # (replica, row) of each sample in that order; None = the replicas' concatenation

    def prompts(self) -> list:
        """The prompt of every sample, in the samples' order."""
        return [p.prompt for p in self.order for _ in range(self.n)]

    def extras(self) -> dict:
        """The problems' extra dataset columns, one value per sample (the reward functions' keywords)."""
        return {
            k: [p.extras[k] for p in self.order for _ in range(self.n)]
            for k in (self.order[0].extras if self.order else {})
        }


def gather_batch(outs: list[dict], rows: list | None, pad_id: int) -> dict:
    """The rollout replicas' outputs (`Rollout.generate`) as one right-padded training batch, its rows
    in the samples' order (`Pending.rows`)."""
    rows = _sample_rows(outs, rows)
    return pad([outs[i]["seqs"][j] for i, j in rows], [outs[i]["masks"][j] for i, j in rows], pad_id)


def handed_over(sampled: dict, outs: tuple) -> dict:
    """The training batch of a generation as Ray hands it to a role: the rollout replicas' outputs
    (`Rollout.generate`) padded in the samples' order. `sampled`: {"rows": `Pending.rows`, "pad_id"}."""
    return gather_batch(list(outs), sampled["rows"], sampled["pad_id"])


def best_vs_worst_index(scores: list[float], n: int) -> list[tuple[int, int]]:
    """Online DPO pairs (Guo et al. 2024, "Direct language model alignment from online AI feedback"):
    per group of n samples of one prompt, the best-scored sample is chosen and the worst rejected;
    groups whose scores all tie carry no preference and are skipped. Returns (chosen, rejected) indices."""
    pairs = []
    for g in range(0, len(scores), n):
        sc = scores[g : g + n]
        best, worst = max(range(len(sc)), key=sc.__getitem__), min(range(len(sc)), key=sc.__getitem__)
        if sc[best] > sc[worst]:
            pairs.append((g + best, g + worst))
    return pairs


def ranked_pairs(scores: dict, sampled: dict, *outs: dict) -> tuple[dict, dict] | None:
    """Online DPO's pairs of a generation as Ray hands it over: the rollout replicas' `outs`
    (`Rollout.generate`) in the samples' order, and per group of `sampled["n"]` samples of one prompt
    the best-scored as chosen and the worst as rejected (`best_vs_worst_index` on the Reward actor's
    `scores`), as (chosen, rejected) right-padded batches of the sampled token ids themselves (no
    re-tokenization); None when every group ties. `sampled`: {"rows": `Pending.rows`, "pad_id", "n"}.
    The Reference and the trainer both call it on the same inputs, so they take the same pairs."""
    idx = best_vs_worst_index(scores["total"], sampled["n"])
    if not idx:
        return None
    batch = handed_over(sampled, outs)
    return select_rows(batch, [i for i, _ in idx]), select_rows(batch, [j for _, j in idx])


def pair_logprobs(logprobs, scores: dict, sampled: dict, *outs: dict):
    """Summed response log-probs (chosen (P,), rejected (P,)) under `logprobs` (a role's batch →
    (B, T−1) function) of online DPO's pairs of a generation as Ray hands it over (`ranked_pairs`);
    None when every group ties. Chosen and rejected rows run as one batch, so each shared prompt
    runs once."""
    from raypai.alignment._tensors import sequence_logprob, stack_right_padded

    pairs = ranked_pairs(scores, sampled, *outs)
    if pairs is None:
        return None
    both = stack_right_padded(*pairs)
    seq = sequence_logprob(logprobs(both), both["response_mask"])
    n = pairs[0]["input_ids"].shape[0]
    return seq[:n], seq[n:]


def launch(
    rollouts: list,
    problems: list,
    n: int,
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    logprobs: bool = False,
) -> Pending:
    """Start sampling n completions per prompt (PromptExample) on the rollout replicas; returns at
    once. With at least as many prompts as replicas each replica takes whole groups; with fewer (one
    prompt × a group of 8 on two replicas) the groups' samples are split across the replicas and
    `collect` puts every group back together."""
    gen = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p, "logprobs": logprobs}
    R = len(rollouts)
    if len(problems) >= R or n < R:
        chunks = [problems[i::R] for i in range(R)]
        refs = [r.generate.remote([p.prompt for p in c], n=n, **gen) for r, c in zip(rollouts, chunks) if c]
        return Pending(refs, [p for c in chunks for p in c], n)
    counts = [n // R + (i < n % R) for i in range(R)]  # every replica samples every prompt, counts[i] times
    refs = [r.generate.remote([p.prompt for p in problems], n=k, **gen) for r, k in zip(rollouts, counts)]
    rows = [(r, j * counts[r] + s) for j in range(len(problems)) for r in range(R) for s in range(counts[r])]
    return Pending(refs, list(problems), n, rows)


def collect(pending: Pending, *, pad_id: int) -> Samples:
    """Wait for a launched generation and pad it into one training batch."""
    outs = ray.get(pending.refs)
    rows = _sample_rows(outs, pending.rows)
    batch = gather_batch(outs, rows, pad_id)
    behaviour = None
    if outs and "logprobs" in outs[0]:  # each replica's (B_i, T_i−1), right-aligned like the batch: pad to (B, T−1)
        behaviour = torch.zeros(batch["response_mask"].shape)
        for row, (i, j) in enumerate(rows):
            lp = outs[i]["logprobs"][j]
            behaviour[row, : lp.shape[0]] = lp
    return Samples(
        batch,
        pending.prompts(),
        gather_completions(outs, rows),
        pending.extras(),
        behaviour,
        min((o.get("weights_version", 0) for o in outs), default=0),
    )


def score(reward, prompts: list, completions: list[str], rows: dict) -> dict:
    """The Reward actor's scores; a reward function's own error (wrong length, NaN) is raised as
    itself, naming the function and the sample, not wrapped in Ray's task error."""
    return scores_of(reward.score.remote(prompts, completions, rows))


def score_launched(reward, pending: Pending):
    """The Reward actor's scores of a launched generation, as an ObjectRef (`scores_of` waits for it):
    Ray hands the replicas' outputs to the reward actor as soon as they are in, and the scores on to
    whatever task takes this ref (the update), without a round trip through this process."""
    return reward.score_outputs.remote(pending.prompts(), pending.extras(), pending.rows, *pending.refs)


def scores_of(ref) -> dict:
    """Wait for the Reward actor's scores; a reward function's own error is raised as itself (`score`)."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, RaypaiError):
            raise e.cause from None
        raise


class Sections:
    """`with sections("rollout"): ...` accumulates wall seconds per named section of one step."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._t0 = time.perf_counter()

    def __call__(self, name: str):
        return _Section(self, name)

    def total(self) -> float:
        return time.perf_counter() - self._t0


class _Section:
    def __init__(self, owner: Sections, name: str):
        self.owner, self.name = owner, name

    def __enter__(self):
        self.t0 = time.perf_counter()

    def __exit__(self, *exc):
        self.owner.seconds[self.name] = self.owner.seconds.get(self.name, 0.0) + time.perf_counter() - self.t0


def response_length(batch: dict) -> float:
    return batch["response_mask"].sum(1).float().mean().item()


def throughput(history: list[dict]) -> float:
    """Samples per second over the whole run (not a mean of per-step rates)."""
    seconds = sum(h["step_seconds"] for h in history)
    return sum(h["samples"] for h in history) / seconds if seconds else 0.0


def rl_summary(eval_before: float, eval_after: float, history: list[dict], keys) -> dict:
    """An RL run's summary: the held-out reward before and after, the steps run, samples/s over the
    whole run and the mean of each of `keys` over the steps."""
    return {
        "eval_reward_before": eval_before,
        "eval_reward_after": eval_after,
        "steps_run": len(history),
        "samples_per_s": throughput(history),
        **mean_of(history, keys),
        **sync_spread(history),
    }


def sync_spread(history: list[dict]) -> dict:
    """How steady the weight sync was: its median and 99th percentile over the steps (nearest rank)
    and its share of the steps' wall time (`sync_share`), where the steps logged `sync_seconds`."""
    vals = sorted(h["sync_seconds"] for h in history if "sync_seconds" in h)
    if not vals:
        return {}
    rank = lambda q: vals[min(len(vals) - 1, max(0, math.ceil(q * len(vals)) - 1))]  # noqa: E731
    wall = sum(h.get("step_seconds", 0.0) for h in history if "sync_seconds" in h)
    return {
        "p50_sync_seconds": rank(0.5),
        "p99_sync_seconds": rank(0.99),
        "sync_share": sum(vals) / wall if wall > 0 else 0.0,
    }


def mean_of(history: list[dict], keys) -> dict:
    """{"mean_<k>": average over the steps that logged k}."""
    out = {}
    for k in keys:
        vals = [h[k] for h in history if k in h]
        if vals:
            out[f"mean_{k}"] = sum(vals) / len(vals)
    return out


def end_step(
    algo: str,
    step: int,
    metrics: dict,
    *,
    steps: int,
    eval_every: int,
    evaluate,
    checkpoint_every: int,
    checkpoint,
    logger,
    history: list,
) -> None:
    """An RL loop's end of step: every `eval_every` steps the held-out reward (`evaluate()`), every
    `checkpoint_every` steps a checkpoint (`checkpoint(step)` → seconds; None: no checkpoints), then
    the metrics logged and kept."""
    if step % eval_every == 0:
        metrics["eval_reward"] = evaluate()
        print(
            f"[raypai.{algo}] step {step}/{steps} reward {metrics['reward_mean']:.3f} "
            f"held-out reward {metrics['eval_reward']:.3f}",
            flush=True,
        )
    if checkpoint is not None and step % checkpoint_every == 0:
        metrics["checkpoint_seconds"] = checkpoint(step)
    if logger is not None:
        logger.log_metrics(metrics, step=step)
    history.append(metrics)


def to_tensor(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


@contextmanager
def asleep(trainers: list, on_gpu: bool):
    """The block (the rollout sampling) runs with the trainers' weights, gradients and optimizer
    state in host memory, so the colocated rollout has the GPU's memory for its KV cache; each
    trainer's wake is queued after, ahead of its next update (an actor runs its calls in order).
    Yields offload_bytes (summed) and offload_seconds (the slowest sleep). CPU runs: nothing happens."""
    if not on_gpu:
        yield {}
        return
    slept = ray.get([t.sleep.remote() for t in trainers])
    try:
        yield {
            "offload_bytes": sum(s["offload_bytes"] for s in slept),
            "offload_seconds": max(s["offload_seconds"] for s in slept),
        }
    finally:
        for t in trainers:
            t.wake.remote()
