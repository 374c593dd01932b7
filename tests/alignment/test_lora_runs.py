"""LoRA through Ray, end to end, on tiny Llama-3, GPT-2 and Qwen2 models: SFT, DPO and GRPO with
β > 0 each learn with adapters only (the held-out metric moves the right way, by a margin a run that
did not learn cannot reach), with no Reference actor placed (the reference is the policy's base with
its adapters off), GRPO's rollout replicas take the adapter factors alone at each sync, and every run
writes the merged model and the PEFT adapter beside it. A pipeline step saves both as artifacts.

LoRA adapts a trained model: on a random-init one its frozen embeddings and head (every logit within
±1.7) keep the response loss near log(vocab) whatever the adapters do. So each family's base is
first fine-tuned in full (module fixture, 150 steps) on answers of which 70 % carry a stray "~"
before the number, a habit its greedy answers then all show; the LoRA runs start from it."""

import json
import random
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from ray.util.state import list_actors

from raypai.alignment import DPOConfig, GRPOConfig, SFTConfig, run_dpo, run_grpo, run_sft
from raypai.alignment.data import preference_examples, prompt_examples, sft_examples
from raypai.alignment.tasks import arithmetic as ar
from raypai.alignment.tasks.tiny import build_tiny_model

TRAIN, HELD = ar.split()
CHAT = {"llama3": True, "qwen2": True, "gpt2": False}  # GPT-2: no chat template, prompt/completion rows

REWARD = '''
from raypai.alignment.tasks.arithmetic import parse_answer
from raypai.chat import text_of


def bare_number(prompts, completions, **_):
    """1 when the completion starts with a number (no stray prefix), whatever the number."""
    return [1.0 if parse_answer(text_of(c)) is not None else 0.0 for c in completions]
'''


class Rows:
    """Keeps what a driver logs (the steps' logger writes it to MLflow)."""

    def __init__(self):
        self.rows = []

    def log_metrics(self, metrics, step=None):
        self.rows.append((step, dict(metrics)))


def sloppy_rows(items, chat: bool, share: float = 0.7, seed: int = 0) -> list[dict]:
    """Two SFT rows per problem; in a seeded `share` of them the answer carries a stray "~"."""
    rng = random.Random(seed)
    rows = []
    for p in items:
        for _ in range(2):
            answer = ("~" if rng.random() < share else "") + str(p.answer)
            rows.append({"prompt": ar._user(p, chat), "completion": ar._assistant(answer, chat)})
    return rows


def format_pairs(items, chat: bool) -> list[dict]:
    """Preference pairs that differ in the habit alone: chosen "7", rejected "~7"."""
    return [
        {
            "prompt": ar._user(p, chat),
            "chosen": ar._assistant(str(p.answer), chat),
            "rejected": ar._assistant(f"~{p.answer}", chat),
        }
        for p in items
    ]


_BASES: dict = {}


@pytest.fixture(scope="module")
def base_of(ray_align, tmp_path_factory):
    """base_of(family): the family's tiny model fine-tuned in full on the sloppy answers (once per module)."""

    def make(family: str) -> str:
        if family not in _BASES:
            d = tmp_path_factory.mktemp(family)
            model = build_tiny_model(d / "random", family=family)
            run_sft(
                model,
                str(d / "base"),
                sft_examples(sloppy_rows(TRAIN, CHAT[family])),
                sft_examples(ar.sft_rows(HELD, CHAT[family])),
                SFTConfig(steps=150, lr=3e-3),
                run_name=f"lr-base-{family}",
            )
            _BASES[family] = str(d / "base")
        return _BASES[family]

    yield make
    _BASES.clear()


@pytest.fixture(scope="module")
def reward_module(tmp_path_factory):
    """The reward as a user's module on sys.path (Ray ships it to the Reward actor by value)."""
    d = tmp_path_factory.mktemp("rewards")
    (d / "lora_rewards.py").write_text(textwrap.dedent(REWARD))
    sys.path.insert(0, str(d))
    yield "lora_rewards:bare_number"
    sys.path.remove(str(d))


def actors_of(address: str, run: str) -> set[str]:
    """The names of every actor the run placed (the state API lists ended actors too)."""
    return {a.name for a in list_actors(address=address, limit=10_000) if (a.name or "").startswith(f"{run}/")}


