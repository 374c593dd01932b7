"""The weight group's protocol (`raypai.alignment.sync_group`) between two gloo members in one
process (a thread each): the manifest, the bucketed broadcast, the checks. Across Ray actors and
nodes: tests/alignment/test_multinode.py."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from raypai.alignment import sync_group as G


def _pair(sender_fn, receiver_fn):
    """Run rank 0 (`sender_fn(group)`) and rank 1 (`receiver_fn(group)`) of a fresh gloo group."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    out, errors = {}, []

    def member(rank, fn):
        try:
            out[rank] = fn(G.open_group("127.0.0.1", store.port, rank, 2, "gloo", 30))
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    threads = [threading.Thread(target=member, args=(r, f)) for r, f in ((0, sender_fn), (1, receiver_fn))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return out


@pytest.mark.parametrize("family", ["raypai", "gpt2"])
def test_a_broadcast_in_small_buckets_gives_the_replica_the_trainers_weights_in_its_dtype(family, tmp_path):
    """fp32 weights sent into a bf16 replica of another seed, 4 KB buckets: the replica ends with
    exactly the sender's weights rounded to bf16 (tied heads included), and it did not before."""
    from raypai.alignment.tasks.tiny import build_tiny_model

    src = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "a", family=family))
    dst = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "b", family=family, seed=1)).to(
        torch.bfloat16
    )
    state = src.state_dict()
    buckets = G.manifest([(k, tuple(v.shape), torch.bfloat16) for k, v in state.items()], 4096)
    assert len(buckets) > 5
    G.check_against(buckets, dst.state_dict())
    want = {k: v.to(torch.bfloat16) for k, v in state.items()}
    assert any(not torch.equal(dst.state_dict()[k], v) for k, v in want.items())
    sizes = _pair(
        lambda g: G.send(g, iter(state.items()), buckets, torch.device("cpu")),
        lambda g: G.receive(g, buckets, dst.state_dict(), torch.device("cpu")),
    )
    got = dst.state_dict()
    assert all(torch.equal(got[k], v) for k, v in want.items())
    assert sizes[0] == sizes[1] >= sum(v.numel() * 2 for v in want.values())


def test_a_replica_of_another_model_is_refused_by_name(tmp_path):
    from raypai.alignment.tasks.tiny import build_tiny_model

    small = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "a", hidden=64)).state_dict()
    wide = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "b", hidden=96)).state_dict()
    buckets = G.manifest([(k, tuple(v.shape), v.dtype) for k, v in small.items()], 2**20)
    with pytest.raises(RuntimeError, match=r"differ in \d+ tensors \(first: .*sent \(.*held \("):
        G.check_against(buckets, wide)


def test_a_trainer_producing_tensors_out_of_its_manifests_order_fails_before_sending(tmp_path):
    from raypai.alignment.tasks.tiny import build_tiny_model

    state = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "a")).state_dict()
    buckets = G.manifest([(k, tuple(v.shape), v.dtype) for k, v in state.items()], 2**30)  # one bucket
    swapped = list(state.items())
    swapped[0], swapped[1] = swapped[1], swapped[0]
    with pytest.raises(RuntimeError, match="where its manifest has"):
        G.send(None, iter(swapped), buckets, torch.device("cpu"))  # fails while packing, before any broadcast


def test_weight_transport_is_checked_with_the_config():
    from raypai.alignment import GRPOConfig, PPOConfig
    from raypai.errors import ConfigError

    assert GRPOConfig(weight_transport="collective").weight_transport == "collective"
    with pytest.raises(ConfigError, match=r"GRPOConfig.weight_transport 'nccl' is unknown; choose one of object_store"):
        GRPOConfig(weight_transport="nccl")
    with pytest.raises(ConfigError, match=r"weight_transport='collective' with LoRA"):
        PPOConfig(weight_transport="collective", lora_r=4)
