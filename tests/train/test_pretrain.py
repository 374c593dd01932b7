"""Pretraining on real Ray Train + DeepSpeed (CPU, gloo, fp32) with a tiny Llama on generated shards.

One uninterrupted 40-step run per ZeRO stage, 0 to 3 (module fixture), is the reference the other
tests compare against: learning, export, equal loss curves, sharded weights at ZeRO-3, and the
exact data order after failures.
They train on a token set over 4 × the size of Ray's object store (`ray_train` starts Ray with
the smallest one allowed): the workers stream their blocks from the shard files.
"""

import json

import boto3
import pytest

from raypai.errors import ConfigError, TrainError
from raypai.train import ModelConfig, PretrainConfig, latest_checkpoint, plan, pretrain
from raypai.train._faults import ENV as FAULTS_ENV
from raypai.train._faults import Faults
from raypai.train.checkpoint import checkpoint_from_path, dir_name
from raypai.train.synthetic import write_token_shards

from .conftest import OBJECT_STORE_BYTES, FileLogger, make_shards, make_tokenizer, peak_rss_growth

TINY = ModelConfig(
    layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, max_positions=64
)  # 78k params: small enough for the test-time budget
STEPS, EVERY = 40, 8


def _cfg(**kw) -> PretrainConfig:
    base = dict(
        model=TINY,
        steps=STEPS,
        warmup_steps=2,
        micro_batch=8,
        lr=5e-3,
        eval_every=20,
        checkpoint_every=EVERY,
        log_every=1,
        workers=2,
        zero_stage=2,
        cpus_per_worker=1.0,
    )
    return PretrainConfig(**{**base, **kw})


def _trace(folder) -> dict:
    """{(rank, step, micro): block ids} and the list of (rank, step) in the order they ran."""
    blocks, ran = {}, []
    for rank in (0, 1):
        for line in open(folder / f"rank{rank}.jsonl"):
            r = json.loads(line)
            blocks.setdefault((rank, r["step"], r["micro"]), r["blocks"])
            assert blocks[(rank, r["step"], r["micro"])] == r["blocks"]  # a repeated step re-reads the same blocks
            ran.append((rank, r["step"]))
    return {"blocks": blocks, "ran": ran}


