"""Role actors on real Ray + DeepSpeed (CPU): separate named processes, exact weight sync,
frozen reference, rule and callable rewards, a critic, and a placement that cannot fit."""

import os
import sys
import time

import pytest
import ray
import torch
from ray.util.state import list_actors
from transformers import AutoTokenizer

from raypai.alignment._loop import asleep
from raypai.alignment._tensors import encode_sft
from raypai.alignment.data import sft_examples
from raypai.alignment.losses.objectives import SFT, PPOPolicy, PPOValue
from raypai.alignment.placement import Placement, RoleSpec
from raypai.alignment.roles import Reference, Reward, Rollout, Trainer
from raypai.alignment.sync import start_sync, sync_weights, wait_loads
from raypai.alignment.tasks import arithmetic as ar
from raypai.chat import ChatFormat
from raypai.errors import ConfigError


def length_bonus(prompts, completions, **_):
    return [0.5 * len(c) for c in completions]


def test_roles_are_separate_named_actors_and_weight_sync_is_exact(ray_align, tiny_model):
    place = Placement(
        "roles-test",
        {
            "policy": RoleSpec(1),
            "rollout": RoleSpec(0.5),
            "reference": RoleSpec(0.5),
            "reward": RoleSpec(0.25),
            "critic": RoleSpec(0.5),
        },
    )
    try:
        [policy] = place.place("policy", Trainer, tiny_model, 1e-2)
        [rollout] = place.place("rollout", Rollout, tiny_model)
        [reference] = place.place("reference", Reference, tiny_model)
        [reward] = place.place("reward", Reward, [(ar.exact_match_reward, 1.0), (length_bonus, 0.1)])
        [critic] = place.place("critic", Trainer, tiny_model, 1e-3, head="token_value")
        tok = AutoTokenizer.from_pretrained(tiny_model)
        batch = encode_sft(ChatFormat(tok), sft_examples(ar.sft_rows([ar.Problem("1+2=", 3), ar.Problem("3+4=", 7)])))
        ray.get([a.__ray_ready__.remote() for a in (policy, rollout, reference, reward, critic)])
        names = {
            a.name: a.pid
            for a in list_actors(address=ray_align, filters=[("state", "=", "ALIVE")])
            if a.name.startswith("roles-test/")
        }
        assert set(names) == {f"roles-test/{r}-0" for r in ("policy", "rollout", "reference", "reward", "critic")}
        assert len(set(names.values())) == 5  # five processes

        ray.get(policy.update.remote(SFT(), {"seq": batch}))  # the trainer moves away from the rollout's weights
        before = ray.get(rollout.logprobs.remote(batch))
        trained = ray.get(policy.logprobs.remote(batch))
        assert not torch.allclose(before, trained)
        stats = sync_weights(policy, [rollout], shared=False)  # through the object store (replicas on other nodes)
        after = ray.get(rollout.logprobs.remote(batch))
        torch.testing.assert_close(after, trained, atol=1e-5, rtol=0)  # same tokens, same log-probs after sync
        assert stats["sync_bytes"] > 100_000 and stats["sync_seconds"] > 0

        # same node: through shared memory, exact, and the buffer's file is gone once the replica mapped it
        ray.get(policy.update.remote(SFT(), {"seq": batch}))
        trained = ray.get(policy.logprobs.remote(batch))
        shm = sync_weights(policy, [rollout])
        torch.testing.assert_close(ray.get(rollout.logprobs.remote(batch)), trained, atol=0, rtol=0)
        assert shm["sync_bytes"] == stats["sync_bytes"]
        assert (
            ray.get(rollout.generate.remote(["1+2="], n=1, max_new_tokens=8))["weights_version"] == 2
        )  # the trainer's update count
        path, version, live = ray.get(policy.write_shared.remote())
        assert (
            version == 2 and not live and not os.path.exists(path)
        )  # removed after the first round; the mappings stay
        with pytest.raises(ray.exceptions.RayTaskError, match="hold version 2, expected 1: refusing stale weights"):
            ray.get(rollout.load_shared.remote((path, 1, False)))
        torch.testing.assert_close(ray.get(reference.logprobs.remote(batch)), before, atol=1e-5, rtol=0)  # frozen

        digits = tuple(str(d) for d in range(10))
        out = ray.get(rollout.generate.remote(["1+2="], n=4, max_new_tokens=6, stop=digits))
        stop_ids = set(tok.convert_tokens_to_ids(list(digits) + ["<|end|>", tok.eos_token]))
        for seq, m in zip(out["seqs"], out["masks"]):
            comp = seq[m.index(1) :]
            assert not stop_ids & set(comp[:-1])  # nothing generated after the first stop token
        with pytest.raises(ray.exceptions.RayTaskError, match="not a single token"):
            ray.get(rollout.generate.remote(["1+2="], max_new_tokens=8, stop=("no such token",)))

        scores = ray.get(reward.score.remote(["1+2=", "3+4="], ["3", "8"], {"answer": [3, 7]}))
        assert scores["exact_match_reward"] == [1.0, 0.0] and scores["total"] == pytest.approx([1.05, 0.05])

        values = ray.get(critic.values.remote(batch))
        assert values.shape == batch["response_mask"].shape
        returns = torch.ones_like(values)
        first = ray.get(
            critic.update.remote(PPOValue(clip=10.0), {"seq": batch, "old_values": values, "returns": returns})
        )["loss"]
        for _ in range(5):
            last = ray.get(
                critic.update.remote(PPOValue(clip=10.0), {"seq": batch, "old_values": values, "returns": returns})
            )["loss"]
        assert last < first  # the value head regresses toward the returns
    finally:
        place.shutdown()


