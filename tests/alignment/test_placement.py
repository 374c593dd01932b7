"""Roles laid out over several GPUs (raypai.alignment.placement): colocated (rank i of every GPU role
time-shares GPU i) and separate (a GPU per rank), on a real Ray whose GPUs are logical (this machine
has none: Ray reserves, numbers and hands them out; nothing computes on them). The layout is printed
before any actor starts, and one the run or the cluster cannot hold is refused with the fix."""

import pytest
import ray
import torch

from raypai.alignment.placement import Placement, RoleSpec, split_groups
from raypai.errors import ConfigError

SPECS = {
    "policy": RoleSpec(cpus=0.5, gpus=0.5, replicas=2),
    "rollout": RoleSpec(cpus=0.5, gpus=0.25, replicas=2),
    "reference": RoleSpec(cpus=0.5, gpus=0.25, replicas=2),
    "reward": RoleSpec(cpus=0.25),  # a CPU role
}


@pytest.fixture(scope="module")
def ray_gpus(shared_ray):
    return shared_ray(num_cpus=8, num_gpus=6)


class Where:
    """Stands where a role would: reports the GPUs Ray gave this process."""

    def gpus(self) -> list[str]:
        return [str(g) for g in ray.get_runtime_context().get_accelerator_ids().get("GPU", [])]


def _placed(placement: Placement) -> dict[str, list[list[str]]]:
    out = {}
    for role in SPECS:
        actors = placement.place(role, Where)
        out[role] = ray.get([a.gpus.remote() for a in actors])
    return out


def test_colocated_ranks_share_their_gpu_with_the_other_roles_ranks(ray_gpus, capsys):
    p = Placement("colo", SPECS, gpus=2, placement="colocated")
    printed = capsys.readouterr().out  # before any actor was placed
    assert "[raypai.placement] colo: 7 actors" in printed
    for row in ("policy-0", "policy-1", "rollout-1", "reference-0", "reward-0"):
        assert row in printed
    try:
        got = _placed(p)
    finally:
        p.shutdown()
    for i in (0, 1):  # rank i of every GPU role on one GPU, a different one for each i
        assert len({g for role in ("policy", "rollout", "reference") for g in got[role][i]}) == 1, got
    assert got["policy"][0] != got["policy"][1]
    assert got["reward"] == [[]]  # the CPU role holds no GPU


def test_separate_gives_every_rank_a_gpu_of_its_own(ray_gpus):
    p = Placement("sep", SPECS, gpus=6, placement="separate")
    try:
        got = _placed(p)
    finally:
        p.shutdown()
    ids = [g for role in ("policy", "rollout", "reference") for gs in got[role] for g in gs]
    assert len(ids) == 6 and len(set(ids)) == 6, got


def test_a_layout_the_run_or_the_cluster_cannot_hold_is_refused_with_the_fix(ray_gpus):
    with pytest.raises(ConfigError, match=r"= 6 GPUs, the run has gpus=4") as err:
        Placement("few", SPECS, gpus=4, placement="separate")
    assert "set gpus=6, or placement='colocated'" in str(err.value)
    with pytest.raises(ConfigError, match=r"GPU: the roles of 'big' need 8, the cluster has 6"):
        Placement("big", SPECS, gpus=8, placement="colocated")
    over = {**SPECS, "critic": RoleSpec(cpus=0.5, gpus=0.5, replicas=2)}  # 1.5 of each GPU
    with pytest.raises(ConfigError, match="shared beyond itself"):
        Placement("over", over, gpus=2, placement="colocated")


# ---- rollout replicas over several GPUs (rollout_tensor_parallel, the vLLM engine's Ray executor) ----
TP = {
    "policy": RoleSpec(cpus=0.5, gpus=0.5, replicas=2),
    "rollout": RoleSpec(cpus=0.5, gpus=0.25, replicas=2, tensor_parallel=2),
    "reward": RoleSpec(cpus=0.25),
}


class Replica(Where):
    """Stands where a tensor-parallel rollout replica would: starts its engine's GPU workers as vLLM's
    Ray executor does, from the environment `_vllm.engine_args` sets (VLLM_RAY_BUNDLE_INDICES,
    VLLM_RAY_PER_WORKER_GPUS), each a child of the placement group this actor finds itself in
    (`ray.util.get_current_placement_group`, which vLLM reads), and reports the GPUs they were given."""

    def workers(self, env: dict) -> list[list[str]]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        pg = ray.util.get_current_placement_group()
        assert pg is not None, "the replica is not in the run's placement group"
        bundles = [int(b) for b in env["VLLM_RAY_BUNDLE_INDICES"].split(",")]
        per_worker = float(env["VLLM_RAY_PER_WORKER_GPUS"])
        workers = [
            ray.remote(Where)
            .options(
                num_cpus=0,
                num_gpus=per_worker,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    pg, placement_group_bundle_index=b, placement_group_capture_child_tasks=True
                ),
            )
            .remote()
            for b in bundles
        ]
        try:
            return ray.get([w.gpus.remote() for w in workers], timeout=60)
        finally:
            for w in workers:
                ray.kill(w)


