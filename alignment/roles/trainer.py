"""Trainer: a trained model (a DeepSpeed engine) as a Ray actor — the policy of every algorithm,
PPO's critic and the reward model alike. It knows placement, devices and the optimizer step, and
no algorithm: each update is handed an objective from `raypai.alignment.losses.objectives`.

    policy = Trainer(model_dir, lr=1e-5)                       # head="causal_lm"
    policy.update(SFT(), batch)                                 # a batch the caller made
    policy.update_on(GRPO(group_size=8), scores, sampled, *outs)  # inputs as Ray hands them over
    policy.hold("pairs", (chosen, rejected, ref_c, ref_r)); policy.updates(DPO(), [[0, 3], [1, 2]])

Heads: "causal_lm" (the policy: AutoModelForCausalLM), "token_value" (PPO's critic: a scalar per
position, AutoModelForTokenClassification) and "score" (the reward model: a scalar per sequence,
AutoModelForSequenceClassification).

With `lora` (a `raypai.alignment.lora.LoRASpec`) the model trains LoRA adapters (and a scalar head)
only; its base with the adapters off is the run's reference (`base_logprobs*`, no second copy of the
weights), a sync hands over the adapters only, and the export writes the merged model plus the
adapter in PEFT's format."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from raypai.alignment._tensors import cpu_threads, token_logprobs
from raypai.alignment.roles import _ranks
from raypai.alignment.roles._device import DTYPES, autocast, role_device, trainer_dtype
from raypai.alignment.roles._engine import Sleeps, engine_config, make_engine, set_mode, without_dropout
from raypai.alignment.roles._engine import step as engine_step
from raypai.alignment.roles._handover import SYNC_BUCKET_BYTES, HandsOver
from raypai.checkpoint_io import read_state, write_state

# CPU updates use one more thread per this many FLOPs of a step (6 × parameters × tokens): under it a
# step is many small operations whose fork/join costs more than the split saves, and the second core
# is better left to the driver and Ray's own processes (benchmarks/history/asides.md).
TRAIN_FLOPS_PER_THREAD = 2.5e9

HEADS = ("causal_lm", "token_value", "score")


def _load(model_dir: str, head: str, ds_conf: dict | None = None):
    """The model of `head` from `model_dir`. With a ZeRO-3 DeepSpeed config (`ds_conf`) it is built
    and loaded under `deepspeed.zero.Init` (transformers' DeepSpeed integration): each rank
    materialises its own partition of every weight only, never the whole model."""
    import transformers as tf

    if ds_conf is not None and ds_conf["zero_optimization"]["stage"] == 3:
        from transformers.integrations import HfDeepSpeedConfig

        keep = HfDeepSpeedConfig(ds_conf)  # while it lives, from_pretrained loads under zero.Init
        try:
            return _load(model_dir, head)
        finally:
            del keep
    if head == "causal_lm":
        return tf.AutoModelForCausalLM.from_pretrained(model_dir)
    cls = tf.AutoModelForTokenClassification if head == "token_value" else tf.AutoModelForSequenceClassification
    model = cls.from_pretrained(model_dir, num_labels=1)
    model.config.pad_token_id = tf.AutoTokenizer.from_pretrained(model_dir).pad_token_id
    return model


def _to(x, device):
    """A (possibly nested) batch's tensors on `device` (non-blocking from the host)."""
    if isinstance(x, torch.Tensor):
        return x.to(device, non_blocking=True)
    if isinstance(x, dict):
        return {k: _to(v, device) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_to(v, device) for v in x)
    return x


def _tokens(x) -> int:
    """Tokens of every sequence batch (a dict with an attention_mask) in a nested batch."""
    if isinstance(x, dict):
        if isinstance(x.get("attention_mask"), torch.Tensor):
            return int(x["attention_mask"].sum())
        return sum(_tokens(v) for v in x.values())
    return 0


class _Forward:
    """The role's forward passes, handed to an objective (`losses.objectives.Model`). They run the
    transformers model itself (with LoRA: the base model with its adapter layers, so Llama-family
    models take the lean forward, which applies the adapters), not DeepSpeed's engine: ZeRO ≤ 2 keeps
    whole parameters and the engine's forward adds nothing here."""

    def __init__(self, role: Trainer):
        self.role = role

    def logprobs(self, batch: dict, where: torch.Tensor | None = None) -> torch.Tensor:
        with autocast(self.role.device, self.role.compute_dtype):
            return token_logprobs(self.role.net, batch["input_ids"], batch["attention_mask"], where=where)

    def values(self, batch: dict) -> torch.Tensor:
        # the value of the state *before* token t+1, aligned with the label positions: (B, T−1)
        with autocast(self.role.device, self.role.compute_dtype):
            out = self.role.net(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        return out.logits[:, :-1, 0].float()

    def scores(self, batch: dict) -> torch.Tensor:
        with autocast(self.role.device, self.role.compute_dtype):
            out = self.role.net(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        return out.logits[:, 0].float()


class Trainer(Sleeps, HandsOver):
    def __init__(
        self,
        model_dir: str,
        lr: float,
        zero_stage: int = 0,
        seed: int = 0,
        threads: int = 1,
        *,
        head: str = "causal_lm",
        live_weights: bool = False,
        device: str = "cpu",
        sync_dtype: str | None = None,
        compute_dtype: str | None = None,
        dropout: bool = False,
        lora=None,
        rank: int = 0,
        rendezvous: _ranks.Rendezvous | None = None,
        micro_batch: int = 0,
        activation_checkpointing: bool = False,
        offload_optimizer: bool = False,
    ):
        """`head`: one of HEADS. `live_weights`: keep the parameters in a shared-memory buffer that
        same-node rollout replicas bind to (raypai.alignment.sync, "live shared parameters"); only for
        loops in which no replica samples while this trainer updates (the synchronous ones), only at
        ZeRO stage 0 and only on the CPU. `device`: "cpu" or "cuda" (fp32 weights, bf16 autocast;
        `roles._device`). `sync_dtype`: the rollout replicas' weight dtype (e.g. "bfloat16"), in which
        the weights are handed over in shared memory; None: this trainer's own (fp32). `compute_dtype`:
        the forward's autocast dtype ("bfloat16" or "float32"; None: bf16 on CUDA, fp32 on the CPU). `dropout`:
        keep the model's own dropout in training (SFT); RL updates train without it (an update
        compares training-mode outputs with eval-mode ones: `roles._engine.without_dropout`), LoRA's
        dropout included. `lora`: a `raypai.alignment.lora.LoRASpec` (None: every weight trains).

        Several ranks (`rendezvous.ranks` > 1, this one `rank`; `raypai.alignment.ranks`): one
        DeepSpeed engine across them at `zero_stage` (3: the parameters sharded too, loaded shard by
        shard); each call's batch is split across the ranks by rows. `micro_batch`: rows per
        forward/backward on a rank (0: its whole share). `activation_checkpointing`: recompute each
        block's activations in the backward pass. `offload_optimizer`: ZeRO-Offload (stage ≥ 1)."""
        if head not in HEADS:
            raise ValueError(f"unknown trainer head {head!r}; choose one of {', '.join(HEADS)}")
        torch.set_num_threads(threads)
        torch.manual_seed(seed)
        self.threads, self.model_dir, self.head = threads, model_dir, head
        self.device = role_device(device, "trainer")
        self.sync_dtype = DTYPES[sync_dtype] if sync_dtype else None
        self.compute_dtype = trainer_dtype(self.device, compute_dtype)  # the forward's autocast (None: fp32)
        self.updates_done = 0  # the weights' version: optimizer steps taken (rollouts record the version they sample)
        self.rank, self.ranks = rank, rendezvous.ranks if rendezvous else 1
        self.zero_stage, self.micro_batch = zero_stage, micro_batch
        _ranks.join(rendezvous, rank, use_gpu=self.device.type == "cuda")
        conf = engine_config(zero_stage, offload_optimizer=offload_optimizer, ranks=self.ranks)
        model = _load(model_dir, head, conf)
        if zero_stage != 3:
            model = model.to(self.device)
        self.lora = lora
        if lora is not None:
            from raypai.alignment import lora as L

            model = L.attach(model, lora, L.head_modules(model) if head != "causal_lm" else None)
        if not dropout:
            without_dropout(model)
        if activation_checkpointing:
            # non-reentrant: the recomputation needs no input that requires grad (a LoRA run's embeddings do not)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        # the transformers model the forward passes run (with LoRA, the base model holding the adapter layers)
        self.net = model.get_base_model() if lora is not None else model
        self._shared = None  # raypai.alignment.sync.SharedWeights: made now when live, else at the first same-node sync
        self._live = (
            live_weights
            and head == "causal_lm"
            and lora is None  # the replicas merge the adapters into weights of their own
            and zero_stage == 0
            and self.ranks == 1
            and self.device.type == "cpu"
            and not sync_dtype
        )
        if self._live:
            from raypai.alignment.sync import SharedWeights

            params = dict(model.named_parameters())  # tied weights once
            self._shared = SharedWeights(self._shared_path(), params, create=True)
            self._shared.bind(params, copy=True)
            self._shared.stamp(0)
        # ZeRO-3 leaves each rank a shard of every weight: the whole size is DeepSpeed's `ds_numel`
        self.n_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
        conf = engine_config(
            zero_stage,
            offload_optimizer=offload_optimizer,
            ranks=self.ranks,
            params=self.n_params,
            use_gpu=self.device.type == "cuda",
        )
        self.engine = make_engine(model, lr=lr, conf=conf, use_gpu=self.device.type == "cuda")
        self.held: dict = {}
        self._forward = _Forward(self)
        self.sync_bucket_bytes = SYNC_BUCKET_BYTES  # ZeRO-3: parameters gathered at a time for a weight sync

    def _threads_for(self, batch, passes: int = 6) -> None:
        """Threads for a step over `batch` (6 FLOPs per parameter and token: forward and backward;
        2 for a forward alone), at most the actor's own (TRAIN_FLOPS_PER_THREAD)."""
        if self.device.type == "cpu":
            flops = passes * self.n_params * _tokens(batch)
            torch.set_num_threads(cpu_threads(flops, TRAIN_FLOPS_PER_THREAD, self.threads))

    # ---- updates ---------------------------------------------------------------------------------

    def update(self, objective, batch: dict) -> dict:
        """One optimizer step on `objective` over a ready `batch` (what `objective.assemble` makes).
        Returns the objective's stats with `loss` (total / normaliser), `grad_norm`, the weights'
        `policy_version` before the step and `update_seconds` (this actor's own time)."""
        t0 = time.perf_counter()
        set_mode(self.engine, True)
        batch = _to(batch, self.device)
        mine, weight = _ranks.share(batch, self.rank, self.ranks)
        self._threads_for(mine)
        version = self.updates_done
        parts = _ranks.micro_count(batch, self.ranks, self.micro_batch)  # the same on every rank
        if parts == 1:
            self._before_forward()
            out = objective.loss(self._forward, mine)
            units = self._all_units(out.normaliser * weight)
            loss, outs = self._backward(out.total * weight, units), [(out, weight)]
        else:
            # micro-batches: every backward needs the step's whole normaliser up front, from the batch
            if not hasattr(objective, "units"):
                raise ValueError(
                    f"{type(objective).__name__} has no units(batch), so it cannot run in micro-batches: "
                    "set micro_batch=0 or give the objective a units() method (losses.objectives)"
                )
            units = self._all_units(float(objective.units(mine)) * weight)
            loss, outs = 0.0, []
            for i, (chunk, w) in enumerate(_ranks.micro(mine, parts)):
                self._before_forward()
                out = objective.loss(self._forward, chunk)
                loss += self._backward(out.total * (weight * w), units, boundary=i == parts - 1)
                outs.append((out, weight * w))
        if self.ranks > 1:
            [loss] = _ranks.all_sum([loss], self.device)
        if self._live:
            self._shared.stamp(-1)  # being written
        grad_norm = engine_step(self.engine)
        self.updates_done += 1
        if self._live:
            self._shared.stamp(self.updates_done)
        return {
            "loss": loss,
            **self._stats(outs),
            "grad_norm": grad_norm,
            "policy_version": version,
            "update_seconds": time.perf_counter() - t0,
        }

    def _before_forward(self) -> None:
        """What DeepSpeed's `engine.forward` does before a training forward (which runs the model
        itself here, `_Forward`): a ZeRO optimizer counts the micro-batch, so the next backward's
        gradients add to those of the last instead of replacing them."""
        clear = getattr(self.engine.optimizer, "clear_backward_seen_flag", None)
        if clear is not None:
            clear()

    def _all_units(self, normaliser):
        """The step's normaliser: this rank's, summed over the ranks (one rank: as it is)."""
        if self.ranks == 1:
            return normaliser
        return _ranks.all_sum([normaliser], self.device)[0]

    def _backward(self, total: torch.Tensor, units, boundary: bool | None = None) -> float:
        """Backward of one (micro-)batch's share of the step's loss, total / units (`boundary`: whether
        it is the step's last micro-batch; None: its only one). DeepSpeed averages the ranks'
        gradients, so each rank's share is scaled by the rank count: the sum over ranks and
        micro-batches is the one-process gradient of the whole batch. Returns this share's part of
        the step's loss."""
        if boundary is not None:
            self.engine.set_gradient_accumulation_boundary(boundary)
        share = total / units if self.ranks == 1 else total * self.ranks / units
        self.engine.backward(share)
        return share.item() / self.ranks

    def _stats(self, outs: list) -> dict:
        """The objective's stats of a step over its micro-batches and ranks ((Loss, weight) pairs): each
        share's weighted by its normaliser, so a token mean stays the token mean of the whole batch."""
        if len(outs) == 1 and self.ranks == 1:
            return {k: float(v) for k, v in outs[0][0].stats.items()}
        keys = sorted(outs[0][0].stats)
        w = [float(o.normaliser) * wo for o, wo in outs]
        sums = [sum(wi * float(o.stats[k]) for wi, (o, _) in zip(w, outs)) for k in keys] + [sum(w)]
        if self.ranks > 1:
            sums = _ranks.all_sum(sums, self.device)
        return {k: v / sums[-1] if sums[-1] else 0.0 for k, v in zip(keys, sums)}

    def update_on(self, objective, *inputs, **named) -> dict:
        """`update` on the batch `objective.assemble` makes of `inputs` (what Ray hands over: the
        rollout replicas' outputs, the Reward actor's scores, rows of held data). No batch (nothing to
        learn, e.g. online DPO's groups all tied): no update, {"skipped": 1.0}."""
        batch = objective.assemble(*inputs, held=self.held, **named)
        if batch is None:
            return {"skipped": 1.0}
        return self.update(objective, batch)

    def updates(self, objective, inputs: list) -> list[dict]:
        """`update_on` once per entry of `inputs` (each a tuple of arguments, or one argument), in
        order, in one call: a call's own cost in Ray is then paid once for several small steps."""
        return [self.update_on(objective, *(i if isinstance(i, tuple) else (i,))) for i in inputs]

    def hold(self, name: str, data) -> int:
        """Keep data here (host memory) that later updates name rows of (`objective.assemble(idx,
        held=...)`), instead of shipping their tensors with each step; returns its row count."""
        self.held[name] = data
        first = data[0] if isinstance(data, (tuple, list)) else data
        return len(first["input_ids"]) if isinstance(first, dict) else len(first)

    def param_counts(self) -> dict:
        """Trainable and total parameters (with LoRA, the adapters and a scalar head are trainable)."""
        trainable = sum(getattr(p, "ds_numel", p.numel()) for p in self.engine.module.parameters() if p.requires_grad)
        return {"trainable_params": trainable, "total_params": self.n_params}

    # ---- forward passes (eval mode, no gradients) -----------------------------------------------

    def _infer(self, what: str, batch: dict) -> torch.Tensor:
        """A forward pass over the batch, each rank on its share of the rows; the whole result on every rank."""
        set_mode(self.engine, False)
        batch, weight = _ranks.share(_to(batch, self.device), self.rank, self.ranks)
        self._threads_for(batch, passes=2)
        with torch.no_grad():
            if what == "logprobs":
                out = self._forward.logprobs(batch, batch["response_mask"]).cpu()
            else:
                out = getattr(self._forward, what)(batch).cpu()
        return _ranks.gather(out, weight, self.ranks)

    def logprobs(self, batch: dict) -> torch.Tensor:
        """(B, T−1) log-probs of the response tokens (`response_mask`), 0 elsewhere."""
        return self._infer("logprobs", batch)

    def values(self, batch: dict) -> torch.Tensor:
        """(B, T−1) values of a token-value head (the critic)."""
        return self._infer("values", batch)

    def scores(self, batch: dict) -> torch.Tensor:
        """(B,) scores of a sequence-score head (the reward model)."""
        return self._infer("scores", batch)

    def _base(self):
        """The weights with the adapters off: a LoRA run's reference (the frozen starting policy)."""
        if self.lora is None:
            raise RuntimeError("base_logprobs: this trainer has no LoRA adapters; the reference is its own role")
        return self.engine.module.disable_adapter()

    def base_logprobs(self, batch: dict) -> torch.Tensor:
        """`logprobs` of the base model (adapters off): a LoRA run's reference log-probs."""
        with self._base():
            return self.logprobs(batch)

    def base_logprobs_on(self, sampled: dict, *outs: dict) -> torch.Tensor:
        """`base_logprobs` of a generation as Ray hands it over (`Reference.logprobs_on`)."""
        from raypai.alignment._loop import handed_over

        return self.base_logprobs(handed_over(sampled, outs))

    def base_pair_logprobs_on(self, scores: dict, sampled: dict, *outs: dict):
        """The base model's summed log-probs of online DPO's pairs (`Reference.pair_logprobs_on`)."""
        from raypai.alignment._loop import pair_logprobs

        return pair_logprobs(self.base_logprobs, scores, sampled, *outs)

    def values_on(self, sampled: dict, *outs: dict) -> torch.Tensor:
        """`values` of a generation as Ray hands it over (`_loop.handed_over`)."""
        from raypai.alignment._loop import handed_over

        return self.values(handed_over(sampled, outs))

    # ---- weights ----------------------------------------------------------------------------------

    def version(self) -> int:
        return self.updates_done

    def rank_memory(self) -> dict:
        """This rank's model state in bytes: `params`, its own share of the parameters (at ZeRO-3 its
        partitions); `optimizer`, the optimizer's state and the fp32 master partitions ZeRO ≥ 1 keeps
        apart from the parameters; `grads`, the gradients it holds after a step's backward (its
        partition at ZeRO ≥ 2: DeepSpeed's flat buffers; at stage 0, one per trainable parameter)."""
        module = self.engine.module
        own = {p.data_ptr() for p in module.parameters()}
        params = sum(
            (p.ds_tensor if hasattr(p, "ds_tensor") else p).numel() * p.element_size() for p in module.parameters()
        )
        opt = self.engine.optimizer
        inner = getattr(opt, "optimizer", opt)  # DeepSpeed's ZeRO optimizers wrap the torch one
        seen: set = set()

        def size(t) -> int:
            if not isinstance(t, torch.Tensor) or t.data_ptr() in seen or t.data_ptr() in own:
                return 0
            seen.add(t.data_ptr())
            return t.numel() * t.element_size()

        optimizer = sum(size(v) for st in inner.state.values() for v in st.values())
        # the fp32 master partitions ZeRO keeps apart from the module's parameters (stage 1-2, stage 3)
        masters = [
            *getattr(opt, "single_partition_of_fp32_groups", []),
            *getattr(opt, "fp32_partitioned_groups_flat", []),
        ]
        optimizer += sum(size(t) for t in masters)
        if self.zero_stage >= 2:  # a gradient partition the size of the master partition
            grads = sum(t.numel() * t.element_size() for t in masters)
        else:
            grads = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
        return {"rank": self.rank, "params": int(params), "optimizer": int(optimizer), "grads": int(grads)}

    def export(self, out_dir: str, extra: dict | None = None, adapter_dir: str | None = None) -> str:
        """The model as an HF folder: weights and the source folder's tokenizer files; a causal LM
        also gets a generation config whose EOS list holds every stop token (plain `generate` stops
        where raypai does). `extra`: written as raypai.json. With LoRA the folder holds the merged
        model (base + adapters, loadable by plain transformers), and the adapter itself goes to
        `adapter_dir` (default: `out_dir` + "-adapter") in PEFT's format (adapter_config.json naming
        the base folder, adapter_model.safetensors); the trainer is finished after it (the adapters
        are merged into its weights)."""
        from raypai.chat import ChatFormat, copy_tokenizer_files, write_generation_stops

        out = Path(out_dir)
        model = self.engine.module
        state = self._whole_state() if self.zero_stage == 3 else None  # every rank takes part in the gather
        if self.rank:
            return str(out)
        if self.lora is not None:
            from raypai.alignment.lora import adapter_folder

            adapter = Path(adapter_dir or adapter_folder(out_dir))
            model.save_pretrained(adapter, safe_serialization=True)
            copy_tokenizer_files(self.model_dir, adapter)
            if extra is not None:
                meta = {**extra, "kind": "lora_adapter", "base_model": self.model_dir, **self.param_counts()}
                (adapter / "raypai.json").write_text(json.dumps(meta, indent=1, default=str))
            model = model.merge_and_unload()
            self.lora = None  # merged: a later update would train the merged weights, not adapters
        model.save_pretrained(out, safe_serialization=True, state_dict=state)
        copy_tokenizer_files(self.model_dir, out)
        if self.head == "causal_lm":
            write_generation_stops(out, ChatFormat.from_pretrained(self.model_dir).stop_ids)
        if extra is not None:
            (out / "raypai.json").write_text(json.dumps(extra, indent=1, default=str))
        return str(out)

    def save_checkpoint(
        self, folder: str, tag: str, client_state: dict | None = None, *, keep: int = 2, point_latest: bool = True
    ) -> None:
        """Save under a new `tag`, then (`point_latest`) point `latest` at it and keep the `keep`
        newest tags (raypai.alignment.checkpoint.commit)."""
        from raypai.alignment.checkpoint import commit

        # with LoRA the base weights are the starting folder's: only the adapters (and their optimizer
        # state) are saved
        self.engine.save_checkpoint(folder, tag=tag, save_latest=False, exclude_frozen_parameters=self.lora is not None)
        if self.rank == 0:
            # the driver's state as JSON + npz beside DeepSpeed's files, never pickled (raypai.checkpoint_io)
            write_state(Path(folder) / tag, client_state or {})
        if self.ranks > 1:
            torch.distributed.barrier()  # every rank's shard is written before `latest` names the tag
        if self.rank == 0:
            commit(folder, tag, keep=keep, point_latest=point_latest)

    def load_checkpoint(self, folder: str, tag: str | None = None) -> dict:
        """Load the checkpoint `tag` (None: the one `latest` names); returns the state the driver saved
        with it. DeepSpeed's files are read with weights_only=True (`raypai.checkpoint_io.guard_engine`)."""
        from raypai.alignment.checkpoint import latest_tag

        tag = tag or latest_tag(folder)
        self.engine.load_checkpoint(folder, tag=tag, load_module_strict=self.lora is None)
        return read_state(Path(folder) / tag) or {}
