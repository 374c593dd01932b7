"""PolicyTrainer: the trainable policy (a DeepSpeed engine) as a Ray actor. Losses come from
`raypai.alignment.losses`; this class only moves tensors in and out."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from raypai.alignment._tensors import (
    cpu_threads,
    select_rows,
    sequence_logprob,
    stack_right_padded,
    to_device,
    token_logprobs,
)
from raypai.alignment.losses import (
    ChosenRejected,
    clipped_surrogate,
    dpo_loss,
    grpo_advantages,
    grpo_loss,
    masked_mean,
    ppo_targets,
)
from raypai.alignment.roles._device import DTYPES, autocast, maybe, role_device
from raypai.alignment.roles._engine import Sleeps, make_engine, set_mode, without_dropout
from raypai.alignment.roles._engine import step as engine_step

# CPU updates use one more thread per this many FLOPs of a step (6 × parameters × tokens): under it
# a step is a thousand small operations whose fork/join costs more than the split saves, and the
# second core is better left to the driver and Ray's own processes, which work during every step.
# Measured on issue #14's benchmark (0.79 M parameters, 2 cores): DPO's 16 rows (≈ 1 GFLOP) ran at
# 206 pairs/s on 1 thread vs 139 on 2 (medians of 3 runs; after the packed updates, 404-452 vs
# 229-483: in-process 2 threads win, but in the actor a region waits for its slower thread, and
# the second core also serves Ray); an 8 × 8 GRPO update (≈ 5 GFLOP) took
# 90 ms on 2 threads vs 110 ms on 1.
TRAIN_FLOPS_PER_THREAD = 2.5e9


class PolicyTrainer(Sleeps):
    def __init__(
        self,
        model_dir: str,
        lr: float,
        zero_stage: int = 0,
        seed: int = 0,
        threads: int = 1,
        live_weights: bool = False,
        device: str = "cpu",
        sync_dtype: str | None = None,
        dropout: bool = False,
    ):
        """`live_weights`: keep the parameters in a shared-memory buffer that same-node rollout
        replicas bind to (raypai.alignment.sync, "live shared parameters"); only for loops in which
        no replica samples while this trainer updates (the synchronous ones), only at ZeRO
        stage 0 (higher stages keep their own flat copies of the parameters) and only on the CPU.
        `device`: "cpu" or "cuda" (fp32 weights, bf16 autocast; `roles._device`). `sync_dtype`: the
        rollout replicas' weight dtype (e.g. "bfloat16" for GPU replicas), in which the weights are
        handed over in shared memory; None: this trainer's own (fp32). `dropout`: keep the model's own
        dropout in training (SFT); RL updates train without it (`roles._engine.without_dropout`)."""
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        torch.manual_seed(seed)
        self.threads = threads
        self.model_dir = model_dir
        self.device = role_device(device, "policy")
        self.sync_dtype = DTYPES[sync_dtype] if sync_dtype else None  # the replicas' dtype; None: this trainer's
        self.updates = 0  # the weights' version: optimizer steps taken (rollouts record the version they sample with)
        model = AutoModelForCausalLM.from_pretrained(model_dir).to(self.device)
        if not dropout:
            without_dropout(model)
        self._shared = None  # raypai.alignment.sync.SharedWeights: made now when live, else at the first same-node sync
        self._live = live_weights and zero_stage == 0 and self.device.type == "cpu" and sync_dtype is None
        if self._live:
            from raypai.alignment.sync import SharedWeights

            params = dict(model.named_parameters())  # tied weights once
            self._shared = SharedWeights(self._shared_path(), params, create=True)
            self._shared.bind(params, copy=True)
            self._shared.stamp(0)
        self.engine = make_engine(model, lr=lr, zero_stage=zero_stage, use_gpu=self.device.type == "cuda")
        self.n_params = sum(p.numel() for p in model.parameters())

    @staticmethod
    def _shared_path():
        import sys
        import uuid

        from raypai.alignment.sync import shared_path

        ray = sys.modules.get("ray")  # in an actor Ray is loaded; a role built in-process may have none
        actor = ray.get_runtime_context().get_actor_id() if ray is not None and ray.is_initialized() else None
        return shared_path(actor[:24] if actor else uuid.uuid4().hex[:24])

    def _threads_for(self, *batches: dict, passes: int = 6) -> None:
        """Threads for a step over `batches` (6 FLOPs per parameter and token: forward and
        backward; 2 for a forward alone), at most the actor's own (TRAIN_FLOPS_PER_THREAD)."""
        if self.device.type != "cpu":
            return
        tokens = sum(int(b["attention_mask"].sum()) for b in batches)
        torch.set_num_threads(cpu_threads(passes * self.n_params * tokens, TRAIN_FLOPS_PER_THREAD, self.threads))

    def _lp(self, batch, where: torch.Tensor | None = None):
        # the engine's module directly (ZeRO ≤ 2 keeps whole parameters; the engine's forward adds
        # nothing here), so Llama-family models take the lean forward; `where`: only those label
        # positions are computed, the others are 0
        with autocast(self.device):
            return token_logprobs(self.engine.module, batch["input_ids"], batch["attention_mask"], where=where)

    @staticmethod
    def _on(m: torch.Tensor, x: torch.Tensor | None) -> torch.Tensor | None:
        """x where the mask m is set, 0 elsewhere (where the policy's own log-probs are 0 as well,
        so the ratio there is exp(0) and not exp(−old): padding labels can be very unlikely)."""
        return None if x is None else torch.where(m > 0, x, torch.zeros_like(x))

    def _update(self, loss) -> float:
        self.engine.backward(loss)
        if self._live:
            self._shared.stamp(-1)  # being written
        gn = engine_step(self.engine)
        self.updates += 1
        if self._live:
            self._shared.stamp(self.updates)
        return gn

    def sft_step(self, batch: dict, ptx: torch.Tensor | None = None, ptx_coef: float = 0.0) -> dict:
        """Mean negative log-likelihood of the response tokens only; with `ptx` (B', T) pretraining
        blocks, plus ptx_coef × their language-modelling loss (InstructGPT's "PPO-ptx" mix, Ouyang
        et al. 2022 eq. 2, used here to keep SFT from erasing what pretraining learned)."""
        set_mode(self.engine, True)
        batch, ptx = to_device(batch, self.device), maybe(ptx, self.device)
        self._threads_for(batch, *([{"attention_mask": ptx}] if ptx is not None and ptx_coef > 0 else []))
        m = batch["response_mask"]
        lp = self._lp(batch, m)
        loss = -(lp * m).sum() / m.sum()
        out = {"loss": loss.item()}
        if ptx is not None and ptx_coef > 0:
            with autocast(self.device):
                lm = -token_logprobs(self.engine.module, ptx, torch.ones_like(ptx)).mean()
            loss = loss + ptx_coef * lm
            out["ptx_loss"] = lm.item()
        out["grad_norm"] = self._update(loss)
        return out

    def dpo_step(
        self,
        chosen: dict,
        rejected: dict,
        ref_chosen: torch.Tensor,
        ref_rejected: torch.Tensor,
        beta: float,
        loss_type: str,
        label_smoothing: float,
    ) -> dict:
        set_mode(self.engine, True)
        chosen, rejected = to_device(chosen, self.device), to_device(rejected, self.device)
        ref_chosen, ref_rejected = maybe(ref_chosen, self.device), maybe(ref_rejected, self.device)
        self._threads_for(chosen, rejected)
        # one forward over chosen and rejected rows together (right padding leaves each row's
        # log-probs as they are alone): half the forward/backward calls of two separate passes
        both = stack_right_padded(chosen, rejected)
        seq = sequence_logprob(self._lp(both, both["response_mask"]), both["response_mask"])
        n = chosen["input_ids"].shape[0]
        pol = ChosenRejected(seq[:n], seq[n:])
        lengths = ChosenRejected(chosen["response_mask"].sum(1), rejected["response_mask"].sum(1))
        out = dpo_loss(
            pol,
            ChosenRejected(ref_chosen, ref_rejected),
            beta=beta,
            loss_type=loss_type,
            label_smoothing=label_smoothing,
            lengths=lengths,
        )
        return {
            "loss": out.loss.item(),
            "accuracy": out.accuracy,
            "margin": out.margin,
            "grad_norm": self._update(out.loss),
        }

    def online_dpo_step_on(
        self,
        scores: dict,
        ref: tuple | None,
        sampled: dict,
        *outs: dict,
        beta: float,
        loss_type: str,
        label_smoothing: float,
    ) -> dict:
        """`dpo_step` on online DPO's pairs of a generation as Ray hands it over (`_loop.ranked_pairs`
        of the rollout's `outs` and the Reward actor's `scores`; `ref`, the Reference's log-probs of
        the same pairs, `Reference.pair_logprobs_on`); no update when every group ties. Adds `pairs`."""
        from raypai.alignment._loop import ranked_pairs

        pairs = ranked_pairs(scores, sampled, *outs)
        if pairs is None:
            return {"pairs": 0}
        return {**self.dpo_step(*pairs, *ref, beta, loss_type, label_smoothing), "pairs": len(ref[0])}

    def hold_pairs(self, chosen: dict, rejected: dict, ref_chosen: torch.Tensor, ref_rejected: torch.Tensor) -> int:
        """Keep an offline DPO dataset here (host memory): the pairs' right-padded batches and their
        reference log-probs. Steps then name their rows (`dpo_step_held`) rather than ship them."""
        self._pairs = (chosen, rejected, ref_chosen, ref_rejected)
        return len(ref_chosen)

    def dpo_step_held(self, idx: list[int], beta: float, loss_type: str, label_smoothing: float) -> dict:
        """`dpo_step` on rows `idx` of the pairs given to `hold_pairs`."""
        chosen, rejected, ref_chosen, ref_rejected = self._pairs
        idx = torch.as_tensor(idx)
        return self.dpo_step(
            select_rows(chosen, idx),
            select_rows(rejected, idx),
            ref_chosen[idx],
            ref_rejected[idx],
            beta,
            loss_type,
            label_smoothing,
        )

    def dpo_steps_held(self, idx: list[list[int]], beta: float, loss_type: str, label_smoothing: float) -> list[dict]:
        """`dpo_step_held` once per list of rows in `idx`, in order, in one call (a call's own cost
        in Ray, ≈ 2 ms, is then paid once for several small steps); each step's metrics."""
        return [self.dpo_step_held(i, beta, loss_type, label_smoothing) for i in idx]

    def grpo_step(
        self,
        batch: dict,
        old_lp: torch.Tensor | None,
        ref_lp: torch.Tensor | None,
        advantages: torch.Tensor,
        clip_eps: float,
        clip_eps_high: float | None,
        beta: float,
        aggregation: str,
        max_len: int | None = None,
    ) -> dict:
        """One update; `update_seconds`: its own time in this actor (the driver may wait less, or more)."""
        t0 = time.perf_counter()
        set_mode(self.engine, True)
        batch, advantages = to_device(batch, self.device), advantages.to(self.device)
        old_lp, ref_lp = maybe(old_lp, self.device), maybe(ref_lp, self.device)
        self._threads_for(batch)
        version = self.updates
        m = batch["response_mask"]
        lp = self._lp(batch, m)
        # μ = 1: ratio 1, the gradient is the policy gradient
        old_lp, ref_lp = lp.detach() if old_lp is None else self._on(m, old_lp), self._on(m, ref_lp)
        loss, stats = grpo_loss(
            lp,
            old_lp,
            ref_lp,
            advantages,
            batch["response_mask"],
            clip_eps=clip_eps,
            clip_eps_high=clip_eps_high,
            beta=beta,
            aggregation=aggregation,
            max_len=max_len,
        )
        # −mean log π of the sampled tokens: a Monte-Carlo estimate of the per-token entropy
        entropy = -masked_mean(lp.detach(), batch["response_mask"]).item()
        out = {
            "loss": loss.item(),
            "grad_norm": self._update(loss),
            "entropy": entropy,
            "policy_version": version,
            **{k: v.item() for k, v in stats.items()},
        }
        return {**out, "update_seconds": time.perf_counter() - t0}

    def grpo_step_on(
        self,
        scores: dict,
        sampled: dict,
        *outs: dict,
        old_lp: torch.Tensor | None = None,
        ref_lp: torch.Tensor | None = None,
    ) -> dict:
        """`grpo_step` on a generation as Ray hands it over, with no round trip through the driver:
        `outs`, the rollout replicas' outputs (`Rollout.generate`), padded here into the batch in the
        samples' order; the advantages from the Reward actor's `scores` of them. `sampled`:
        {"rows": `_loop.Pending.rows`, "pad_id", "group_size", "step": grpo_step's other arguments}."""
        from raypai.alignment._loop import handed_over, to_tensor

        batch = handed_over(sampled, outs)
        advantages = grpo_advantages(to_tensor(scores["total"]), sampled["group_size"])
        return self.grpo_step(batch, old_lp, ref_lp, advantages, **sampled["step"])

    def ppo_step(self, batch: dict, old_lp: torch.Tensor, advantages: torch.Tensor, clip_eps: float) -> dict:
        """Clipped surrogate with per-token advantages (B, T), token-mean over the completions."""
        set_mode(self.engine, True)
        batch, old_lp, advantages = to_device(batch, self.device), old_lp.to(self.device), advantages.to(self.device)
        self._threads_for(batch)
        m = batch["response_mask"]
        lp = self._lp(batch, m)
        per_token, clipped = clipped_surrogate(lp, self._on(m, old_lp), advantages, clip_eps=clip_eps)
        loss = masked_mean(per_token, m)
        return {
            "policy_loss": loss.item(),
            "clip_fraction": masked_mean(clipped.float(), m).item(),
            "entropy": -masked_mean(lp.detach(), m).item(),
            "grad_norm": self._update(loss),
        }

    def ppo_step_on(
        self,
        scores: dict,
        old_lp: torch.Tensor,
        ref_lp: torch.Tensor,
        values: torch.Tensor,
        sampled: dict,
        *outs: dict,
        targets: dict,
        clip_eps: float,
    ) -> dict:
        """`ppo_step` on a generation as Ray hands it over (`_loop.handed_over`), its advantages
        computed here (`losses.ppo_targets` of the Reward actor's `scores`, the rollout's and the
        reference's log-probs and the critic's values; `targets`: kl_coef, gamma, lam)."""
        from raypai.alignment._loop import handed_over, to_tensor

        batch = handed_over(sampled, outs)
        adv, _ = ppo_targets(to_tensor(scores["total"]), old_lp, ref_lp, values, batch["response_mask"], **targets)
        return self.ppo_step(batch, old_lp, adv, clip_eps)

    def logprobs(self, batch: dict) -> torch.Tensor:
        """(B, T−1) log-probs of the response tokens (`response_mask`), 0 elsewhere."""
        set_mode(self.engine, False)
        batch = to_device(batch, self.device)
        self._threads_for(batch, passes=2)
        with torch.no_grad():
            return self._lp(batch, batch["response_mask"]).cpu()

    def version(self) -> int:
        return self.updates

    def state_dict(self) -> dict:
        """The weights on the host (in `sync_dtype` when set): what replicas on other nodes load."""
        return {k: v.detach().to("cpu", self.sync_dtype).clone() for k, v in self.engine.module.state_dict().items()}

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def write_shared(self, *after) -> tuple[str, int, bool]:
        """Make the current weights readable by same-node replicas; returns (the buffer's path, the
        weights' version, live). Live, the parameters already are the buffer: only the version is
        stamped (it covers in-place changes made outside an update, e.g. a checkpoint load).
        Otherwise they are copied into this trainer's buffer. `after`: the replicas' loads of the
        last round, as ObjectRefs, which Ray resolves before this runs (their values are unused)."""
        from raypai.alignment.sync import SharedWeights

        if self._live:
            self._shared.stamp(self.updates)
            return self._shared.path, self.updates, True
        state = self.engine.module.state_dict()
        if self._shared is None:
            # the layout in the replicas' dtype: the copy into the buffer casts (fp32 → bf16 for GPU replicas)
            like = {k: torch.empty(v.shape, dtype=self.sync_dtype or v.dtype, device="meta") for k, v in state.items()}
            self._shared = SharedWeights(self._shared_path(), like, create=True)
        self._shared.write(state, self.updates)
        return self._shared.path, self.updates, False

    def unlink_shared(self) -> None:
        """Remove the buffer's file (every replica has mapped it; the mappings stay valid)."""
        import os

        if self._shared is not None and os.path.exists(self._shared.path):
            os.unlink(self._shared.path)

    def export(self, out_dir: str, extra: dict | None = None) -> str:
        """The current policy as an HF folder: weights, the source folder's tokenizer files, and a
        generation config whose EOS list holds every stop token (plain `generate` stops where raypai does)."""
        from raypai.chat import ChatFormat, copy_tokenizer_files, write_generation_stops

        out = Path(out_dir)
        self.engine.module.save_pretrained(out, safe_serialization=True)
        copy_tokenizer_files(self.model_dir, out)
        write_generation_stops(out, ChatFormat.from_pretrained(self.model_dir).stop_ids)
        if extra is not None:
            (out / "raypai.json").write_text(json.dumps(extra, indent=1, default=str))
        return str(out)

    def save_checkpoint(self, folder: str, client_state: dict, tag: str) -> None:
        """Save under a new `tag`, then point `latest` at it (raypai.alignment.checkpoint.commit)."""
        from raypai.alignment.checkpoint import commit

        self.engine.save_checkpoint(folder, tag=tag, client_state=client_state, save_latest=False)
        commit(folder, tag)

    def load_checkpoint(self, folder: str, tag: str | None = None) -> dict:
        _, client_state = self.engine.load_checkpoint(folder, tag=tag)  # None: the "latest" pointer
        return client_state or {}