def test_a_sync_queued_behind_a_busy_replica_is_not_overtaken_by_the_next_one(ray_align, tiny_model):
    """Async GRPO queues step t+1's update and weight sync before the replicas have loaded step t's
    (a load waits behind the generation in flight on its replica). The trainer's next write into the
    shared buffer must wait for those loads: written first, the replica would find a newer version
    than the one it was sent and refuse it (this failed a CI run on a loaded machine)."""
    place = Placement("sync-order", {"policy": RoleSpec(1), "rollout": RoleSpec(0.5)})
    try:
        [policy] = place.place("policy", Trainer, tiny_model, 1e-2)
        [rollout] = place.place("rollout", Rollout, tiny_model)
        batch = encode_sft(
            ChatFormat(AutoTokenizer.from_pretrained(tiny_model)),
            sft_examples(ar.sft_rows([ar.Problem("1+2=", 3), ar.Problem("3+4=", 7)])),
        )
        sync_weights(policy, [rollout])  # the first round (it maps the buffer)
        ray.get(policy.update.remote(SFT(), {"seq": batch}))
        busy = rollout.__ray_call__.remote(lambda self: time.sleep(2))  # the generation in flight
        first = start_sync(policy, [rollout])  # version 1, loaded once the replica is free
        ray.get(policy.update.remote(SFT(), {"seq": batch}))  # the next update, done while the replica is still busy
        second = start_sync(policy, [rollout])  # version 2
        assert ray.wait([busy], timeout=0)[1], "the replica was to be busy until now"
        ray.get(busy)
        assert wait_loads(first) == wait_loads(second)  # each load took the version it was sent
        trained = ray.get(policy.logprobs.remote(batch))
        torch.testing.assert_close(ray.get(rollout.logprobs.remote(batch)), trained, atol=0, rtol=0)
        assert ray.get(rollout.generate.remote(["1+2="], n=1, max_new_tokens=8))["weights_version"] == 2
    finally:
        place.shutdown()


