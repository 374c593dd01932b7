"""Trained and frozen roles as groups of ranks on CPU (gloo, real Ray actors and DeepSpeed): a 2-rank
update at ZeRO-2 and ZeRO-3 equals the 1-rank update of the same global batch, with micro-batches
and with fewer rows than ranks too; each ZeRO-3 rank holds about half of the parameters; a ZeRO-3
run's export loads in plain transformers with the trainer's weights; a 2-rank reference gives the
1-rank log-probs; and a run whose rank is killed fails within its collective timeout naming the
rank, and its re-run resumes from the last checkpoint to the same result as a run never killed.
The runs compared for equality are fp32 (`precision="fp32"`): bf16 rounding differs with how the
rows are split over ranks (test_precision covers bf16 against fp32)."""

import random
import shutil
import threading
import time
from pathlib import Path

import pytest
import ray
import torch
from transformers import AutoModelForCausalLM

from raypai.alignment import SFTConfig, run_sft
from raypai.alignment._driver import RankFailure, Run
from raypai.alignment._tensors import batch_of, encode_all
from raypai.alignment.checkpoint import has_checkpoint, latest_tag
from raypai.alignment.config import DPOConfig
from raypai.alignment.data import sft_examples
from raypai.alignment.losses.objectives import SFT
from raypai.alignment.models import format_and_limit
from raypai.alignment.placement import RoleSpec
from raypai.alignment.tasks import arithmetic as ar

pytestmark = pytest.mark.integration
TRAIN, HELD = ar.split()
EXAMPLES = sft_examples(ar.sft_rows(TRAIN))


@pytest.fixture(scope="module")
def ray8(shared_ray):
    return shared_ray(num_cpus=8)


PLAIN = sft_examples(ar.sft_rows(TRAIN, chat=False))  # for a tokenizer without a chat template (GPT-2)


def batches(model_dir: str, sizes: list[int], seed: int = 0, examples=EXAMPLES) -> list[dict]:
    fmt, trunc = format_and_limit(model_dir, SFTConfig())
    enc = encode_all(fmt, examples, trunc, "training")
    rng = random.Random(seed)
    return [batch_of(enc, [rng.randrange(len(enc)) for _ in range(n)], fmt.tok.pad_token_id) for n in sizes]


def trained(model_dir: str, cfg: SFTConfig, steps: list[dict], name: str, export_to=None):
    """The policy's weights after one update per batch of `steps` (and its per-rank memory)."""
    with Run(name, {"policy": RoleSpec(cpus=0.5, replicas=cfg.ranks)}) as run:
        policy = run.place_policy(model_dir, cfg)
        metrics = [ray.get(policy.update.remote(SFT(), SFT().assemble(b))) for b in steps]
        state = ray.get(policy.state_dict.remote())
        actors = getattr(policy, "actors", [policy])
        memory = ray.get([a.rank_memory.remote() for a in actors])
        if export_to is not None:
            ray.get(policy.export.remote(str(export_to)))
        run.summary = None
    return state, metrics, memory


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def off_by(a: dict, b: dict, start: dict) -> float:
    """How far weights `b` are from `a`, relative to how far `a` moved from `start` (2-norms over all
    weights). Not the largest difference of one weight: AdamW's step is g / (√v + ε), so a gradient
    entry that is ~ε (a float cancellation, 1e-8) moves its weight by an unstable fraction of the
    learning rate; the gradients themselves are compared through the steps' `grad_norm` and `loss`."""
    diff = sum(float((a[k].float() - b[k].float()).pow(2).sum()) for k in a)
    moved = sum(float((a[k].float() - start[k].float()).pow(2).sum()) for k in a)
    return (diff / moved) ** 0.5


def same_steps(m1: list, m2: list) -> None:
    for a, b in zip(m1, m2, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), (m1, m2)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5), (m1, m2)


