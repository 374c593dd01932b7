"""pipelines/finetune.py end to end (small configuration): an imported Qwen2-style model → SFT on
the user's chat file → DPO on their preference file → evaluate with their reward → register →
deploy, then `raypai lineage --deployment` from the served model back to the imported weights and
the dataset files, and `raypai model import` / `raypai align` from the command line."""

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from raypai.pipelines.finetune import example_inputs, finetune
from raypai.runner import Runner
from raypai.store import MetadataStore


@pytest.mark.scale  # the second end-to-end run (tinychat's stays in make test): make test-scale
def test_finetune_pipeline_imports_aligns_deploys_with_lineage_to_the_files(raypai_home, tmp_path):
    from ray import serve

    from raypai.lineage.deploy import deployment_lineage

    inputs = example_inputs(tmp_path / "user")
    # the gate is off here so the endpoint is always there to query; register still records the decision.
    # Nothing below asserts how much the model learnt (the alignment tests do), so the steps are few
    result = Runner(raypai_home).run(
        finetune.build(
            **inputs,
            sft_config={"steps": 100, "lr": 3e-3},
            align_config={"steps": 10, "lr": 5e-4},
            max_new_tokens=4,
            require_improvement=False,
        )
    )
    try:
        assert result.ok, {n: s.error for n, s in result.steps.items() if s.error}
        ev = result["evaluate"].value
        assert ev["metric"] == "held_out_reward" and ev["improved"] == (ev["candidate"] > ev["baseline"]), ev
        assert result["register"].value["promoted"] == ev["improved"]
        assert result.result["deployed"], result.result
        store = MetadataStore(raypai_home.database_url)
        token = store.create_token("ft", ["infer"])
        endpoint = result.result["endpoint"]  # where the deploy step says the model is served
        r = httpx.post(
            f"{endpoint.rstrip('/')}/chat/completions",
            timeout=120,
            headers={"Authorization": f"Bearer {token}"},
            json={"model": "finetune", "messages": [{"role": "user", "content": "3+4="}], "max_tokens": 4},
        )
        assert r.status_code == 200, r.text
        assert "<|im_end|>" not in r.json()["choices"][0]["message"]["content"]

        env = {**os.environ, "RAYPAI_HOME": str(raypai_home.home)}
        out = subprocess.run(
            [sys.executable, "-m", "raypai.cli", "lineage", "--deployment", "finetune", "--json"],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        graph = json.loads(out.stdout)
        text = json.dumps(graph)
        # the served model's chain reaches the imported weights' folder and the user's data files
        assert str(Path(inputs["model_dir"]).name) in text and "chats.jsonl" in text and "prefs.jsonl" in text, text[
            :2000
        ]
        graph = deployment_lineage(store, raypai_home, "finetune")
        assert graph["models"][0]["model"] == "finetune"
    finally:
        serve.shutdown()
