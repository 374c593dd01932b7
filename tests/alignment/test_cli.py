"""`raypai model import` and `raypai align` as a user runs them: an existing HF folder imported into
the store and registry, then SFT from its registry URI on a JSONL file; bad input refused before Ray."""

import json
import os
import subprocess
import sys
from pathlib import Path

from raypai.alignment.tasks import arithmetic as ar
from raypai.alignment.tasks.tiny import build_tiny_model


def _raypai(*args, home, timeout=600):
    env = {**os.environ, "RAYPAI_HOME": str(home), "RAYPAI_RAY_NUM_CPUS": "8"}
    env.pop("RAY_ADDRESS", None)
    out = subprocess.run(
        [sys.executable, "-m", "raypai.cli", *args], capture_output=True, text=True, env=env, timeout=timeout
    )
    out.text = " ".join((out.stdout + out.stderr).split())  # the console wraps long messages
    return out


def _printed(text: str) -> dict:
    """The JSON a command prints last (after the run display's lines)."""
    return json.loads(text[text.index("{\n") :])


def test_import_a_model_then_align_it_from_its_registry_uri(tmp_path):
    home = tmp_path / "home"
    model = build_tiny_model(tmp_path / "Qwen-tiny", family="qwen2", hidden=32, layers=1)
    data = ar.write_jsonl(ar.sft_rows(ar.problems()[:30]), tmp_path / "chats.jsonl")

    out = _raypai("model", "import", model, "--name", "qwen-tiny", home=home)
    assert out.returncode == 0, out.stdout + out.stderr
    imported = json.loads(out.stdout[out.stdout.index("{") :])
    assert imported["uri"] == "models:/qwen-tiny@base" and len(imported["digest"]) == 64

    (tmp_path / "sft.yaml").write_text("steps: 5\nlr: 0.003\nbatch_size: 4\n")
    out = _raypai(
        "align",
        "sft",
        "--model",
        "models:/qwen-tiny@base",
        "--data",
        data,
        "--out",
        str(tmp_path / "sft"),
        "--config",
        str(tmp_path / "sft.yaml"),
        home=home,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    metrics = json.loads(out.stdout[out.stdout.index("{") :])
    assert metrics["eval_examples"] == 3 and metrics["train_examples"] == 27  # the default 10% held out
    assert (tmp_path / "sft" / "model.safetensors").exists()


def test_align_refuses_bad_data_and_bad_rewards_before_ray_starts(tmp_path):
    home = tmp_path / "home"
    model = build_tiny_model(tmp_path / "m", family="gpt2", hidden=32, layers=1)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "2+2=", "reply": "4"}) + "\n")
    out = _raypai(
        "align", "sft", "--model", model, "--data", str(bad), "--out", str(tmp_path / "o"), home=home, timeout=120
    )
    assert out.returncode != 0 and "has columns ['question', 'reply']" in out.text
    assert "Started a local Ray" not in out.stderr and not (tmp_path / "o").exists()
    prompts = ar.write_jsonl(ar.prompt_rows(ar.problems()[:4], chat=False), tmp_path / "p.jsonl")
    out = _raypai(
        "align",
        "grpo",
        "--model",
        model,
        "--data",
        prompts,
        "--out",
        str(tmp_path / "o"),
        "--reward",
        "no_such_pkg.rewards:accuracy",
        home=home,
        timeout=120,
    )
    assert out.returncode != 0 and "module 'no_such_pkg.rewards' does not import" in out.text
    assert "Started a local Ray" not in out.stderr


def _align(algo, tmp_path, **given):
    """`raypai align` as typer calls it (every option given), without a subprocess."""
    from raypai.alignment.cli import align_command

    options = dict(eval_data=None, reward=[], reward_model=None, pairs=None, config=None, eval_fraction=0.1)
    model = given.pop("model", str(tmp_path / "m"))
    return align_command(algo, model, str(tmp_path / "d.jsonl"), tmp_path / "out", **{**options, **given})


def test_align_reads_the_algorithm_registry_and_refuses_inputs_an_algorithm_does_not_take(tmp_path):
    """The names `raypai align` accepts are the registry's; an input the algorithm's row says it does
    not take, or a missing one it needs, is refused before the model, the data or Ray is touched."""
    import pytest
    import ray

    from raypai.alignment.algorithms import ALGORITHMS
    from raypai.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        _align("rlhf", tmp_path)
    assert err.value.problems == [f"unknown algorithm 'rlhf'; choose one of {', '.join(ALGORITHMS)}"]
    with pytest.raises(ConfigError) as err:
        _align("sft", tmp_path, reward=["pkg.mod:fn"], reward_model="rm/", pairs="p.jsonl")
    assert err.value.problems == [
        "sft takes no --reward; leave it out",
        "sft takes no --reward-model; leave it out",
        "sft takes no --eval-pairs; leave it out",
    ]
    with pytest.raises(ConfigError, match="online_dpo takes no --reward-model"):
        _align("online_dpo", tmp_path, reward=["pkg.mod:fn"], reward_model="rm/", pairs="p.jsonl")
    with pytest.raises(ConfigError, match="online_dpo needs --eval-pairs"):
        _align("online_dpo", tmp_path, reward=["pkg.mod:fn"])
    assert not ray.is_initialized()