def _clip_now(trainer, batch):
    """On the trainer actor: one backward of the SFT loss, raypai's clip, the gradients' norm after it."""
    from raypai.train.clipping import clip

    m = batch["response_mask"]
    lp = trainer._forward.logprobs(batch, m)
    trainer.engine.backward(-(lp * m).sum() / m.sum())
    clip(trainer.engine, trainer.engine.raypai_max_norm)
    after = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in trainer.engine.module.parameters()]))
    trainer.engine.zero_grad()
    return float(after)


def test_every_zero_stage_reports_the_gradient_norm_and_clips_to_the_limit(ray_align, tiny_model):
    """At ZeRO 0 in fp32 DeepSpeed clips without keeping the norm (its get_global_grad_norm() is None,
    and every run's grad_norm read 0): raypai clips there itself. The reported norm is the gradients'
    norm before clipping, the same at stages 0 and 1 and as plain PyTorch's; the gradients the
    optimizer then gets are scaled to the limit (1.0)."""
    from transformers import AutoModelForCausalLM

    from raypai.alignment._tensors import token_logprobs

    tok = AutoTokenizer.from_pretrained(tiny_model)
    batch = encode_sft(ChatFormat(tok), sft_examples(ar.sft_rows(ar.problems(max_operand=3)[:6])))
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    m = batch["response_mask"]
    (
        -(token_logprobs(model, batch["input_ids"], batch["attention_mask"], where=m, lean=False) * m).sum() / m.sum()
    ).backward()
    by_hand = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])))
    assert by_hand > 1.5  # above the limit, so clipping has work to do

    trainers = [ray.remote(Trainer).options(num_cpus=1).remote(tiny_model, 1e-2, stage) for stage in (0, 1)]
    critic = ray.remote(Trainer).options(num_cpus=1).remote(tiny_model, 1e-2, head="token_value")
    try:
        norms = [o["grad_norm"] for o in ray.get([t.update.remote(SFT(), {"seq": batch}) for t in trainers])]
        assert norms == pytest.approx([by_hand, by_hand], rel=1e-4)
        assert ray.get(trainers[0].__ray_call__.remote(_clip_now, batch)) == pytest.approx(1.0, rel=1e-4)
        values = ray.get(critic.values.remote(batch))
        assert (
            ray.get(
                critic.update.remote(PPOValue(clip=10.0), {"seq": batch, "old_values": values, "returns": values + 1.0})
            )["grad_norm"]
            > 0
        )
    finally:
        for a in (*trainers, critic):
            ray.kill(a)