@pytest.mark.parametrize("stage", [2, 3])
def test_two_ranks_update_as_one_rank_does(ray8, tiny_model, stage):
    steps = batches(tiny_model, [6, 5, 1])  # an odd batch, and one row for two ranks (one rank idles)
    one, m1, mem1 = trained(tiny_model, SFTConfig(precision="fp32", lr=1e-2, zero_stage=stage), steps, f"one-{stage}")
    two, m2, mem2 = trained(
        tiny_model, SFTConfig(precision="fp32", lr=1e-2, zero_stage=stage, ranks=2), steps, f"two-{stage}"
    )
    start = AutoModelForCausalLM.from_pretrained(tiny_model).state_dict()
    assert max_diff(one, start) > 1e-3  # the updates moved the weights
    same_steps(m1, m2)
    assert off_by(one, two, start) < 1e-4, off_by(one, two, start)
    # micro-batches of 2 rows on each of the 2 ranks (the same number on both: one rank's last is empty
    # for the 5-row batch): the same update again
    micro, m3, _ = trained(
        tiny_model,
        SFTConfig(precision="fp32", lr=1e-2, zero_stage=stage, ranks=2, micro_batch=2),
        steps,
        f"micro-{stage}",
    )
    same_steps(m1, m3)
    assert off_by(one, micro, start) < 1e-4, off_by(one, micro, start)
    # and a wrong update is far off: the batches' last step left out
    fewer, _, _ = trained(
        tiny_model, SFTConfig(precision="fp32", lr=1e-2, zero_stage=stage, ranks=2), steps[:2], f"fewer-{stage}"
    )
    assert off_by(one, fewer, start) > 0.1
    if stage == 3:
        # each rank holds about half of the parameters (its partitions), together all of them
        whole = mem1[0]["params"]
        halves = [m["params"] for m in mem2]
        assert all(h < 0.6 * whole for h in halves), (halves, whole)
        assert sum(halves) >= 0.99 * whole


@pytest.mark.parametrize("family", ["qwen2", "gpt2"])
def test_zero3_ranks_of_other_families_update_and_export_as_one_rank(ray8, tmp_path, family):
    """Qwen2 (biased q/k/v projections) and GPT-2 (Conv1D layers, the LM head tied to the token
    embeddings, learned positions): 2 ZeRO-3 ranks take the 1-rank ZeRO-0 steps, and the export
    gathered from their shards loads in transformers with the trained weights."""
    from raypai.alignment.tasks.tiny import build_tiny_model

    model_dir = build_tiny_model(tmp_path / family, family=family)
    steps = batches(model_dir, [6, 3], examples=PLAIN if family == "gpt2" else EXAMPLES)
    one, m1, _ = trained(model_dir, SFTConfig(precision="fp32", lr=1e-2), steps, f"{family}-one")
    two, m2, mem2 = trained(
        model_dir, SFTConfig(precision="fp32", lr=1e-2, zero_stage=3, ranks=2), steps, f"{family}-two", tmp_path / "out"
    )
    start = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    assert max_diff({k: start[k] for k in one}, one) > 1e-3
    same_steps(m1, m2)
    assert off_by(one, two, start) < 1e-4, off_by(one, two, start)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").state_dict()
    assert max_diff({k: loaded[k] for k in two}, two) == 0.0
    assert all(m["params"] < 0.65 * sum(x["params"] for x in mem2) for m in mem2)


def _replica_state(rollout) -> dict:
    return {k: v.detach().clone() for k, v in rollout.model.state_dict().items()}


@pytest.mark.parametrize("family", ["llama3", "qwen2", "gpt2", "phi3"])
def test_a_zero3_policy_syncs_to_two_replicas_bucket_by_bucket(ray8, tmp_path, tiny_family, family):
    """A 2-rank ZeRO-3 policy writes its weights into the replicas' shared buffer gathered a few KB
    of parameters at a time (never as one whole state dict first): both replicas then hold exactly
    the trained weights, and after a second update and sync the second ones. Llama-3, Qwen2 (biased
    q/k/v), GPT-2 (Conv1D layers, the LM head tied to the token embeddings, learned positions) and
    Phi-3 (fused qkv_proj / gate_up_proj)."""
    from raypai.alignment.roles import Rollout
    from raypai.alignment.sync import sync_weights

    model_dir = tiny_family(family, tmp_path / family)
    steps = batches(model_dir, [4, 4], examples=PLAIN if family == "gpt2" else EXAMPLES)
    specs = {"policy": RoleSpec(cpus=0.5, replicas=2), "rollout": RoleSpec(cpus=0.5, replicas=2)}
    with Run(f"sync3-{family}", specs) as run:
        policy = run.place_policy(model_dir, SFTConfig(precision="fp32", lr=1e-2, zero_stage=3, ranks=2))
        rollouts = run.place("rollout", Rollout, model_dir)
        ray.get([a.__ray_call__.remote(lambda t: setattr(t, "sync_bucket_bytes", 4096)) for a in policy.actors])
        states = []
        for b in steps:
            ray.get(policy.update.remote(SFT(), SFT().assemble(b)))
            out = sync_weights(policy, rollouts)
            replicas = ray.get([r.__ray_call__.remote(_replica_state) for r in rollouts])
            states.append((ray.get(policy.state_dict.remote()), replicas))
        buckets = ray.get(policy.actors[0].__ray_call__.remote(lambda t: t.sync_buckets))
        run.summary = None
    assert out["sync_bytes"] > 0 and buckets > 5, buckets  # a tiny model's ~100 KB in 4 KB buckets
    start = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    for want, replicas in states:
        assert len(replicas) == 2
        for got in replicas:
            assert max_diff(want, {k: got[k] for k in want}) == 0.0
        assert max_diff({k: start[k] for k in want}, want) > 1e-3  # the weights synced are the trained ones
    assert max_diff(states[0][0], states[1][0]) > 0  # and the second sync carried the second update


