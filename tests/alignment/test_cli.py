"""`raypai model import` and `raypai align` as a user runs them: an existing HF folder imported into
the store and registry, then SFT from its registry URI on a JSONL file; bad input refused before Ray."""

import json
import os
import subprocess
import sys

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
    return align_command(algo, str(tmp_path / "m"), str(tmp_path / "d.jsonl"), tmp_path / "out", **{**options, **given})


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