def assert_exported(out: str, metrics: dict, base: str) -> None:
    """The merged model in `out` (plain transformers) and the PEFT adapter beside it: both give the
    same logits, and the adapter's counts are the run's."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapter = Path(f"{out}-adapter")
    assert {"adapter_config.json", "adapter_model.safetensors", "raypai.json"} <= {p.name for p in adapter.iterdir()}
    meta = json.loads((adapter / "raypai.json").read_text())
    assert meta["kind"] == "lora_adapter" and meta["trainable_params"] == metrics["trainable_params"]
    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), str(adapter)).eval()
    ids = torch.tensor([[3, 17, 42, 99, 5, 8, 21]])
    with torch.no_grad():
        # merged W + (α/r)·BA against W x + (α/r)·B(A x): the same function, rounded differently (float32)
        torch.testing.assert_close(merged(input_ids=ids).logits, adapted(input_ids=ids).logits, atol=1e-5, rtol=1e-5)


def test_lora_sft_learns_with_adapter_dropout_on_llama3(ray_align, base_of, tmp_path):
    """SFT keeps dropout, LoRA's included (lora_dropout 0.1: peft's own forward runs, not the lean
    one); the held-out response loss of clean answers falls below 0.6× (2.36 → 0.97 measured; at
    1e-4 × the learning rate it stays 2.36)."""
    base = base_of("llama3")
    out = str(tmp_path / "sft")
    m = run_sft(
        base,
        out,
        sft_examples(ar.sft_rows(TRAIN)),
        sft_examples(ar.sft_rows(HELD)),
        SFTConfig(steps=40, lr=1e-3, lora_r=4, lora_dropout=0.1),
        run_name="lr-sft",
    )
    assert m["eval_response_loss_after"] < 0.6 * m["eval_response_loss_before"], m
    assert 0 < m["trainable_params"] < 0.1 * m["total_params"], m
    assert actors_of(ray_align, "lr-sft") == {"lr-sft/policy-0"}
    assert_exported(out, m, base)


def test_lora_dpo_learns_with_the_base_as_its_reference_on_gpt2(ray_align, base_of, tmp_path):
    """DPO's reference is the policy's own base with the adapters off: no Reference actor. On held-out
    pairs that differ in the habit alone, the implicit reward ranks chosen over rejected (before
    training policy = reference: accuracy 0, margin 0)."""
    base = base_of("gpt2")
    out = str(tmp_path / "dpo")
    m = run_dpo(
        base,
        out,
        preference_examples(format_pairs(TRAIN, False)),
        preference_examples(format_pairs(HELD, False)),
        DPOConfig(steps=15, lr=5e-4, beta=0.1, lora_r=4),
        run_name="lr-dpo",
    )
    assert m["preference_accuracy_before"] == 0 and m["preference_accuracy_after"] >= 0.9, m
    # accuracy counts any move the right way (a run at a 1e-4 × lr also scored 1.0); the margin shows
    # how far: 0.94 measured, 2e-6 at 1e-4 × lr
    assert m["margin_after"] > m["margin_before"] + 0.3, m
    assert actors_of(ray_align, "lr-dpo") == {"lr-dpo/policy-0"}
    assert_exported(out, m, base)


def test_lora_grpo_with_a_kl_term_learns_and_syncs_the_adapters_only_on_qwen2(
    ray_align, base_of, reward_module, tmp_path
):
    """GRPO with β > 0 and no Reference actor (the KL is to the base with adapters off, measured > 0
    once the policy moved); the rollout replica merges the adapter factors it is sent, so its greedy
    held-out answers lose the habit (the reward: a bare number) — 0 before, all after (measured 0 →
    1.0; at 1e-4 × the learning rate 0 → 0)."""
    base = base_of("qwen2")
    out, logger = str(tmp_path / "grpo"), Rows()
    cfg = GRPOConfig(
        steps=8, prompts_per_step=8, group_size=8, lr=1e-3, beta=0.04, max_new_tokens=3, eval_every=100, lora_r=4
    )
    m = run_grpo(
        base,
        out,
        prompt_examples(ar.prompt_rows(TRAIN)),
        prompt_examples(ar.prompt_rows(HELD)),
        cfg,
        rewards=[reward_module],
        run_name="lr-grpo",
        logger=logger,
    )
    assert m["eval_reward_before"] <= 0.2 and m["eval_reward_after"] >= 0.8, m
    assert actors_of(ray_align, "lr-grpo") == {"lr-grpo/policy-0", "lr-grpo/rollout-0", "lr-grpo/reward-0"}
    steps = [r for s, r in logger.rows if s is not None]
    assert len(steps) == 8 and max(r["kl"] for r in steps) > 0
    # each sync hands over the fp32 adapter factors alone: a small fraction of the model's bytes
    assert {r["sync_bytes"] for r in steps} == {4 * m["trainable_params"]}, steps
    assert 4 * m["trainable_params"] < 0.1 * 4 * m["total_params"], m
    assert_exported(out, m, base)


def test_a_lora_step_saves_the_merged_model_and_the_adapter_on_its_base(ray_align, base_of, raypai_home, tmp_path):
    """The sft step with lora_r: its output is the merged model (what a next step takes), a second
    output "adapter" is the adapter artifact whose base is the step's input model; each names the
    other, and lineage from the adapter reaches the base artifact."""
    from raypai import pipeline
    from raypai.alignment.steps import alignment_data, import_model, sft
    from raypai.lineage.graph import upstream
    from raypai.runner import Runner
    from raypai.store import MetadataStore

    chats = ar.write_jsonl(ar.sft_rows(TRAIN), tmp_path / "chats.jsonl")

    @pipeline(name="lora-step")
    def lora_step(model_dir: str, data_file: str):
        base = import_model(path=model_dir, name="base")
        data = alignment_data(path=data_file, kind="sft")
        return sft(base, data, config={"steps": 5, "lr": 1e-3, "lora_r": 4})

    result = Runner(raypai_home).run(lora_step.build(model_dir=base_of("llama3"), data_file=chats))
    assert result.ok, {n: s.error for n, s in result.steps.items() if s.error}
    step, base = result["sft"], result["import_model"].outputs["output"]
    merged, adapter = step.outputs["output"], step.outputs["adapter"]
    assert result.result.id == merged.id  # the step's own output is the merged model
    assert merged.metadata["adapter"] == adapter.id and merged.name == "sft_model"
    assert adapter.kind == "model" and adapter.name == "sft_model_adapter"
    assert adapter.metadata["base_model"] == base.id and adapter.metadata["lora_adapter"]["r"] == 4
    assert (Path(adapter.local_path()) / "adapter_config.json").exists()
    assert (Path(merged.local_path()) / "model.safetensors").exists()
    store = MetadataStore(raypai_home.database_url)
    assert set(store.outputs_of(step.step_run_id)) == {"output", "adapter"}
    inputs = upstream(store, adapter.id)["produced_by"]["inputs"]
    assert [i["lineage"]["artifact"]["id"] for i in inputs if i["name"] == "base_model"] == [base.id]