def test_zero3_export_loads_in_transformers_with_the_trainers_weights(ray8, tiny_model, tmp_path):
    steps = batches(tiny_model, [4, 4])
    state, _, _ = trained(
        tiny_model, SFTConfig(precision="fp32", lr=1e-2, zero_stage=3, ranks=2), steps, "export3", tmp_path / "out"
    )
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").state_dict()
    assert max_diff({k: loaded[k] for k in state}, state) == 0.0
    start = AutoModelForCausalLM.from_pretrained(tiny_model).state_dict()
    assert max_diff({k: start[k] for k in state}, state) > 1e-3


def test_two_rank_reference_gives_the_one_rank_logprobs(ray8, tiny_model):
    [batch] = batches(tiny_model, [7])
    out = []
    for n in (1, 2):
        cfg = DPOConfig(precision="fp32", reference_ranks=n)
        with Run(f"ref{n}", {"reference": RoleSpec(cpus=0.5, replicas=n)}) as run:
            ref = run.place_reference(tiny_model, cfg, policy=None)
            out.append(ray.get(ref.logprobs.remote(batch)))
    assert out[0].shape == out[1].shape == (7, batch["input_ids"].shape[1] - 1)
    assert torch.equal(out[0], out[1])
    assert (out[0] != 0).any()


def test_zero3_reference_ranks_hold_half_the_weights_and_give_the_same_logprobs(ray8, tiny_model):
    """ZeRO-3 inference: 2 ranks, each holding about half the weights (never the whole model), give
    the 1-rank log-probs; 7 rows and 1 row (one rank idles but still runs the forward's gathers)."""
    batch, one_row = batches(tiny_model, [7, 1])
    with Run("ref1", {"reference": RoleSpec(cpus=0.5)}) as run:
        ref = run.place_reference(tiny_model, DPOConfig(precision="fp32"), policy=None)
        want, want_one, whole = ray.get(
            [ref.logprobs.remote(batch), ref.logprobs.remote(one_row), ref.param_bytes.remote()]
        )
    with Run("ref3", {"reference": RoleSpec(cpus=0.5, replicas=2)}) as run:
        ref = run.place_reference(
            tiny_model, DPOConfig(precision="fp32", reference_ranks=2, reference_zero3=True), policy=None
        )
        got, got_one = ray.get(ref.logprobs.remote(batch)), ray.get(ref.logprobs.remote(one_row))
        held = ray.get([a.param_bytes.remote() for a in ref.actors])
    assert got.shape == want.shape and got_one.shape == want_one.shape
    assert torch.allclose(got, want, atol=1e-5), float((got - want).abs().max())
    assert torch.allclose(got_one, want_one, atol=1e-5)
    assert all(h < 0.6 * whole for h in held) and sum(held) >= 0.99 * whole, (held, whole)