def test_live_shared_parameters_sync_by_version_alone_and_stay_exact(ray_align, tiny_model):
    """Synchronous loops: the colocated replica's parameters are the trainer's own pages. A sync
    copies nothing (the replica's parameters sit in the trainer's buffer), the replica samples with
    exactly the trainer's weights and reports the update they come from, and a stale version is
    refused (the copying paths are the test above)."""
    specs = {"policy": RoleSpec(cpus=1), "rollout": RoleSpec(cpus=0.5)}
    place = Placement("live-sync-test", specs, colocate=(tuple(specs),))
    try:
        [policy] = place.place("policy", Trainer, tiny_model, 1e-2, live_weights=True)
        [rollout] = place.place("rollout", Rollout, tiny_model)
        tok = AutoTokenizer.from_pretrained(tiny_model)
        batch = encode_sft(ChatFormat(tok), sft_examples(ar.sft_rows([ar.Problem("1+2=", 3), ar.Problem("3+4=", 7)])))
        before = ray.get(rollout.logprobs.remote(batch))
        ray.get(policy.update.remote(SFT(), {"seq": batch}))
        trained = ray.get(policy.logprobs.remote(batch))
        assert not torch.allclose(before, trained)
        # the replica's own weights are untouched until it binds to the trainer's buffer at the first sync
        torch.testing.assert_close(ray.get(rollout.logprobs.remote(batch)), before, atol=0, rtol=0)
        stats = sync_weights(policy, [rollout])
        assert stats["sync_bytes"] > 100_000
        torch.testing.assert_close(ray.get(rollout.logprobs.remote(batch)), trained, atol=0, rtol=0)

        def mapped(self):  # every parameter's storage is a file mapping (the shared buffer), not private memory
            return {n: p.untyped_storage().filename for n, p in self.model.named_parameters()}

        files = ray.get(rollout.__ray_call__.remote(mapped))
        assert len(set(files.values())) == 1 and next(iter(files.values())).startswith(("/dev/shm/", "/tmp"))
        # a second update reaches the replica with no copy: its next sample is from update 2, exactly
        ray.get(policy.update.remote(SFT(), {"seq": batch}))
        trained2 = ray.get(policy.logprobs.remote(batch))
        assert ray.get(rollout.generate.remote(["1+2="], n=1, max_new_tokens=8))["weights_version"] == 2
        torch.testing.assert_close(ray.get(rollout.logprobs.remote(batch)), trained2, atol=0, rtol=0)
        path, version, live = ray.get(policy.write_shared.remote())
        assert (version, live) == (2, True)
        with pytest.raises(ray.exceptions.RayTaskError, match="hold version 2, expected 1: refusing stale weights"):
            ray.get(rollout.load_shared.remote((path, 1, True)))
        ray.get(rollout.load_shared.remote((path, 2, True)))
        # once bound, a sync sends nothing (no call to the trainer or the replica) and says what is shared
        loads = start_sync(policy, [rollout])
        assert loads == [stats["sync_bytes"]]
        ray.get(policy.update.remote(SFT(), {"seq": batch}))
        assert sync_weights(policy, [rollout])["sync_bytes"] == stats["sync_bytes"]
        assert ray.get(rollout.generate.remote(["1+2="], n=1, max_new_tokens=8))["weights_version"] == 3
        torch.testing.assert_close(
            ray.get(rollout.logprobs.remote(batch)), ray.get(policy.logprobs.remote(batch)), atol=0, rtol=0
        )
        # and a replica that samples while the trainer writes an update is refused
        ray.get(policy.__ray_call__.remote(lambda self: self._shared.stamp(-1)))
        with pytest.raises(ray.exceptions.RayTaskError, match="being written by the trainer"):
            ray.get(rollout.generate.remote(["1+2="], n=1, max_new_tokens=8))
    finally:
        place.shutdown()


def test_a_placement_that_cannot_fit_fails_at_once_naming_the_shortfall(ray_align):
    with pytest.raises(ConfigError, match=r"CPU: the roles of 'huge' need 100, the cluster has 8"):
        Placement("huge", {"policy": RoleSpec(cpus=100)})
    # GPU roles on a cluster without GPUs: the shortfall and both ways out, before anything is reserved
    with pytest.raises(ConfigError) as err:
        Placement(
            "gpu-run",
            {
                "policy": RoleSpec(cpus=1, gpus=0.5),
                "rollout": RoleSpec(cpus=0.5, gpus=0.5),
                "reward": RoleSpec(cpus=0.25),
            },
            colocate=(("policy", "rollout", "reward"),),
        )
    assert err.value.problems[0] == "GPU: the roles of 'gpu-run' need 1, the cluster has 0"
    assert "gpus=0" in str(err.value) and "more logical CPUs" not in str(err.value)
    assert not [pg for pg in ray.util.placement_group_table().values() if pg["name"] == "gpu-run-roles"]