def _tp_placed(placement: Placement) -> tuple[list[list[str]], list[list[list[str]]], list[list[str]]]:
    """(GPUs of each policy rank, GPUs of each rollout replica's workers, GPUs each replica's actor holds)."""
    from raypai.alignment.roles._vllm import engine_args

    policy = ray.get([a.gpus.remote() for a in placement.place("policy", Where)])
    replicas = placement.place("rollout", Replica)
    envs = [
        engine_args(
            "m",
            device="cuda",
            dtype=torch.bfloat16,
            max_model_len=64,
            gpu_share=placement.share["rollout"],
            **placement.tensor_parallel("rollout", i),
        )[1]
        for i in range(len(replicas))
    ]
    workers = ray.get([r.workers.remote(env) for r, env in zip(replicas, envs)])
    own = ray.get([r.gpus.remote() for r in replicas])
    return policy, workers, own


def test_colocated_tensor_parallel_replicas_time_share_aligned_blocks_of_gpus(ray_gpus, capsys):
    p = Placement("tp-colo", TP, gpus=4, placement="colocated")
    printed = capsys.readouterr().out
    assert p.gpus_of["rollout"] == [[0, 1], [2, 3]] and p.group_of["rollout"] == [0, 2]
    assert p.tensor_parallel("rollout", 1) == {"tensor_parallel": 2, "gpu_bundles": [2, 3]}
    assert p.tensor_parallel("policy", 0) == {}
    assert "0.25×2" in printed and "tensor parallel over the GPUs of bundles 2,3" in printed
    try:
        policy, workers, own = _tp_placed(p)
    finally:
        p.shutdown()
    assert own == [[], []]  # the replicas' actors hold no GPU: their workers do
    assert [len(set(w[0] for w in ws)) for ws in workers] == [2, 2], workers  # two GPUs per replica
    gpus = [w[0] for ws in workers for w in ws]
    assert len(set(gpus)) == 4, workers  # the two replicas on different GPUs: all four used
    # colocated: policy rank i time-shares GPU i with replica 0's worker i
    assert policy[0] == workers[0][0] and policy[1] == workers[0][1], (policy, workers)


def test_separate_tensor_parallel_replicas_get_whole_gpus_of_their_own(ray_gpus):
    p = Placement("tp-sep", TP, gpus=6, placement="separate")
    assert p.share["rollout"] == 1.0 and [len(g) for g in p.gpus_of["rollout"]] == [2, 2]
    try:
        policy, workers, own = _tp_placed(p)
    finally:
        p.shutdown()
    gpus = [g for gs in policy for g in gs] + [w[0] for ws in workers for w in ws]
    assert len(gpus) == 6 and len(set(gpus)) == 6, (policy, workers)  # nothing shared
    assert own == [[], []]


def test_a_tensor_parallel_layout_the_run_cannot_hold_is_refused_with_the_fix(ray_gpus):
    with pytest.raises(ConfigError, match=r"rollout 2 × 2 \(tensor parallel\) = 6 GPUs, the run has gpus=4") as err:
        Placement("tp-few", TP, gpus=4, placement="separate")
    assert "smaller rollout_tensor_parallel" in str(err.value)
    with pytest.raises(ConfigError, match="does not divide into") as err:
        Placement("tp-odd", TP, gpus=3, placement="colocated")
    assert "set gpus to a multiple of 2" in str(err.value)
    with pytest.raises(ConfigError, match=r"but the run has gpus=1: set gpus to at least 2 whole GPUs"):
        Placement("tp-one", TP, gpus=1)
    big = {"rollout": RoleSpec(cpus=0.5, gpus=1, tensor_parallel=8)}
    with pytest.raises(ConfigError, match="cannot hold"):
        Placement("tp-big", big, gpus=4, placement="colocated")


def test_a_tensor_parallel_group_split_over_nodes_is_named():
    gpus_of = {"rollout": [[0, 1], [2, 3]], "policy": [[4], [5]]}
    node_of = {0: "node-a", 1: "node-b", 2: "node-a", 3: "node-a", 4: "node-a", 5: "node-b"}
    [problem] = split_groups(gpus_of, node_of)  # the policy's ranks may sit on any node
    assert problem.startswith("rollout-0's 2 GPUs (bundles 0, 1) landed on 2 nodes (node-a, node-b)")
    assert split_groups(gpus_of, dict.fromkeys(range(6), "node-a")) == []


