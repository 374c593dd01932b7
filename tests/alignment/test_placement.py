"""Roles laid out over several GPUs (raypai.alignment.placement): colocated (rank i of every GPU role
time-shares GPU i) and separate (a GPU per rank), on a real Ray whose GPUs are logical (this machine
has none: Ray reserves, numbers and hands them out; nothing computes on them). The layout is printed
before any actor starts, and one the run or the cluster cannot hold is refused with the fix."""

import pytest
import ray

from raypai.alignment.placement import Placement, RoleSpec
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