@pytest.mark.parametrize("family", ["raypai", "qwen2", "gpt2"])
def test_gpu_replicas_take_the_trainers_weights_in_their_own_dtype_exactly(ray_align, tiny_model, family, tmp_path):
    """What a GPU run's sync does, on CPUs: the trainer (fp32) hands its weights to a bf16 replica
    through shared memory in bf16 (half the bytes of fp32), and the replica's weights are then exactly
    the trainer's rounded to bf16, after every update; the trainer's host copy (`state_dict`, what
    replicas on other nodes load) is in bf16 too. Sleep and wake are no-ops on the CPU. On raypai's
    Llama, a Qwen2 with ChatML and a GPT-2 (tied embedding, no chat template)."""
    from raypai.alignment.tasks.tiny import build_tiny_model

    model = tiny_model if family == "raypai" else build_tiny_model(tmp_path / family, family=family)
    specs = {"policy": RoleSpec(cpus=1), "rollout": RoleSpec(cpus=0.5)}
    place = Placement(f"bf16-sync-{family}", specs, colocate=(tuple(specs),))
    try:
        [policy] = place.place("policy", Trainer, model, 1e-2, live_weights=True, sync_dtype="bfloat16")
        [rollout] = place.place("rollout", Rollout, model, dtype="bfloat16")
        fmt = ChatFormat.from_pretrained(model)
        rows = ar.sft_rows([ar.Problem("1+2=", 3), ar.Problem("3+4=", 7)], family != "gpt2")
        batch = encode_sft(fmt, sft_examples(rows))
        fp32 = lambda self: {k: v.clone() for k, v in self.engine.module.state_dict().items()}  # noqa: E731
        replica = lambda self: {k: v.clone() for k, v in self.model.state_dict().items()}  # noqa: E731
        n_bytes = sum(v.numel() * 2 for v in ray.get(policy.__ray_call__.remote(fp32)).values())
        for _ in range(2):
            ray.get(policy.update.remote(SFT(), {"seq": batch}))
            stats = sync_weights(policy, [rollout])
            assert stats["sync_bytes"] >= n_bytes  # bf16 (tensors aligned to 64 bytes each)
            assert stats["sync_bytes"] < n_bytes * 1.1
            trainer, got = ray.get(policy.__ray_call__.remote(fp32)), ray.get(rollout.__ray_call__.remote(replica))
            assert all(
                got[k].dtype == torch.bfloat16 and torch.equal(got[k], v.to(torch.bfloat16)) for k, v in trainer.items()
            )
            assert not all(torch.equal(got[k].float(), v) for k, v in trainer.items())  # rounded, not fp32
        host = ray.get(policy.state_dict.remote())
        assert all(
            host[k].dtype == torch.bfloat16 and torch.equal(host[k], v.to(torch.bfloat16)) for k, v in trainer.items()
        )
        # the loops' sleep/wake around sampling (`_loop.asleep`), here with CPU roles: nothing moves, and the
        # trainer is awake for its next update (the moving itself: tests/alignment/test_offload.py on CUDA)
        with asleep([policy], on_gpu=True) as offload:
            assert offload == {"offload_bytes": 0, "offload_seconds": 0.0}
            ray.get(rollout.generate.remote(["1+2="], n=2, max_new_tokens=8))
        assert ray.get(policy.update.remote(SFT(), {"seq": batch}))["grad_norm"] > 0
        assert ray.get(policy.wake.remote()) == 0.0
    finally:
        place.shutdown()


def test_colocated_roles_share_one_bundle(ray_align, tiny_model):
    """reward (0.25 CPU) and a second reward-style judge (0.5 CPU) colocated → one 0.75-CPU bundle;
    the policy keeps its own. Both colocated actors run and are named per role."""
    place = Placement(
        "coloc-test",
        {"policy": RoleSpec(1), "reward": RoleSpec(0.25), "judge": RoleSpec(0.5)},
        colocate=(("reward", "judge"),),
    )
    try:
        assert sorted(b["CPU"] for b in place.pg.bundle_specs) == [0.75, 1.0]
        [reward] = place.place("reward", Reward, [(ar.exact_match_reward, 1.0)])
        [judge] = place.place("judge", Reward, [(length_bonus, 1.0)])
        assert ray.get(judge.score.remote(["1+1="], ["22"], {}))["total"] == [1.0]
        assert ray.get(reward.score.remote(["1+1="], ["2"], {"answer": [2]}))["total"] == [1.0]
        assert ray.get_actor("coloc-test/judge-0") is not None
        # plain Python rewards: the reward's process never loads torch (seconds of start-up per run);
        # the trainer's does (the same check, able to say yes)
        # (a lambda, which Ray ships by value: a module-level function goes by reference, and importing
        # this module would load torch)
        [policy] = place.place("policy", Trainer, tiny_model, 1e-3)
        loads_torch = lambda actor: "torch" in sys.modules  # noqa: E731
        assert ray.get([a.__ray_call__.remote(loads_torch) for a in (reward, policy)]) == [False, True]
    finally:
        place.shutdown()


