"""Critic: the PPO value function V(s_t) — a transformer with a scalar head per position, trained
by its own DeepSpeed engine. Initialised from the reward model when one is given (its `score`
head carries over), else from the policy's starting weights with a fresh head."""

from __future__ import annotations

import torch

from raypai.alignment._tensors import to_device
from raypai.alignment.losses import clipped_value_loss, ppo_targets
from raypai.alignment.roles._device import autocast, role_device
from raypai.alignment.roles._engine import Sleeps, make_engine, set_mode, without_dropout
from raypai.alignment.roles._engine import step as engine_step


class Critic(Sleeps):
    def __init__(
        self, model_dir: str, lr: float, zero_stage: int = 0, seed: int = 0, threads: int = 1, device: str = "cpu"
    ):
        """`device`: "cpu" or "cuda" (fp32 weights, bf16 autocast, as the policy trainer)."""
        from transformers import AutoModelForTokenClassification, AutoTokenizer

        torch.set_num_threads(threads)
        torch.manual_seed(seed)
        self.device = role_device(device, "critic")
        model = AutoModelForTokenClassification.from_pretrained(model_dir, num_labels=1).to(self.device)
        without_dropout(model)  # values in training mode are the rollout-time ones for the same weights
        model.config.pad_token_id = AutoTokenizer.from_pretrained(model_dir).pad_token_id
        self.engine = make_engine(model, lr=lr, zero_stage=zero_stage, use_gpu=self.device.type == "cuda")

    def _values(self, batch: dict) -> torch.Tensor:
        # the value of the state *before* token t+1, aligned with the label positions: (B, T−1)
        with autocast(self.device):
            out = self.engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        return out.logits[:, :-1, 0].float()

    def values(self, batch: dict) -> torch.Tensor:
        set_mode(self.engine, False)
        with torch.no_grad():
            return self._values(to_device(batch, self.device)).cpu()

    def train_step(self, batch: dict, old_values: torch.Tensor, returns: torch.Tensor, clip: float) -> dict:
        set_mode(self.engine, True)
        batch = to_device(batch, self.device)
        old_values, returns = old_values.to(self.device), returns.to(self.device)
        loss = clipped_value_loss(self._values(batch), old_values, returns, batch["response_mask"], clip)
        self.engine.backward(loss)
        return {"value_loss": loss.item(), "value_grad_norm": engine_step(self.engine)}

    def values_on(self, sampled: dict, *outs: dict) -> torch.Tensor:
        """`values` of a generation as Ray hands it over (`_loop.handed_over`)."""
        from raypai.alignment._loop import handed_over

        return self.values(handed_over(sampled, outs))

    def train_step_on(
        self,
        scores: dict,
        old_lp: torch.Tensor,
        ref_lp: torch.Tensor,
        values: torch.Tensor,
        sampled: dict,
        *outs: dict,
        targets: dict,
        clip: float,
    ) -> dict:
        """`train_step` on a generation as Ray hands it over, its returns computed here from the same
        inputs as the policy's advantages (`losses.ppo_targets`; `targets`: kl_coef, gamma, lam)."""
        from raypai.alignment._loop import handed_over, to_tensor

        batch = handed_over(sampled, outs)
        _, returns = ppo_targets(to_tensor(scores["total"]), old_lp, ref_lp, values, batch["response_mask"], **targets)
        return self.train_step(batch, values, returns, clip)

    def save_checkpoint(self, folder: str, tag: str) -> None:
        """Save under a new `tag`; the policy's `latest` (written after it) says which tag a resume loads."""
        from raypai.alignment.checkpoint import commit

        self.engine.save_checkpoint(folder, tag=tag, save_latest=False)
        commit(folder, tag, keep=3, point_latest=False)  # one more than the policy: it may be a save ahead

    def load_checkpoint(self, folder: str, tag: str) -> None:
        self.engine.load_checkpoint(folder, tag=tag)