def test_the_vllm_engine_arguments_of_a_tensor_parallel_replica():
    """What `VllmEngine` hands vLLM (it has not run with TP > 1 here: no machine with several GPUs,
    vLLM and Ray): k workers through Ray's executor, in the replica's bundles, each its share of a GPU."""
    from raypai.alignment.roles._vllm import GPU_MEMORY_CAP, engine_args

    kwargs, env = engine_args(
        "m",
        device="cuda",
        dtype=torch.bfloat16,
        max_model_len=64,
        gpu_share=0.25,
        tensor_parallel=2,
        gpu_bundles=(2, 3),
    )
    assert kwargs["tensor_parallel_size"] == 2 and kwargs["distributed_executor_backend"] == "ray"
    assert kwargs["gpu_memory_utilization"] == 0.25 and kwargs["dtype"] == "bfloat16"
    assert env["VLLM_RAY_BUNDLE_INDICES"] == "2,3" and env["VLLM_RAY_PER_WORKER_GPUS"] == "0.25"
    one, one_env = engine_args("m", device="cuda", dtype=torch.bfloat16, max_model_len=64, gpu_share=1.0)
    assert "tensor_parallel_size" not in one and "distributed_executor_backend" not in one
    assert one["gpu_memory_utilization"] == GPU_MEMORY_CAP  # a whole GPU: CUDA's context keeps the rest
    assert "VLLM_RAY_BUNDLE_INDICES" not in one_env and one_env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    with pytest.raises(ConfigError, match=r"needs that many GPU bundles .* \(got \[2\]\)"):
        engine_args("m", device="cuda", dtype=torch.bfloat16, max_model_len=64, tensor_parallel=2, gpu_bundles=(2,))
    with pytest.raises(ConfigError, match="on CPUs set it to 1"):
        engine_args("m", device="cpu", dtype=torch.float32, max_model_len=64, tensor_parallel=2, gpu_bundles=(0, 1))


def test_rollout_tensor_parallel_is_checked_with_the_config():
    from raypai.alignment.config import GRPOConfig, PPOConfig

    ok = GRPOConfig(rollout_engine="vllm", rollout_tensor_parallel=2, gpus=4)
    assert ok.rollout_tensor_parallel == 2
    with pytest.raises(ConfigError) as err:
        GRPOConfig(rollout_tensor_parallel=2, gpus=4)
    assert "which only vLLM does (rollout_engine is 'raypai'): set rollout_engine='vllm'" in str(err.value)
    with pytest.raises(ConfigError, match=r"but gpus=1: set gpus to at least 2"):
        PPOConfig(rollout_engine="vllm", rollout_tensor_parallel=2, gpus=1)
    with pytest.raises(ConfigError, match="gpus=6 does not divide into: set gpus to a multiple of 4"):
        GRPOConfig(rollout_engine="vllm", rollout_tensor_parallel=4, gpus=6)
    assert GRPOConfig(rollout_engine="vllm", rollout_tensor_parallel=4, gpus=6, placement="separate").gpus == 6
    with pytest.raises(ConfigError, match=r"rollout_tensor_parallel must be > 0 \(got 0\)"):
        GRPOConfig(rollout_tensor_parallel=0)


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_rollout_replicas_over_several_gpus_each_hold_the_rollouts_share_of_their_own_gpu(algo):
    """On one GPU the replicas split the rollout's share of it; on 8 GPUs, 8 replicas land one per
    GPU and each holds the whole share there (it was divided by the replicas as well: 1/16 of a GPU)."""
    from raypai.alignment import GRPOConfig, PPOConfig
    from raypai.alignment.placement import gpu_layout

    if algo == "grpo":
        from raypai.alignment.grpo import role_specs

        one, whole = GRPOConfig(gpus=1, rollout_replicas=2), 0.5
        specs = lambda cfg: role_specs(cfg, use_rm=False)  # noqa: E731
    else:
        from raypai.alignment.ppo import role_specs

        one, whole = PPOConfig(gpus=1, rollout_replicas=2), 0.2
        specs = lambda cfg: role_specs(cfg, use_rm=False)  # noqa: E731
    assert specs(one)["rollout"].gpus == pytest.approx(whole / 2)
    eight = (GRPOConfig if algo == "grpo" else PPOConfig)(gpus=8, rollout_replicas=8, ranks=8)
    _, group_of, _, share = gpu_layout(specs(eight), 8, "colocated")
    assert sorted(group_of["rollout"]) == list(range(8)) and share["rollout"] == pytest.approx(whole)
    per_gpu = [sum(share[r] * group_of[r].count(i) for r in share) for i in range(8)]
    assert max(per_gpu) <= 1 + 1e-9 and min(per_gpu) >= 0.8, per_gpu  # every GPU mostly used, none beyond