def test_synchronous_grpo_colocates_its_roles_and_the_working_role_uses_the_bundle(ray_align, tiny_model):
    """What run_grpo places for a synchronous run: every role in one bundle (their CPUs summed), the
    trainer and the rollout each with all of that bundle's threads (they take turns)."""
    specs = {
        "policy": RoleSpec(cpus=1),
        "rollout": RoleSpec(cpus=0.5),
        "reference": RoleSpec(cpus=0.5),
        "reward": RoleSpec(cpus=0.25),
    }
    place = Placement("sync-grpo-test", specs, colocate=(tuple(specs),))
    try:
        assert place.pg.bundle_specs == [{"CPU": 2.25}]
        [policy] = place.place("policy", Trainer, tiny_model, 1e-3, threads=2)
        [rollout] = place.place("rollout", Rollout, tiny_model, threads=2)
        threads = lambda self: torch.get_num_threads()  # noqa: E731
        assert ray.get([policy.__ray_call__.remote(threads), rollout.__ray_call__.remote(threads)]) == [2, 2]
    finally:
        place.shutdown()


def test_ppo_step_moves_the_policy_toward_positive_advantages(ray_align, tiny_model):
    """One clipped-surrogate update with advantage +1 on every token of one completion and −1 on the
    other raises the first's log-probability and lowers the second's; a sign error in the policy
    gradient (surrogate or step) moves both the wrong way."""
    place = Placement("ppo-sign", {"policy": RoleSpec(1)})
    try:
        [policy] = place.place("policy", Trainer, tiny_model, 5e-3)
        tok = AutoTokenizer.from_pretrained(tiny_model)
        batch = encode_sft(ChatFormat(tok), sft_examples(ar.sft_rows([ar.Problem("1+2=", 3), ar.Problem("1+2=", 4)])))
        m = batch["response_mask"]
        old = ray.get(policy.logprobs.remote(batch))
        adv = torch.stack([m[0], -m[1]])  # (B, T−1): good completion +1, bad −1, prompt tokens 0
        ray.get(policy.update.remote(PPOPolicy(clip_eps=0.2), {"seq": batch, "old_lp": old, "advantages": adv}))
        new = ray.get(policy.logprobs.remote(batch))
        gain = ((new - old) * m).sum(1)
        assert gain[0] > 0 > gain[1], gain
    finally:
        place.shutdown()