def test_two_rank_reward_scores_as_one_rank_and_fails_as_one(ray8, tiny_model, tmp_path):
    """Rule functions and a reward model, 5 rows over 2 ranks (3 + 2): the scores of one rank, in row
    order; a function that fails on a row of the second rank's share fails the call on every rank
    (a RewardError naming it), not a hang."""
    from transformers import AutoModelForSequenceClassification

    from raypai.alignment.rewards import RewardError
    from raypai.alignment.roles import Reward

    def _length(prompts, completions, **_):  # defined here: Ray ships it to the ranks by value
        return [float(len(c[0]["content"])) for c in completions]

    def _fails_on_z(prompts, completions, **_):
        if any("z" in c[0]["content"] for c in completions):
            raise ValueError("cannot score z")
        return [1.0] * len(completions)

    rm = AutoModelForSequenceClassification.from_pretrained(tiny_model, num_labels=1)
    rm.save_pretrained(tmp_path / "rm")
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (Path(tiny_model) / f).exists():
            shutil.copy(Path(tiny_model) / f, tmp_path / "rm" / f)
    prompts = [[{"role": "user", "content": f"q{i}"}] for i in range(5)]
    completions = ["a", "bbb", "cc", "dddd", "e"]
    one = Reward([(_length, 0.5)], str(tmp_path / "rm"), 2.0).score(prompts, completions)
    cfg = DPOConfig(reward_ranks=2)
    with Run("reward2", {"reward": RoleSpec(cpus=0.5, replicas=2)}) as run:
        reward = run.place_reward(cfg, [(_length, 0.5), (_fails_on_z, 1.0)], str(tmp_path / "rm"), 2.0)
        two = ray.get(reward.score.remote(prompts, completions))
        with pytest.raises(RewardError, match="_fails_on_z"):
            ray.get(reward.score.remote(prompts, ["a", "b", "c", "d", "z"]))
        assert ray.get(reward.score.remote(prompts[:1], ["a"]))["_length"] == [1.0]  # one rank idles
    assert two["_length"] == one["_length"] == [1.0, 3.0, 2.0, 4.0, 1.0]
    assert two["reward_model"] == pytest.approx(one["reward_model"], abs=1e-5)
    assert len(set(one["reward_model"])) > 1  # the model tells the rows apart
    assert two["total"] == pytest.approx([t + 1.0 for t in one["total"]], abs=1e-5)


def test_a_killed_rank_fails_the_run_in_time_and_the_rerun_resumes(ray8, tiny_model, tmp_path):
    cfg = SFTConfig(steps=40, batch_size=4, lr=3e-3, ranks=2, checkpoint_every=4, collective_timeout_s=30)
    held = sft_examples(ar.sft_rows(HELD))[:8]
    ckpt = tmp_path / "ckpt"
    killed = {}

    def kill_after_a_checkpoint():
        while not (has_checkpoint(ckpt) and latest_tag(ckpt / "policy") >= "step-000008"):
            time.sleep(0.05)
        ray.kill(ray.get_actor("killed/policy-1"))
        killed["at"] = time.monotonic()

    t = threading.Thread(target=kill_after_a_checkpoint, daemon=True)
    t.start()
    with pytest.raises(RankFailure, match=r"rank 1 of killed/policy died") as err:
        run_sft(tiny_model, str(tmp_path / "a"), EXAMPLES, held, cfg, run_name="killed", checkpoint_dir=str(ckpt))
    failed_after = time.monotonic() - killed["at"]
    assert failed_after < cfg.collective_timeout_s + 15, failed_after
    assert "resume" in str(err.value)
    resumed_from = int(latest_tag(ckpt / "policy").split("-")[1])
    assert 8 <= resumed_from < cfg.steps

    # the re-run resumes there and ends where a run never killed ends (same data, same updates)
    resumed = run_sft(tiny_model, str(tmp_path / "b"), EXAMPLES, held, cfg, run_name="rerun", checkpoint_dir=str(ckpt))
    whole = run_sft(tiny_model, str(tmp_path / "c"), EXAMPLES, held, cfg, run_name="whole")
    assert resumed["eval_response_loss_before"] == whole["eval_response_loss_before"]
    assert resumed["eval_response_loss_after"] == pytest.approx(whole["eval_response_loss_after"], rel=1e-5)
    assert whole["eval_response_loss_after"] < 0.7 * whole["eval_response_loss_before"]  # and it learned
    assert whole["ranks_policy"] == 2


def test_lora_on_two_ranks_updates_as_on_one_and_exports_the_merged_model(ray8, tiny_model, tmp_path):
    """LoRA adapters trained by a 2-rank ZeRO-2 policy: the same adapters as one rank's (the base
    untouched), and the export on rank 0 is the merged model plus the PEFT adapter."""
    from peft import PeftModel

    steps = batches(tiny_model, [6, 5])
    cfg = dict(precision="fp32", lr=1e-2, zero_stage=2, lora_r=4)
    one, m1, _ = trained(tiny_model, SFTConfig(**cfg), steps, "lora-one")
    two, m2, _ = trained(tiny_model, SFTConfig(**cfg, ranks=2), steps, "lora-two", tmp_path / "out")
    assert set(one) == set(two) and all("lora_" in k for k in one["lora"])
    same_steps(m1, m2)
    zero = {k: torch.zeros_like(v) for k, v in one["lora"].items()}
    assert off_by(one["lora"], two["lora"], zero) < 1e-4
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    base = AutoModelForCausalLM.from_pretrained(tiny_model)
    adapted = PeftModel.from_pretrained(base, str(tmp_path / "out-adapter")).eval()
    ids = torch.tensor([[3, 17, 42, 99, 5, 8, 21]])
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, adapted(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
