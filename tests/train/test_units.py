"""Pure pieces of raypai.train against hand-derived values: schedule, FLOPs, memory, order, config,
and the shard reader workers stream their blocks through."""

import json
import math
import pickle

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raypai.errors import ConfigError, TrainError
from raypai.train import ModelConfig, PretrainConfig, flops_per_token, plan
from raypai.train._faults import ENV as FAULTS_ENV
from raypai.train._faults import Faults
from raypai.train.data import ROW_GROUP_TOKENS, BlockOrder, Prefetcher, TokenShards, load_blocks, read_manifest
from raypai.train.metrics import StragglerDetector, mfu
from raypai.train.schedule import lr_multiplier
from raypai.train.strategy import GB, ModelShape, activation_bytes, choose, estimate, model_state_bytes
from raypai.train.synthetic import write_token_shards

from .conftest import make_shards


def test_lr_schedules():
    """warmup 4, total 14, floor 0.1. Warm-up: (s+1)/4. At step 9, progress = (9-4)/10 = 0.5:
    cosine 0.1 + 0.9·½(1 + cos π/2) = 0.55; linear 1 − 0.5·0.9 = 0.55. At the end both reach 0.1."""
    kw = dict(total_steps=14, warmup_steps=4, min_ratio=0.1)
    assert [lr_multiplier(s, schedule="cosine", **kw) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_multiplier(4, schedule="cosine", **kw) == 1.0
    assert lr_multiplier(9, schedule="cosine", **kw) == pytest.approx(0.55)
    assert lr_multiplier(6, schedule="cosine", **kw) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.2)))
    assert lr_multiplier(9, schedule="linear", **kw) == pytest.approx(0.55)
    assert lr_multiplier(14, schedule="cosine", **kw) == pytest.approx(0.1)
    assert lr_multiplier(14, schedule="linear", **kw) == pytest.approx(0.1)
    assert lr_multiplier(20, schedule="constant", **kw) == 1.0


def test_flops_per_token_and_mfu():
    """6N + 12·L·H·T: N = 1e6, L = 2, H = 64, T = 32 → 6e6 + 49 152. MFU: 1000 tok/s × 6e6 FLOP
    / 1.2e10 FLOP/s = 0.5."""
    assert flops_per_token(1_000_000, 2, 64, 32) == 6e6 + 49_152
    assert mfu(1000, 6e6, 1.2e10) == pytest.approx(0.5)
    assert mfu(1000, 6e6, 0.0) == 0.0


def test_model_state_bytes_follow_zero_paper():
    """Ψ = 1000, N = 2. Mixed precision (2 + 2 + 12)Ψ: stage 0 → (2000, 2000, 12000); stage 1
    divides K: 6000; stage 2 also grads: 1000; stage 3 also weights: 1000. fp32: (4, 4, 8)Ψ, and
    stage 1/2 add DeepSpeed's fp32 partition 4Ψ/N: optimizer (8 + 4)·1000/2 = 6000."""
    assert model_state_bytes(1000, 2, 0, True) == (2000, 2000, 12000)
    assert model_state_bytes(1000, 2, 1, True) == (2000, 2000, 6000)
    assert model_state_bytes(1000, 2, 2, True) == (2000, 1000, 6000)
    assert model_state_bytes(1000, 2, 3, True) == (1000, 1000, 6000)
    assert model_state_bytes(1000, 2, 0, False) == (4000, 4000, 8000)
    assert model_state_bytes(1000, 2, 2, False) == (4000, 2000, 6000)


def test_activation_bytes():
    """s = 8, b = 1, h = 4, a = 2: per layer s·b·h·(34 + 5·a·s/h) = 32·54 = 1728 bytes in 16-bit;
    logits + grad 2·4·b·s·V = 640 (V = 10). fp32 doubles the layer term: 3456 + 640 = 4096."""
    kw = dict(layers=1, hidden=4, heads=2, vocab=10, seq_len=8, micro_batch=1)
    assert activation_bytes(mixed_precision=True, **kw) == 1728 + 640
    assert activation_bytes(mixed_precision=False, **kw) == 4096


