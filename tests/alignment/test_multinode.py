"""Roles on a 2-node Ray cluster (`ray.cluster_utils.Cluster`: two raylets on this machine, each with
CPUs and one GPU of its own; the GPUs are logical, Ray reserves and hands them out, nothing computes
on them). A `separate` layout over 2 GPUs must span both nodes, colocated ranks share their node, and
a CPU-only run spread over both nodes prints its plan too; every actor runs on the node the printed
plan names (checked against the node id each actor reports). A plan the cluster cannot hold (more
GPUs than it has, or a bundle no single node can hold though the cluster's sum could) is refused at
once with the fix."""

import time
from pathlib import Path

import pytest
import ray
import torch
from ray._common.utils import get_ray_address_file
from ray.cluster_utils import Cluster

from raypai.alignment.placement import Placement, RoleSpec
from raypai.errors import ConfigError

HEAD = {"num_cpus": 3, "num_gpus": 1}
WORKER = {"num_cpus": 2, "num_gpus": 1}


@pytest.fixture(scope="module")
def two_nodes():
    """{"head": node id, "worker": node id} of a fresh 2-node cluster the test process is connected
    to; the driver is disconnected and both nodes stopped at the module's end, so the next module
    starts its own Ray (tests/conftest.py's shared one sees none running and starts it)."""
    if ray.is_initialized():
        ray.shutdown()  # the shared Ray a module before this one left
    # the Cluster writes its address to Ray's "current cluster" file and deletes it at shutdown: the one
    # a colleague's `ray start` wrote there is put back after
    current = Path(get_ray_address_file(None))
    before = current.read_text() if current.exists() else None
    # ports: Ray's own choice (0 / None) everywhere, as local services hold the default ones
    cluster = Cluster(
        initialize_head=True,
        head_node_args={**HEAD, "include_dashboard": False, "dashboard_agent_listen_port": None},
    )
    try:
        worker = cluster.add_node(**WORKER, dashboard_agent_listen_port=None)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        yield {"head": cluster.head_node.node_id, "worker": worker.node_id}
    finally:
        ray.shutdown()
        cluster.shutdown()
        if before is not None:
            current.write_text(before)


class Role:
    """Stands where a role would; asked where it runs through `__ray_call__`."""


def _node_of(actor) -> str:
    return ray.get(actor.__ray_call__.remote(lambda _self: ray.get_runtime_context().get_node_id()))


def _placed(p: Placement) -> dict[str, list[str]]:
    """{role: the node id each of its actors runs on}, rank by rank."""
    return {role: [_node_of(a) for a in p.place(role, Role)] for role in p.specs}


def _planned(p: Placement) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for row in p.layout():
        out.setdefault(row["role"], []).append(row["node_id"])
    return out


def test_separate_roles_span_both_nodes_where_the_printed_plan_says(two_nodes, capsys):
    specs = {
        "policy": RoleSpec(cpus=1, gpus=1),
        "rollout": RoleSpec(cpus=1, gpus=1),
        "reward": RoleSpec(cpus=0.5),  # a CPU role
    }
    p = Placement("sep2", specs, gpus=2, placement="separate")
    printed = capsys.readouterr().out  # before any actor was placed
    try:
        planned = _planned(p)
        got = _placed(p)
    finally:
        p.shutdown()
    assert got == planned, (got, planned)
    # one GPU per node: the two GPU roles cannot share a node
    assert {got["policy"][0], got["rollout"][0]} == {two_nodes["head"], two_nodes["worker"]}
    assert "[raypai.placement] sep2: 3 actors" in printed
    for role, nodes in got.items():  # the table names each actor's node
        [line] = [x for x in printed.splitlines() if x.strip().startswith(f"{role}-0 ")]
        assert nodes[0][:8] in line, (line, nodes)


def test_colocated_ranks_share_their_node_and_a_spread_cpu_run_prints_its_plan(two_nodes, capsys):
    colo = {"policy": RoleSpec(cpus=0.5, gpus=0.5, replicas=2), "rollout": RoleSpec(cpus=0.5, gpus=0.5, replicas=2)}
    p = Placement("colo2", colo, gpus=2, placement="colocated")
    try:
        planned, got = _planned(p), _placed(p)
    finally:
        p.shutdown()
    assert got == planned, (got, planned)
    for i in (0, 1):  # rank i of both roles time-shares GPU i, so it is on GPU i's node
        assert got["policy"][i] == got["rollout"][i]
    assert set(got["policy"]) == {two_nodes["head"], two_nodes["worker"]}

    # one GPU's colocated roles: one bundle, packed onto one node
    packed = {"policy": RoleSpec(cpus=1, gpus=0.5), "rollout": RoleSpec(cpus=1, gpus=0.5)}
    p = Placement("packed", packed, colocate=(("policy", "rollout"),), gpus=0.5)
    try:
        planned, got = _planned(p), _placed(p)
    finally:
        p.shutdown()
    assert got == planned and got["policy"] == got["rollout"], (got, planned)
    capsys.readouterr()

    # CPU roles of 2 CPUs each: no node holds both (3 and 2 CPUs), so the run spans both nodes and,
    # though it has no GPU, its plan is printed
    spread = {"policy": RoleSpec(cpus=2), "rollout": RoleSpec(cpus=2)}
    p = Placement("spread", spread)
    printed = capsys.readouterr().out
    try:
        planned, got = _planned(p), _placed(p)
    finally:
        p.shutdown()
    assert got == planned, (got, planned)
    assert {got["policy"][0], got["rollout"][0]} == {two_nodes["head"], two_nodes["worker"]}
    assert "[raypai.placement] spread: 2 actors" in printed
    for role in spread:
        [line] = [x for x in printed.splitlines() if x.strip().startswith(f"{role}-0 ")]
        assert got[role][0][:8] in line