@pytest.fixture(scope="module")
def big_shards(tmp_path_factory):
    """Token shards of 4 × the object store's bytes in int32 train tokens (2.46M blocks of 32,
    300 MiB; 48 MiB of Parquet on disk), plus 64 eval blocks."""
    folder = tmp_path_factory.mktemp("big_shards")
    train_blocks = -(-4 * OBJECT_STORE_BYTES // (32 * 4))
    manifest = write_token_shards(folder, blocks=train_blocks + 64, eval_fraction=64.5 / (train_blocks + 64))
    assert manifest["num_tokens"] * 4 >= 4 * OBJECT_STORE_BYTES and manifest["num_eval_blocks"] == 64
    return folder, manifest


@pytest.fixture(scope="module")
def reference(ray_train, big_shards, tokenizer_dir, tmp_path_factory):
    folder, _ = big_shards
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        for stage in (0, 1, 2, 3):
            tmp = tmp_path_factory.mktemp(f"zero{stage}")
            (tmp / "trace").mkdir()
            mp.setenv(FAULTS_ENV, Faults(trace_dir=str(tmp / "trace")).to_env())  # record the blocks read
            log = FileLogger(tmp / "metrics.jsonl")
            res = pretrain(
                folder,
                tokenizer_dir,
                tmp / "model",
                _cfg(zero_stage=stage),
                name=f"zero{stage}",
                storage_path=tmp / "store",
                logger=log,
            )
            out[stage] = {
                "result": res,
                "rows": log.read(),
                "trace": _trace(tmp / "trace"),
                "model": tmp / "model",
                "store": tmp / "store",
                "memory": [json.loads((tmp / "trace" / f"memory-rank{r}.json").read_text()) for r in (0, 1)],
            }
    return out


def test_two_worker_zero2_learns_below_unigram_entropy_and_exports_for_transformers(reference, big_shards):
    _, manifest = big_shards
    ref = reference[2]
    metrics, rows = ref["result"]["metrics"], ref["rows"]
    entropy = manifest["unigram_entropy_nats"]  # ≈ 4.1 nats: what a model without context can reach
    assert metrics["eval_loss"] < 0.5 * entropy, (metrics, entropy)
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == STEPS and losses[-1] < 0.5 * losses[0]
    assert {
        "lr",
        "tokens_per_s",
        "mfu",
        "grad_norm",
        "eval_loss",
        "eval_ppl",
        "step_time_s.rank0",
        "step_time_s.rank1",
        "checkpoint_stall_s",
    } <= set().union(*rows)
    assert metrics["checkpoints"] == STEPS // EVERY - 1  # every 8 steps, the last one is the final export

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(ref["model"])
    tok = AutoTokenizer.from_pretrained(ref["model"])
    x = tok("t5 t16", return_tensors="pt")
    out = model.generate(**x, max_new_tokens=3, do_sample=False)
    # the rule the data follows 90% of the time: next = (3t + 1) mod 64 → t49, t20, t61
    assert tok.decode(out[0, 2:]) == "t49 t20 t61"
    info = json.loads((ref["model"] / "raypai.json").read_text())
    assert info["plan"]["zero_stage"] == 2 and info["training"]["steps"] == STEPS
    assert info["metrics"]["eval_loss"] == pytest.approx(metrics["eval_loss"])
    assert (ref["model"] / "model.safetensors").exists() and (ref["model"] / "generation_config.json").exists()
    assert torch.isfinite(model(**x).logits).all()


def test_a_finished_run_called_again_returns_its_final_metrics(reference, big_shards, tokenizer_dir, tmp_path):
    """A run resumed at its last step (pretrain called again by name, or Ray Train restarting the
    worker group after the final report) trains no step: its result still carries the finished
    run's loss and eval loss, not an empty window."""
    folder, _ = big_shards
    ref = reference[0]["result"]["metrics"]
    # one worker is enough to resume a ZeRO-0 run (no optimizer partitions) and starts faster
    res = pretrain(
        folder,
        tokenizer_dir,
        tmp_path / "model",
        _cfg(zero_stage=0, workers=1),
        name="zero0",
        storage_path=reference[0]["store"],
    )
    assert res["metrics"]["step"] == STEPS
    assert res["metrics"]["loss"] == ref["loss"] and res["metrics"]["eval_loss"] == ref["eval_loss"]
    info = json.loads((tmp_path / "model" / "raypai.json").read_text())
    assert info["metrics"]["eval_loss"] == ref["eval_loss"]


def test_a_finished_run_called_again_starts_no_workers(reference, big_shards, tokenizer_dir, tmp_path):
    """Called again by name, a run whose registered newest checkpoint is its final one is exported
    from that checkpoint by the driver: no worker group starts, so nothing in the run's storage
    changes (a worker group would re-register the checkpoint in Ray Train's snapshot file)."""
    folder, _ = big_shards
    run = reference[1]["store"] / "zero1"
    before = {p.relative_to(run): (p.stat().st_mtime_ns, p.read_bytes()) for p in run.rglob("*") if p.is_file()}
    res = pretrain(
        folder, tokenizer_dir, tmp_path / "model", _cfg(zero_stage=1), name="zero1", storage_path=reference[1]["store"]
    )
    after = {p.relative_to(run): (p.stat().st_mtime_ns, p.read_bytes()) for p in run.rglob("*") if p.is_file()}
    assert after == before
    assert res["checkpoint_path"] == str(run / "checkpoint_000040")
    assert res["metrics"]["eval_loss"] == reference[1]["result"]["metrics"]["eval_loss"]
    assert (tmp_path / "model" / "model.safetensors").exists()


def test_zero_stages_0_to_3_give_the_same_loss_curve(reference):
    """Same seed, same initial weights at every stage (ZeRO-3's are built under zero.Init)."""
    curves = {s: [r["loss"] for r in reference[s]["rows"] if "loss" in r] for s in (0, 1, 2, 3)}
    for stage in (0, 1, 3):
        # same seed, data and maths; only the reduction order differs (all-reduce vs reduce-scatter)
        assert curves[stage][:10] == pytest.approx(curves[2][:10], rel=2e-3), stage
        assert curves[stage] == pytest.approx(curves[2], rel=5e-2), stage
        assert reference[stage]["trace"]["blocks"] == reference[2]["trace"]["blocks"]
    # the gradient norm is reported at every stage (DeepSpeed keeps none at ZeRO 0 in fp32: raypai
    # clips there itself, raypai.train.clipping) and is the same global norm, before clipping
    norms = {s: [r["grad_norm"] for r in reference[s]["rows"] if "grad_norm" in r] for s in (0, 1, 2, 3)}
    assert len(norms[2]) == len(curves[2]) and min(norms[2]) > 0
    for stage in (0, 1, 3):
        assert norms[stage][:10] == pytest.approx(norms[2][:10], rel=2e-2), stage


def test_two_worker_zero3_shards_the_weights_exports_them_and_resumes(reference, big_shards, tokenizer_dir, tmp_path):
    """ZeRO-3 on CPU workers. Each of the 2 workers holds half of the parameters, measured inside
    the workers after their last step and evaluation (their partitions plus any weight still
    gathered: with DeepSpeed's default prefetch and reuse distance the whole model stayed gathered
    there; at ZeRO-2 each holds all). The run learns; the HF export, gathered from the shards,
    loads in plain transformers with the trained weights (DeepSpeed's offline `zero_to_fp32`
    rebuilds them from the final checkpoint's partitions); and a run resumed from a ZeRO-3
    checkpoint ends where the uninterrupted one did."""
    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoModelForCausalLM

    folder, manifest = big_shards
    ref = reference[3]
    n_params = ref["result"]["info"]["n_params"]
    held = [m["param_elements"] for m in ref["memory"]]
    assert all(n_params / 2 <= h <= n_params / 2 + 64 for h in held), (held, n_params)  # + padding to equal shares
    assert [m["param_elements"] for m in reference[2]["memory"]] == [n_params, n_params]
    metrics = ref["result"]["metrics"]
    assert ref["result"]["info"]["zero_stage"] == 3
    assert metrics["eval_loss"] < 0.5 * manifest["unigram_entropy_nats"], metrics
    losses = [r["loss"] for r in ref["rows"] if "loss" in r]
    assert len(losses) == STEPS and losses[-1] < 0.5 * losses[0]

    exported = AutoModelForCausalLM.from_pretrained(ref["model"])
    trained = AutoModelForCausalLM.from_config(exported.config)
    state = get_fp32_state_dict_from_zero_checkpoint(ref["result"]["checkpoint_path"], tag="state")
    assert sum(v.numel() for k, v in state.items() if k != "lm_head.weight") == n_params  # every shard joined
    trained.load_state_dict(state)
    x = torch.arange(2, 34).reshape(2, 16)  # (B, T) token ids
    with torch.no_grad():
        logits = exported(x).logits
        assert torch.equal(logits, trained(x).logits)
        at_zero2 = AutoModelForCausalLM.from_pretrained(reference[2]["model"])(x).logits
    assert torch.allclose(logits, at_zero2, atol=1e-3)  # the same training, only reductions in another order

    resume_at = ref["store"] / "zero3" / dir_name(STEPS - EVERY)
    res = pretrain(
        folder,
        tokenizer_dir,
        tmp_path / "model",
        _cfg(zero_stage=3, resume_from=str(resume_at)),
        name="zero3-resumed",
        storage_path=tmp_path / "store",
    )
    assert res["metrics"]["step"] == STEPS and res["metrics"]["checkpoints"] == 0  # 8 steps, not 40 from scratch
    # weights, optimizer partitions, lr and RNG restored: the run ends where the uninterrupted one did
    assert res["metrics"]["loss"] == pytest.approx(metrics["loss"], rel=1e-4)
    assert res["metrics"]["eval_loss"] == pytest.approx(metrics["eval_loss"], rel=1e-4)


def _keys(bucket: str, prefix: str) -> set[str]:
    pages = boto3.client("s3").get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return {o["Key"] for page in pages for o in page.get("Contents", [])}


def test_killed_workers_and_a_restarted_driver_resume_from_s3_checkpoints_with_the_same_data(
    reference, big_shards, tokenizer_dir, s3, tmp_path, monkeypatch
):
    """Drill, with checkpoints on the S3 server: the first driver allows no restart and dies with
    its worker at step 19 (checkpoint 16 uploaded and registered); a second driver with the same run
    name resumes at 16 from S3, its worker dies again at step 35 and Ray Train restarts the worker
    group from checkpoint 32 (that process's second asynchronous snapshot, so written from reused
    snapshot buffers). Every step must read the uninterrupted run's blocks, repeat at most one
    checkpoint interval, and end on its loss. The token set is 4 × the object store: the driver
    and each worker's loop grow by less than the object store's size."""
    folder, manifest = big_shards
    _, bucket = s3
    store = f"s3://{bucket}/runs"
    trace = tmp_path / "trace"
    trace.mkdir()
    monkeypatch.chdir(tmp_path)  # a URI taken for a local path would land in ./s3:/...
    monkeypatch.setenv(FAULTS_ENV, Faults(trace_dir=str(trace), kill_worker_at_step=19).to_env())
    first = _cfg(max_failures=0, async_checkpoint=False)
    with pytest.raises(
        TrainError, match=f"stay in {store}/drill, and calling pretrain again with name='drill' resumes"
    ):
        pretrain(folder, tokenizer_dir, tmp_path / "model", first, name="drill", storage_path=store)
    assert latest_checkpoint(store, "drill") == f"{store}/drill/checkpoint_000016"
    keys = _keys(bucket, "runs/drill/checkpoint_000016/")
    assert {"runs/drill/checkpoint_000016/data_position.json", "runs/drill/checkpoint_000016/rng-rank1.json"} <= keys
    assert any(k.startswith("runs/drill/checkpoint_000016/state/") for k in keys)  # DeepSpeed's files
    body = boto3.client("s3").get_object(Bucket=bucket, Key="runs/drill/checkpoint_000016/data_position.json")
    assert json.loads(body["Body"].read()) == {"next_step": 16}
    checkpoint_from_path(f"{store}/drill/checkpoint_000016")  # usable as resume_from
    with pytest.raises(TrainError, match="no raypai checkpoint there"):
        checkpoint_from_path(f"{store}/drill")

    monkeypatch.setenv(FAULTS_ENV, Faults(trace_dir=str(trace), kill_worker_at_step=35).to_env())
    second = _cfg(max_failures=1)  # async checkpoints
    res, driver_growth = peak_rss_growth(
        lambda: pretrain(folder, tokenizer_dir, tmp_path / "model", second, name="drill", storage_path=store)
    )
    assert sorted(p.name for p in trace.glob("killed-at-*")) == ["killed-at-19", "killed-at-35"]  # both died
    assert res["checkpoint_path"] == f"{store}/drill/checkpoint_000040"
    assert "runs/drill/checkpoint_000040/hf/model.safetensors" in _keys(bucket, "runs/drill/checkpoint_000040/")
    assert not (tmp_path / "s3:").exists()

    ref, got = reference[2], _trace(trace)
    assert got["blocks"] == ref["trace"]["blocks"]  # every (rank, step, micro) read the uninterrupted run's blocks
    steps = [s for r, s in got["ran"] if r == 0]
    restarts = [(steps[i - 1], steps[i]) for i in range(1, len(steps)) if steps[i] <= steps[i - 1]]
    assert [at for _, at in restarts] == [16, 32]  # resumed from the latest checkpoint each time
    for last_run, at in restarts:
        assert 0 < last_run - at + 1 <= EVERY  # steps done twice: at most one checkpoint interval
    assert sorted(set(steps)) == list(range(STEPS)) and res["metrics"]["step"] == STEPS
    # model, optimizer, scheduler (lr) and RNG restored: the run ends where the uninterrupted one did
    assert res["metrics"]["loss"] == pytest.approx(ref["result"]["metrics"]["loss"], rel=1e-4)
    assert res["metrics"]["eval_loss"] == pytest.approx(ref["result"]["metrics"]["eval_loss"], rel=1e-4)

    # bounded memory: neither the driver nor a worker's loop grew by as much as the object store
    # holds, a quarter of the token set (loading the blocks on the driver, as before, added 1.9 GB)
    token_bytes = manifest["num_tokens"] * 4
    workers = [json.loads((trace / f"memory-rank{r}.json").read_text()) for r in (0, 1)]
    print(
        f"token set {token_bytes / 2**20:.0f} MiB; driver peak +{driver_growth / 2**20:.0f} MiB; worker peaks "
        f"+{[round((w['peak_rss'] - w['rss_at_start']) / 2**20) for w in workers]} MiB over their loops"
    )
    assert driver_growth < OBJECT_STORE_BYTES <= token_bytes / 4
    for w in workers:
        assert 0 < w["peak_rss"] - w["rss_at_start"] < OBJECT_STORE_BYTES, w


def test_bad_inputs_fail_before_training_with_the_fix(shards, tokenizer_dir, tmp_path):
    folder, _ = shards
    with pytest.raises(TrainError, match="memory_budget_gb=1e-06; lower micro_batch"):
        plan(folder, _cfg(memory_budget_gb=1e-6))
    with pytest.raises(TrainError, match="does not fit memory_budget_gb"):
        plan(folder, _cfg(memory_budget_gb=1e-6, strategy="auto"))
    auto, info = plan(folder, _cfg(strategy="auto", micro_batch=64, memory_budget_gb=0.01))
    assert auto.micro_batch < 64 and auto.micro_batch * auto.grad_accum == 64
    assert info["memory_estimate_gb"] <= 0.01
    empty = tmp_path / "empty"
    make_shards(empty, blocks=8)
    m = json.loads((empty / "manifest.json").read_text())
    m["files"] = [f for f in m["files"] if f["split"] == "eval"]
    (empty / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(TrainError, match="no train blocks \\(empty token shards\\)"):
        plan(empty, _cfg())
    with pytest.raises(TrainError, match="vocab mismatch: .*tokenizer .* has 80; re-tokenize"):
        plan(folder, _cfg(), tokenizer_dir=make_tokenizer(tmp_path / "tok80", vocab=80))
    with pytest.raises(TrainError, match="vocab mismatch: model.vocab_size=999"):
        plan(folder, _cfg(model=ModelConfig(**{**TINY.__dict__, "vocab_size": 999})))
    with pytest.raises(TrainError, match="exceed model.max_positions=16"):
        plan(folder, _cfg(model=ModelConfig(**{**TINY.__dict__, "max_positions": 16})))
    with pytest.raises(TrainError, match="resume_from=.*nope: no raypai checkpoint there"):
        pretrain(
            folder,
            None,
            tmp_path / "o",
            _cfg(resume_from=str(tmp_path / "nope")),
            name="x",
            storage_path=tmp_path / "s",
        )
    with pytest.raises(ConfigError):
        plan(folder, _cfg(steps=0))
    assert plan(folder, _cfg(), tokenizer_dir=tokenizer_dir)[1]["vocab_size"] == 64


def test_init_from_a_local_hf_folder_starts_from_its_weights(reference, shards, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from raypai.train import build_model

    folder, _ = shards
    src = reference[2]["model"]  # the exported model of the 2-worker ZeRO-2 run
    model = build_model(ModelConfig(init_from=str(src)), 64)
    exported = AutoModelForCausalLM.from_pretrained(src).state_dict()
    assert model.state_dict().keys() == exported.keys()
    assert all(torch.equal(v, exported[k]) for k, v in model.state_dict().items())
    _, info = plan(folder, _cfg(model=ModelConfig(init_from=str(src))))
    assert info["n_params"] == reference[2]["result"]["info"]["n_params"]  # the shape comes from the folder
    with pytest.raises(TrainError, match="init_from=.*not a Hugging Face model folder"):
        plan(folder, _cfg(model=ModelConfig(init_from=str(tmp_path))))