def test_colocated_roles_share_one_bundle_and_two_replicas_split_one_group(ray_align, tiny_model):
    """Synchronous GRPO's placement: every role in one bundle, still one named process each; with
    one prompt and two rollout replicas, the group's samples are split across the replicas (each
    with its own seed, so no sample is drawn twice) and `collect` returns the group in one piece;
    the shared-memory sync reaches both replicas exactly."""
    from raypai.alignment._loop import collect, launch
    from raypai.alignment.data import PromptExample

    specs = {"policy": RoleSpec(1), "rollout": RoleSpec(0.5, replicas=2), "reference": RoleSpec(0.5)}
    place = Placement("coloc-test", specs, colocate=(tuple(specs),))
    try:
        assert len(ray.util.placement_group_table(place.pg)["bundles"]) == 1
        [policy] = place.place("policy", Trainer, tiny_model, 1e-2)
        rollouts = place.place("rollout", Rollout, tiny_model, per_replica=lambda i: {"seed": i})
        [reference] = place.place("reference", Reference, tiny_model)
        ray.get([a.__ray_ready__.remote() for a in (policy, *rollouts, reference)])
        names = {
            a.name: a.pid
            for a in list_actors(address=ray_align, filters=[("state", "=", "ALIVE")])
            if a.name.startswith("coloc-test/")
        }
        assert (
            set(names)
            == {"coloc-test/policy-0", "coloc-test/rollout-0", "coloc-test/rollout-1", "coloc-test/reference-0"}
            and len(set(names.values())) == 4
        )

        problems = [PromptExample("1+2=", {"answer": 3}), PromptExample("3+4=", {"answer": 7})]
        one = collect(
            launch(rollouts, problems[:1], 8, max_new_tokens=6, temperature=1.0, top_p=1.0, logprobs=True), pad_id=0
        )
        assert one.prompts == ["1+2="] * 8 and one.rows == {"answer": [3] * 8} and len(one.completions) == 8
        halves = [tuple(map(tuple, one.batch["input_ids"][i : i + 4].tolist())) for i in (0, 4)]
        assert halves[0] != halves[1]  # the two replicas drew different samples
        # every row's behaviour log-probs are its own: recomputed on the replica's weights they match
        lp = ray.get(rollouts[0].logprobs.remote(one.batch))
        torch.testing.assert_close(
            one.behaviour_lp * one.batch["response_mask"], lp * one.batch["response_mask"], atol=1e-4, rtol=0
        )
        two = collect(launch(rollouts, problems, 3, max_new_tokens=4, temperature=1.0, top_p=1.0), pad_id=0)
        assert two.prompts == ["1+2="] * 3 + ["3+4="] * 3 and two.rows == {"answer": [3] * 3 + [7] * 3}

        tok = AutoTokenizer.from_pretrained(tiny_model)
        batch = encode_sft(ChatFormat(tok), sft_examples(ar.sft_rows([ar.Problem("1+2=", 3)])))
        ray.get(policy.update.remote(SFT(), {"seq": batch}))
        trained = ray.get(policy.logprobs.remote(batch))
        sync_weights(policy, rollouts)
        for r in rollouts:
            torch.testing.assert_close(ray.get(r.logprobs.remote(batch)), trained, atol=0, rtol=0)
    finally:
        place.shutdown()


def test_a_trainer_engine_ignores_a_master_port_it_inherits(tmp_path):
    """A role's DeepSpeed engine is one process of its own: a MASTER_PORT (or RANK, WORLD_SIZE) left in
    the environment by something else on the node (an in-process vLLM, another job) must not be
    used; here the inherited port is taken, as it was when a vLLM rollout in the driver held it."""
    import socket
    import subprocess
    import sys

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        code = (
            "import torch; from transformers import LlamaConfig, LlamaForCausalLM\n"
            "from raypai.alignment.roles._engine import engine_config, make_engine\n"
            "from raypai.alignment.roles._ranks import join\n"
            "m = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, "
            "num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))\n"
            "join(None, 0, use_gpu=False); e = make_engine(m, lr=1e-3, conf=engine_config())\n"
            "store = torch.distributed.distributed_c10d._get_default_store()\n"
            "print('world', torch.distributed.get_world_size(), type(store.underlying_store).__name__)\n"
        )
        env = {
            **os.environ,
            "MASTER_PORT": str(taken.getsockname()[1]),
            "WORLD_SIZE": "4",
            "RANK": "2",
            "DS_ACCELERATOR": "cpu",
        }
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    # a group of one with no TCP rendezvous: a port picked free and bound a moment later was once taken
    # in between by another process's connection (EADDRINUSE in a fresh-clone `make test`)
    assert "world 1 HashStore" in done.stdout, done.stdout