def test_auto_strategy_picks_largest_micro_batch_then_lowest_stage():
    cfg = PretrainConfig(model=ModelConfig(layers=2, hidden=64, heads=4, vocab_size=64), micro_batch=8, workers=2)
    n, seq = 1_000_000, 32
    roomy = replace_budget(cfg, estimate(n, cfg, seq, 0, 8).total_gb * 1.01)
    chosen, est = choose(n, roomy, seq)
    assert (chosen.zero_stage, chosen.micro_batch, chosen.grad_accum) == (0, 8, 1)
    tight = replace_budget(cfg, estimate(n, cfg, seq, 1, 8).total_gb * 1.001)
    assert choose(n, tight, seq)[0].zero_stage == 1  # ZeRO-1 at the full micro-batch beats ZeRO-0 at 4
    tighter = replace_budget(cfg, estimate(n, cfg, seq, 2, 2).total_gb * 1.001)
    chosen, est = choose(n, tighter, seq)
    # micro-batch 4 fits nowhere, 2 fits ZeRO-2 only if 0 and 1 don't: check the choice is the first that fits
    first = next(
        (s, mb)
        for mb in (8, 4, 2, 1)
        for s in (0, 1, 2)
        if estimate(n, cfg, seq, s, mb).total_gb <= tighter.memory_budget_gb
    )
    assert (chosen.zero_stage, chosen.micro_batch) == first and chosen.micro_batch <= 2
    assert chosen.micro_batch * chosen.grad_accum == 8  # the global batch is kept
    assert est.total_gb <= tighter.memory_budget_gb
    # only sharded weights fit (ZeRO-3 at micro-batch 8 is under ZeRO-2 at 1 here): on CPU workers too
    only3 = replace_budget(cfg, estimate(n, cfg, seq, 3, 8).total_gb * 1.001)
    assert only3.memory_budget_gb < estimate(n, cfg, seq, 2, 1).total_gb and not cfg.use_gpu
    chosen, est = choose(n, only3, seq)
    assert (chosen.zero_stage, chosen.micro_batch, chosen.grad_accum) == (3, 8, 1)
    with pytest.raises(TrainError, match="does not fit.*even at ZeRO-3.*larger memory_budget_gb"):
        choose(n, replace_budget(cfg, 1e-6), seq)


def replace_budget(cfg, gb):
    from dataclasses import replace

    return replace(cfg, memory_budget_gb=gb)


def test_straggler_needs_persistent_slowness_against_peers():
    det = StragglerDetector(world=2, ratio=1.5, patience=3)
    assert det.observe([1.0, 2.0]) == [] and det.observe([1.0, 2.0]) == []
    assert det.observe([1.0, 2.0]) == [1]  # third slow interval in a row
    assert det.observe([1.0, 2.0]) == []  # reported once per streak
    det.observe([1.0, 1.2])  # within 1.5x: streak reset
    assert det.observe([1.0, 2.0]) == []
    assert StragglerDetector(world=3, patience=1).observe([1.0, 1.0, 1.4]) == []


def test_block_order_is_a_pure_function_of_seed_step_rank():
    """n = 5, 2 workers × 2 blocks: step 0 reads samples 0-3 of epoch 0's permutation (rank 0: 0-1,
    rank 1: 2-3); step 1 rank 0 reads sample 4 (last of epoch 0) and sample 5 = epoch 1's first."""
    order = BlockOrder(5, seed=7)
    p0, p1 = np.random.default_rng(7).permutation(5), np.random.default_rng(8).permutation(5)
    assert order.indices(0, 0, 0, 2, 2, 1).tolist() == p0[:2].tolist()
    assert order.indices(0, 0, 1, 2, 2, 1).tolist() == p0[2:4].tolist()
    assert order.indices(1, 0, 0, 2, 2, 1).tolist() == [p0[4], p1[0]]
    assert BlockOrder(5, seed=7).indices(1, 0, 0, 2, 2, 1).tolist() == [p0[4], p1[0]]  # no history needed
    first_epoch = np.concatenate(
        [BlockOrder(40, 1).indices(s, m, r, 2, 4, 5) for s in range(1) for m in range(5) for r in range(2)]
    )
    assert sorted(first_epoch.tolist()) == list(range(40))  # one epoch = every block exactly once