def test_a_plan_the_cluster_cannot_hold_is_refused_with_the_fix(two_nodes):
    three = {"policy": RoleSpec(cpus=0.5, gpus=1, replicas=2), "rollout": RoleSpec(cpus=0.5, gpus=1)}
    with pytest.raises(ConfigError, match=r"GPU: the roles of 'three' need 3, the cluster has 2") as err:
        Placement("three", three, gpus=3, placement="separate")
    assert "run on a Ray cluster with that many GPUs" in str(err.value)
    # 4 CPUs in one colocated bundle: the cluster has 5, but no node more than 3
    t0 = time.monotonic()
    big = {"policy": RoleSpec(cpus=2, gpus=0.5), "rollout": RoleSpec(cpus=2, gpus=0.5)}
    with pytest.raises(ConfigError, match=r"no node of the cluster can hold") as err:
        Placement("big", big, colocate=(("policy", "rollout"),), gpus=0.5)
    assert "4 CPUs" in str(err.value) and "largest node has 3 CPUs" in str(err.value)
    assert "smaller RoleSpec.cpus" in str(err.value)
    assert time.monotonic() - t0 < 10  # refused, not left waiting for a placement group
    assert not ray.util.placement_group_table() or all(
        pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values()
    )


def _state_of(actor) -> dict:
    return ray.get(
        actor.__ray_call__.remote(lambda r: {k: v.detach().clone() for k, v in r.model.state_dict().items()})
    )


@pytest.mark.scale
@pytest.mark.parametrize("transport", ["object_store", "collective"])
def test_a_zero3_policy_on_one_node_syncs_exactly_to_replicas_on_the_other(two_nodes, tiny_model, transport):
    """2 ZeRO-3 ranks of 1.5 CPUs and 2 rollout replicas of 1 CPU fill the 3 + 2 CPUs one way only:
    the ranks on the head node, the replicas on the worker. The sync then goes through the object
    store (no shared memory between nodes) in 4 KB gathered buckets put one by one (no rank holds a
    whole copy: `Trainer.state_parts`), or is broadcast bucket by bucket over a gloo group of the
    trainer's rank 0 and the replicas (`weight_transport="collective"`, the group made at the first
    sync and used again at the second); each replica holds exactly the trained weights."""
    from transformers import AutoModelForCausalLM

    from raypai.alignment import SFTConfig
    from raypai.alignment._driver import Run
    from raypai.alignment._tensors import batch_of, encode_all
    from raypai.alignment.data import sft_examples
    from raypai.alignment.losses.objectives import SFT
    from raypai.alignment.models import format_and_limit
    from raypai.alignment.roles import Rollout
    from raypai.alignment.sync import sync_weights
    from raypai.alignment.tasks import arithmetic as ar

    fmt, trunc = format_and_limit(tiny_model, SFTConfig())
    enc = encode_all(fmt, sft_examples(ar.sft_rows(ar.split()[0])), trunc, "training")
    batch = batch_of(enc, list(range(4)), fmt.tok.pad_token_id)
    specs = {"policy": RoleSpec(cpus=1.5, replicas=2), "rollout": RoleSpec(cpus=1, replicas=2)}
    with Run("xnode", specs) as run:
        policy = run.place_policy(tiny_model, SFTConfig(precision="fp32", lr=1e-2, zero_stage=3, ranks=2))
        rollouts = run.place("rollout", Rollout, tiny_model)
        ranks_at = [_node_of(a) for a in policy.actors]
        replicas_at = [_node_of(r) for r in rollouts]
        ray.get([a.__ray_call__.remote(lambda t: setattr(t, "sync_bucket_bytes", 4096)) for a in policy.actors])
        for _ in range(2):
            ray.get(policy.update.remote(SFT(), SFT().assemble(batch)))
            out = sync_weights(policy, rollouts, transport=transport)
        buckets = ray.get(policy.actors[0].__ray_call__.remote(lambda t: t.sync_buckets))
        want = ray.get(policy.state_dict.remote())
        got = [_state_of(r) for r in rollouts]
        run.summary = None
    assert ranks_at == [two_nodes["head"]] * 2 and replicas_at == [two_nodes["worker"]] * 2, (ranks_at, replicas_at)
    assert out["sync_bytes"] > 0 and buckets > 5, buckets  # a tiny model's ~100 KB in 4 KB buckets
    start = AutoModelForCausalLM.from_pretrained(tiny_model).state_dict()
    assert max(float((want[k] - start[k]).abs().max()) for k in want) > 1e-3  # trained weights were synced
    for state in got:
        assert all(torch.equal(state[k], want[k]) for k in want)