def test_align_with_lora_writes_the_merged_model_and_its_adapter_which_registers_on_its_base(
    raypai_home, tmp_path, capsys
):
    """`raypai align dpo` with `lora_r` in --config: the merged model in --out, the PEFT adapter beside
    it, trainable and total parameter counts in the summary. `raypai model import ADAPTER --base`
    registers the adapter on the registered base (lineage to the base's artifact; a deploy refuses it),
    `--merge` registers base + adapter as a plain model with the same logits; an unregistered base, a
    folder that is no adapter and an adapter of another model are refused before Ray starts."""
    import pytest
    import ray
    import torch
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    from raypai.alignment.cli import import_command
    from raypai.errors import ConfigError, DeployError
    from raypai.lineage.graph import upstream
    from raypai.serving.control import Controller
    from raypai.store import MetadataStore
    from raypai.tracking import ADAPTER_OF_TAG, Tracker

    home = raypai_home.home
    model = build_tiny_model(tmp_path / "Qwen-tiny", family="qwen2", hidden=32, layers=1)
    prefs = ar.write_jsonl(ar.preference_rows(ar.problems()[:30], 0, 1), tmp_path / "prefs.jsonl")
    out = _raypai("model", "import", model, "--name", "qwen-tiny", home=home)
    assert out.returncode == 0, out.stdout + out.stderr
    base_id = json.loads(out.stdout[out.stdout.index("{") :])["artifact_id"]

    (tmp_path / "dpo.yaml").write_text("steps: 3\nbatch_size: 4\nlora_r: 4\n")
    args = ["--data", prefs, "--out", str(tmp_path / "dpo"), "--config", str(tmp_path / "dpo.yaml")]
    out = _raypai("align", "dpo", "--model", "models:/qwen-tiny@base", *args, home=home)
    assert out.returncode == 0, out.stdout + out.stderr
    summary = json.loads(out.stdout[out.stdout.index("{") :])
    adapter = str(tmp_path / "dpo-adapter")
    assert summary["model"] == str(tmp_path / "dpo") and summary["adapter"] == adapter
    # rank-4 adapters on one block's projections: a few percent of the weights train
    assert 0 < summary["trainable_params"] < 0.1 * summary["total_params"], summary
    assert json.loads((tmp_path / "dpo-adapter" / "adapter_config.json").read_text())["r"] == 4
    assert (tmp_path / "dpo" / "model.safetensors").exists()

    # refused before Ray starts, each with one error naming the fix
    def refused(path, base, match):
        with pytest.raises(ConfigError, match=match):
            import_command(Path(path), "x", alias=None, base=base, merge=False)

    refused(adapter, "models:/no-such-model@base", r"base models:/no-such-model@base is not registered")
    refused(model, "models:/qwen-tiny@base", r"is not a PEFT adapter folder \(no adapter_config.json\)")
    refused(adapter, None, r"is a LoRA adapter, not a model: pass --base")
    with pytest.raises(ConfigError, match=r"dpo-adapter' is a LoRA adapter, not a model: pass the merged model"):
        _align("dpo", tmp_path, model=adapter)  # aligning an adapter: its merged model is what to train on
    other = build_tiny_model(tmp_path / "gpt2", family="gpt2", hidden=48, layers=1)
    lora = LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True)
    get_peft_model(AutoModelForCausalLM.from_pretrained(other), lora).save_pretrained(tmp_path / "gpt2-adapter")
    refused(
        str(tmp_path / "gpt2-adapter"), "models:/qwen-tiny@base", r"does not fit the base model models:/qwen-tiny/1"
    )
    assert not ray.is_initialized()

    import_command(Path(adapter), "qwen-dpo", alias=None, base="models:/qwen-tiny@base", merge=False)
    shown = _printed(capsys.readouterr().out)
    assert shown["uri"] == "models:/qwen-dpo@adapter" and shown["base"] == "models:/qwen-tiny/1", shown
    tracker = Tracker(raypai_home.mlflow_tracking_uri)
    _, tags = tracker.resolve_model("qwen-dpo", "adapter")
    assert tags[ADAPTER_OF_TAG] == "models:/qwen-tiny/1" and tags["raypai.input.base_model.artifact_id"] == base_id
    store = MetadataStore(raypai_home.database_url)
    art = store.get_artifact(shown["artifact_id"])
    assert art.kind == "model" and art.metadata["base_model"] == base_id and art.metadata["lora_adapter"]["r"] == 4
    inputs = upstream(store, art.id)["produced_by"]["inputs"]
    assert [i["lineage"]["artifact"]["id"] for i in inputs if i["name"] == "base_model"] == [base_id]
    with pytest.raises(DeployError, match="is a LoRA adapter on models:/qwen-tiny/1, not a model"):
        Controller(raypai_home, store, tracker).create("dpo", "qwen-dpo", alias="adapter")

    import_command(Path(adapter), "qwen-dpo-merged", alias=None, base="models:/qwen-tiny@base", merge=True)
    shown = _printed(capsys.readouterr().out)
    assert shown["uri"] == "models:/qwen-dpo-merged@merged", shown
    merged = AutoModelForCausalLM.from_pretrained(tracker.download_model("qwen-dpo-merged", "merged")).eval()
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model), adapter).eval()
    ids = torch.tensor([[3, 17, 42, 99, 5, 8]])
    with torch.no_grad():
        want, got = adapted(input_ids=ids).logits, merged(input_ids=ids).logits
        base_logits = AutoModelForCausalLM.from_pretrained(model).eval()(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert not torch.allclose(got, base_logits, atol=1e-4)  # the adapter trained: merged is not the base