def test_config_errors_list_every_problem():
    with pytest.raises(ConfigError) as err:
        PretrainConfig(
            steps=0,
            schedule="weird",
            zero_stage=5,
            lr=2.0,
            straggler_ratio=0.5,
            model=ModelConfig(hidden=30, heads=4, kv_heads=3),
        ).validate()
    text = "\n".join(err.value.problems)
    for needle in (
        "steps must be ≥ 1",
        "schedule 'weird'",
        "zero_stage",
        "lr must be",
        "straggler_ratio",
        "divisible by model.heads",
        "divisible by model.kv_heads",
    ):
        assert needle in text
    with pytest.raises(ConfigError, match="unknown option 'stpes' \\(did you mean 'steps'\\?\\)"):
        PretrainConfig.from_dict({"stpes": 3})
    assert PretrainConfig(zero_stage=3).validate().zero_stage == 3  # ZeRO-3 on CPU workers too


def test_config_file_round_trip(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("steps: 30\nlr: 0.001\nmodel: {layers: 3, hidden: 96, heads: 4}\n")
    cfg = PretrainConfig.load(str(path))
    assert (cfg.steps, cfg.lr, cfg.model.layers, cfg.model.hidden) == (30, 0.001, 3, 96)
    assert PretrainConfig.from_dict(cfg.to_dict()) == cfg
    path.write_text("steps: thirty\nmodel: {layers: 2.5}\n")
    with pytest.raises(ConfigError) as err:
        PretrainConfig.load(str(path))
    assert err.value.problems == ["steps must be int (got str 'thirty')", "model.layers must be int (got float 2.5)"]
    path.write_text("lr: 3e-3\nsteps: '30'\n")  # PyYAML reads 3e-3 (no dot) as the string '3e-3'
    assert (PretrainConfig.load(str(path)).lr, PretrainConfig.load(str(path)).steps) == (0.003, 30)


@pytest.fixture(scope="module")
def three_shards(tmp_path_factory):
    """3000 blocks of 32 tokens written 1000 per chunk: eval-00000 (ids 0-374), shard-00000 (375-999),
    shard-00001, shard-00002; 16Ki-token row groups hold 512 blocks, so 2 groups in each train file.
    Returns (folder, every train block read independently with pyarrow: ids (2625,), tokens (2625, 32))."""
    folder = tmp_path_factory.mktemp("three")
    write_token_shards(folder, blocks=3000, shard_blocks=1000)
    tables = [pq.read_table(folder / f"shard-0000{i}.parquet") for i in range(3)]
    ids = np.concatenate([t.column("block_id").to_numpy() for t in tables])
    toks = np.array([row for t in tables for row in t.column("input_ids").to_pylist()], dtype=np.int32)
    return folder, ids, toks


def test_token_shards_read_only_the_row_groups_holding_the_blocks(three_shards):
    folder, ids, toks = three_shards
    meta = pq.read_metadata(folder / "shard-00001.parquet")
    assert meta.num_row_groups == 2 and meta.row_group(0).num_rows == ROW_GROUP_TOKENS // 32 == 512
    shards = TokenShards(folder, "train", cache_groups=2)
    assert len(shards) == 2625 and ids.tolist() == list(range(375, 3000))
    idx = np.array([2624, 0, 624, 625, 1137, 5, 2000, 624])  # file ends and starts, row-group edges, repeats
    got_ids, got = shards.take(idx)
    assert got_ids.tolist() == ids[idx].tolist() and np.array_equal(got, toks[idx]) and got.dtype == np.int32
    assert len(shards._cache) == 2  # at most cache_groups decoded row groups are held
    every = shards.take(np.arange(len(shards)))
    assert np.array_equal(every[1], toks) and np.array_equal(every[0], ids)
    clone = pickle.loads(pickle.dumps(shards))  # what a Train worker receives: the location, no blocks
    assert len(pickle.dumps(shards)) < 1000 and np.array_equal(clone.take(idx)[1], toks[idx])
    eval_ids, _ = TokenShards(folder, "eval").take(np.array([0, 374]))
    assert eval_ids.tolist() == [0, 374]
    with pytest.raises(IndexError):
        shards.take(np.array([2625]))


def test_prefetcher_gives_each_micro_batch_of_the_block_order_also_after_a_jump(three_shards):
    folder, ids, toks = three_shards
    shards = TokenShards(folder, "train")
    order = BlockOrder(len(shards), seed=3)
    blocks = Prefetcher(shards, order, rank=1, world=2, micro_batch=4, accum=2)
    try:
        # in order (the read-ahead is used), then a jump as after a resume, then back
        for step, micro in [(0, 0), (0, 1), (1, 0), (1, 1), (7, 1), (8, 0), (2, 0)]:
            idx = order.indices(step, micro, 1, 2, 4, 2)
            got_ids, got = blocks.get(step, micro)
            assert got_ids.tolist() == ids[idx].tolist() and np.array_equal(got, toks[idx]), (step, micro)
    finally:
        blocks.close()


def test_token_shards_stream_from_s3(three_shards, s3):
    """A cluster without a shared filesystem reads the shards from the object store: the same
    blocks through row-group range reads."""
    import pyarrow.fs as pafs

    folder, ids, toks = three_shards
    _, bucket = s3
    fs, root = pafs.FileSystem.from_uri(f"s3://{bucket}/shards")
    pafs.copy_files(str(folder), root, destination_filesystem=fs)
    uri = f"s3://{bucket}/shards"
    assert (read_manifest(uri).num_blocks, read_manifest(uri).num_eval_blocks) == (2625, 375)
    idx = np.array([3, 2600, 1000])
    got_ids, got = TokenShards(uri, "train").take(idx)
    assert got_ids.tolist() == ids[idx].tolist() and np.array_equal(got, toks[idx])


def test_shard_reading_errors(tmp_path):
    with pytest.raises(TrainError, match="not a token-shards artifact"):
        read_manifest(tmp_path)
    make_shards(tmp_path / "ok", blocks=16)
    ids, toks = load_blocks(tmp_path / "ok", "train")
    assert toks.shape == (14, 32) and ids.tolist() == list(range(2, 16))
    m = json.loads((tmp_path / "ok" / "manifest.json").read_text())
    m["files"].append({"file": "shard-00009.parquet", "split": "train"})
    (tmp_path / "ok" / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(TrainError, match="missing: .*shard-00009"):
        read_manifest(tmp_path / "ok")
    bad = {**m, "block_size": "32 tokens", "files": [{"file": "shard-00000.parquet", "split": "test"}]}
    del bad["vocab_size"]
    (tmp_path / "ok" / "manifest.json").write_text(json.dumps(bad))
    with pytest.raises(TrainError) as err:
        TokenShards(tmp_path / "ok", "train")
    assert str(err.value).splitlines()[1:] == [
        "  - block_size must be int (got str '32 tokens')",
        "  - vocab_size is required (int)",
        "  - files[0]: split 'test' is unknown; use one of train, eval",
        "re-run the tokenize step to rewrite the shards",
    ]
    empty = tmp_path / "empty"
    make_shards(empty, blocks=16)
    pq.write_table(
        pa.table({"block_id": pa.array([], pa.int64()), "input_ids": pa.array([], pa.list_(pa.int32()))}),
        empty / "shard-00000.parquet",
    )
    with pytest.raises(TrainError, match="no train blocks"):
        read_manifest(empty)
    ragged = tmp_path / "ragged"
    make_shards(ragged, blocks=16)
    pq.write_table(
        pa.table({"block_id": [2, 3], "input_ids": pa.array([[1] * 32, [1] * 31], pa.list_(pa.int32()))}),
        ragged / "shard-00000.parquet",
    )
    read_manifest(ragged)  # footers look fine; the blocks are checked where they are decoded
    with pytest.raises(TrainError, match="shard-00000.parquet: input_ids rows are not all 32 tokens long"):
        TokenShards(ragged, "train").take(np.array([0]))
    pq.write_table(pa.table({"block_id": [2]}), ragged / "shard-00000.parquet")
    with pytest.raises(TrainError, match="shard-00000.parquet has no input_ids column"):
        read_manifest(ragged)


def test_fault_hooks_are_private_not_config_options(monkeypatch):
    """The drills' hooks are set through RAYPAI_TRAIN_FAULTS (raypai.train._faults), never through
    the user-facing config."""
    for hook, value in (("kill_worker_at_step", 3), ("trace_dir", "/tmp/t")):
        assert hook not in PretrainConfig.__dataclass_fields__
        with pytest.raises(ConfigError, match=f"unknown option '{hook}'"):
            PretrainConfig.from_dict({hook: value})
    monkeypatch.delenv(FAULTS_ENV, raising=False)
    assert Faults.from_env() == Faults()
    monkeypatch.setenv(FAULTS_ENV, Faults(trace_dir="/tmp/t", kill_worker_at_step=3).to_env())
    assert Faults.from_env() == Faults(trace_dir="/tmp/t", kill_worker_at_step=3)
    monkeypatch.setenv(FAULTS_ENV, '{"kill_worker_at_step": 3}')
    with pytest.raises(ValueError, match="kill_worker_at_step needs trace_dir"):
        Faults.from_env()
    monkeypatch.setenv(FAULTS_ENV, '{"kill_at": 3}')
    with pytest.raises(ValueError, match="unknown keys \\['kill_at'\\]"):
        Faults.from_env()


def test_auto_strategy_sizes_an_init_from_model_by_its_own_config(tmp_path):
    """`model.init_from` names a folder whose config.json says 4 layers × hidden 256 with 8 heads,
    while `cfg.model` keeps its defaults (2 × 128, 4 heads). With a budget between the two shapes'
    estimates at ZeRO-0 and micro-batch 8, only the folder's shape shows that this does not fit."""
    from transformers import LlamaConfig, LlamaForCausalLM

    make_shards(tmp_path / "shards", blocks=16)
    hf = LlamaConfig(
        vocab_size=64,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=64,
    )
    model = LlamaForCausalLM(hf)
    model.save_pretrained(tmp_path / "model")
    n = sum(p.numel() for p in model.parameters())
    cfg = PretrainConfig(model=ModelConfig(init_from=str(tmp_path / "model")), strategy="auto", micro_batch=8)
    folder, default = ModelShape(4, 256, 8, 64), ModelShape(2, 128, 4, 64)
    by_default, by_folder = estimate(n, cfg, 32, 0, 8, default), estimate(n, cfg, 32, 0, 8, folder)
    assert by_default.total_gb < by_folder.total_gb
    budget = replace_budget(cfg, (by_default.total_gb + by_folder.total_gb) / 2)
    chosen, info = plan(tmp_path / "shards", budget)
    expected, _ = choose(n, budget, 32, folder)
    assert (chosen.zero_stage, chosen.micro_batch) == (expected.zero_stage, expected.micro_batch) != (0, 8)
    assert info["memory"]["activations_gb"] == pytest.approx(
        activation_bytes(
            layers=4, hidden=256, heads=8, vocab=64, seq_len=32, micro_batch=chosen.micro_batch, mixed_precision=False
        )
        / GB
    )


def test_snapshot_buffers_copy_values_into_reused_memory():
    import torch

    from raypai.train.checkpoint import SnapshotBuffers

    state = {
        "module": {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3)},
        "optimizer": {"state": [(torch.zeros(4), 7)], "lr": 0.1},
        "step": 3,
    }
    bufs = SnapshotBuffers()
    first = bufs.copy(state, ("model.pt",))
    assert torch.equal(first["module"]["w"], state["module"]["w"]) and first["optimizer"]["state"][0][1] == 7
    assert first["module"]["w"].data_ptr() != state["module"]["w"].data_ptr()  # a copy, not a view
    assert first["optimizer"]["lr"] == 0.1 and first["step"] == 3 and isinstance(first["optimizer"]["state"][0], tuple)
    ptr = first["module"]["w"].data_ptr()
    torch.save(first, "/dev/null")  # serializable as DeepSpeed's own clones are

    state["module"]["w"].add_(10.0)  # training moves on
    assert first["module"]["w"][0, 0].item() == 0.0  # the snapshot keeps the values it copied
    second = bufs.copy(state, ("model.pt",))
    assert second["module"]["w"].data_ptr() == ptr  # same memory, no new allocation
    assert torch.equal(second["module"]["w"], state["module"]["w"])
    assert bufs.nbytes == (6 + 3 + 4) * 4

    state["module"]["w"] = torch.zeros(5, dtype=torch.float64)  # a changed shape gets a new buffer
    third = bufs.copy(state, ("model.pt",))
    assert third["module"]["w"].dtype == torch.float64 and torch.equal(
        third["module"]["w"], torch.zeros(5, dtype=torch.float64)
    )
    assert bufs.copy({"w": torch.ones(2)}, ("other.pt",))["w"].data_ptr() != third["module"]["w"].data_ptr()


def test_token_shards_manifest_reads_what_the_tokenizer_writes(tmp_path):
    """The keys raypai.data.tokenizer writes (see its `tokenize`) parse into the typed manifest and
    come back unchanged; synthetic shards use the same type."""
    from raypai.token_shards import ShardFile, TokenShardsManifest

    written = {
        "kind": "token_shards",
        "block_size": 128,
        "num_blocks": 90,
        "num_eval_blocks": 5,
        "num_tokens": 11520,
        "documents": 40,
        "vocab_size": 512,
        "eos_id": 2,
        "tokenizer_digest": "ab12",
        "files": [
            {"file": "shard-00000.parquet", "split": "train", "blocks": 90},
            {"file": "eval-00000.parquet", "split": "eval", "blocks": 5},
        ],
        "unigram_entropy_nats": 5.1,
        "content_sha256": "cd34",
    }
    manifest = TokenShardsManifest.from_dict(written)
    assert manifest.files_of("eval") == ["eval-00000.parquet"] and manifest.files[0] == ShardFile(
        "shard-00000.parquet", "train", 90
    )
    assert manifest.to_dict() == written
    with pytest.raises(ConfigError, match="kind is 'dataset', not 'token_shards'"):
        TokenShardsManifest.from_dict({**written, "kind": "dataset"})
    synthetic = write_token_shards(tmp_path, blocks=16)
    assert TokenShardsManifest.from_dict(synthetic) == read_manifest(tmp_path)


def test_the_controller_poll_interval_is_set_for_the_run_only_and_a_user_value_wins(monkeypatch):
    """Ray Train's controller polls every 2 s by default and takes one report per poll: raypai
    shortens the interval for its own run (Ray Train forwards the variable to its controller)."""
    import os

    from raypai.train.trainer import CONTROLLER_POLL_ENV, CONTROLLER_POLL_S, _controller_poll_interval

    monkeypatch.delenv(CONTROLLER_POLL_ENV, raising=False)
    with _controller_poll_interval():
        assert float(os.environ[CONTROLLER_POLL_ENV]) == CONTROLLER_POLL_S < 2.0
    assert CONTROLLER_POLL_ENV not in os.environ
    monkeypatch.setenv(CONTROLLER_POLL_ENV, "5")
    with _controller_poll_interval():
        assert os.environ[CONTROLLER_POLL_ENV] == "5"
    assert os.environ[CONTROLLER_POLL_ENV] == "5"


def test_the_plan_sizes_the_model_on_the_meta_device_without_weights(tmp_path):
    """The driver's plan needs the parameter count and shape only: `weights=False` builds the
    architecture on the meta device (nothing allocated or initialized), with the same count as the
    real model; an init_from folder must still hold weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from raypai.train.model import build_model, param_count

    cfg = ModelConfig(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, max_positions=64)
    real, meta = build_model(cfg, 64), build_model(cfg, 64, weights=False)
    assert {p.device.type for p in meta.parameters()} == {"meta"} and param_count(meta) == param_count(real)
    src = tmp_path / "model"
    LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
        )
    ).save_pretrained(src)
    folder = build_model(ModelConfig(init_from=str(src)), 64, weights=False)
    assert {p.device.type for p in folder.parameters()} == {"meta"} and folder.config.hidden_size == 32
    (src / "model.safetensors").unlink()
    with pytest.raises(TrainError, match="init_from=.*no weights there"):
        build_model(ModelConfig(init_from=str(src)), 64, weights=False)


def test_deepspeed_is_imported_without_mlflow_and_mlflow_stays_importable():
    """Every trainer actor and Ray Train worker imports DeepSpeed; its autotuner's optional
    `import mlflow` (≈ 1.2 s of CPU) is refused for that import only."""
    import os
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from raypai.train._deepspeed import import_deepspeed\n"
        "ds = import_deepspeed()\n"
        "assert ds.initialize and 'mlflow' not in sys.modules, sorted(m for m in sys.modules if 'mlflow' in m)\n"
        "import mlflow\n"
        "assert mlflow.__version__ and sys.modules['mlflow'] is mlflow\n"
        "from deepspeed.autotuning.autotuner import has_mlflow\n"
        "print('ok', has_mlflow)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "DS_ACCELERATOR": "cpu"},
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("ok False"), out.stdout + out.stderr
