"""`raypai train` as a user runs it: a fresh process, its own local Ray, a YAML config."""

import os
import subprocess
import sys

CONFIG = """
model: {layers: 2, hidden: 64, heads: 4, kv_heads: 2, intermediate: 128, max_positions: 64}
steps: 8
warmup_steps: 2
micro_batch: 8
lr: 0.005
workers: 2
cpus_per_worker: 1.0
zero_stage: 2
checkpoint_every: 4
eval_every: 4
log_every: 2
"""


def _raypai(tmp_path, *args):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAYPAI_", "MLFLOW_TRACKING", "RAY_ADDRESS"))}
    env.update(RAYPAI_HOME=str(tmp_path / "home"), RAYPAI_DASHBOARD="0")
    return subprocess.run(
        [sys.executable, "-m", "raypai.cli", *map(str, args)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_raypai_train_shows_progress_and_writes_a_loadable_model(shards, tokenizer_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    folder, _ = shards
    (tmp_path / "pretrain.yaml").write_text(CONFIG)
    out = _raypai(
        tmp_path,
        "train",
        folder,
        tmp_path / "model",
        "--tokenizer",
        tokenizer_dir,
        "--config",
        tmp_path / "pretrain.yaml",
        "--name",
        "cli-run",
    )
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    # progress from rank 0 reaches the terminal every log_every steps, then the summary
    assert "step 2/8 loss" in text and "step 8/8 loss" in text, text
    assert "[####################] 100% ~0s left" in text and "25% ~" in text, text
    assert "model written to" in out.stdout and '"eval_loss"' in out.stdout
    AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    assert (tmp_path / "home" / "train" / "cli-run").is_dir()  # checkpoints under RAYPAI_HOME, by run name


def test_raypai_train_rejects_a_bad_config_before_starting_ray(shards, tmp_path):
    folder, _ = shards
    (tmp_path / "bad.yaml").write_text("steps: 0\nmicro_batchh: 8\n")
    out = _raypai(tmp_path, "train", folder, tmp_path / "model", "--config", tmp_path / "bad.yaml")
    assert out.returncode == 2  # refused before any work (raypai.exits.REFUSED)
    assert "micro_batchh" in out.stderr and "steps" in out.stderr, out.stderr
    assert not (tmp_path / "model").exists()
