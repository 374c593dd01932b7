"""The memory plan of an alignment run: for each model role, per rank, the bytes of its weights,
gradients, optimizer state, activations and logits against the memory a rank has; when something
does not fit, the config changes that would make it fit, each checked by planning again.

    raypai align grpo --model sft/ --data prompts.jsonl --out grpo/ --config grpo.yaml --plan

    from raypai.alignment.plan import check, plan
    p = plan("grpo", "sft/", GRPOConfig(ranks=2, zero_stage=2), seq_len=1024)
    print(p.table()); p.fits; p.to_dict()
    [str(f) for f in p.fixes]                  # ["ranks=4", "activation_checkpointing=True", ...]: each fits
    check("grpo", "sft/", cfg)                 # ConfigError naming the role that does not fit, and the fixes

Model sizes come from the folder's config: the model is built on the meta device (no weights are
read), so parameter counts are exact. The formulas, with their sources, are in docs/scaling.md
("The memory plan"); the comments below name the terms.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field, replace

from raypai.alignment.config import LIVE_ENGINES
from raypai.errors import ConfigError
from raypai.train.strategy import GB, model_state_bytes

# A model's context length is a limit, not the length of its data: without max_length (or seq_len)
# the plan assumes sequences of the context capped at this many tokens.
SEQ_CAP = 4096
# DeepSpeed's gradient bucket (`reduce_bucket_size`, its default, which the roles do not change):
# allocated whole on a GPU, touched only as far as the gradients fill it on the CPU.
REDUCE_BUCKET = 500_000_000
# rows the driver scores per reference call over a dataset (`dpo.seq_logprobs`' chunk)
SCORING_CHUNK = 64
# the changes `fixes` tries: ranks up to this many, LoRA at this rank
MAX_RANKS = 64
FIX_LORA_R = 16
NO_FIX = (
    f"no change of ranks (up to {MAX_RANKS}), reference_ranks, reward_ranks, rollout_replicas, zero_stage, offload_optimizer, "
    "activation_checkpointing, micro_batch or lora_r fits it: use a smaller model, shorter sequences (max_length) "
    "or more memory per rank"
)
KINDS = ("params", "grads", "optimizer", "activations", "logits", "buffers")


# ---- the model --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Shape:
    """What the byte counts read from a model folder (one head of it)."""

    model_type: str
    params: int  # every parameter, tied weights once
    head: int  # parameters of a scalar head outside the backbone (0 for the LM head)
    linears: tuple  # (leaf name, in, out) of every linear projection, for LoRA's adapters
    targets: tuple  # LoRA's default targets: the blocks' projections (`lora.target_modules`)
    layers: int
    hidden: int
    q_dim: int  # heads · head_dim
    kv_dim: int  # kv_heads · head_dim
    heads: int
    intermediate: int
    vocab: int
    context: int
    gated: bool  # a gated MLP (SwiGLU: gate, up, down) rather than GPT-2's fc → act → proj
    rotary: bool  # rotary embeddings: the forward keeps rotated copies of q and k
    eager: bool  # attention that materialises the (s × s) scores
    lean: bool  # the trainer runs raypai's lean forward (`_lean.lean_supported`)
    block_linear: int  # parameters of one block's projections
    fused_copy: int  # of them, those the lean forward concatenates (q/k/v, gate/up stored apart)
    largest_module: int  # the largest block or embedding: what ZeRO-3 gathers at once

    def adapters(self, r: int, targets: tuple) -> int:
        """LoRA's parameters on `targets` (() = the blocks' projections): r · (in + out) per
        matching linear, matched by leaf name as peft does."""
        names = set(targets or self.targets)
        return sum(r * (i + o) for leaf, i, o in self.linears if leaf in names)


@functools.lru_cache(maxsize=16)
def read_model(model_dir: str, head: str = "causal_lm") -> Shape:
    """The Shape of `model_dir`'s model with `head` ("causal_lm", "score" or "token_value"), built
    on the meta device from its config (exact parameter counts, no weights read)."""
    import torch
    import transformers as tf
    from transformers.pytorch_utils import Conv1D

    from raypai.alignment._lean import lean_supported
    from raypai.alignment.lora import _blocks, head_modules, target_modules
    from raypai.chat import context_length

    hf = tf.AutoConfig.from_pretrained(model_dir, **({} if head == "causal_lm" else {"num_labels": 1}))
    cls = {
        "causal_lm": tf.AutoModelForCausalLM,
        "score": tf.AutoModelForSequenceClassification,
        "token_value": tf.AutoModelForTokenClassification,
    }[head]
    with torch.device("meta"):
        model = cls.from_config(hf).eval()
    linears = []  # GPT-2's Conv1D stores its weight (in, out), a Linear (out, in)
    for name, m in model.named_modules():
        if isinstance(m, (torch.nn.Linear, Conv1D)):
            i, o = m.weight.shape[::-1] if isinstance(m, torch.nn.Linear) else m.weight.shape
            linears.append((name.rsplit(".", 1)[-1], i, o))
    blocks = _blocks(model)
    block = blocks[0]
    kinds = (torch.nn.Linear, Conv1D)
    block_lin = [(n.rsplit(".", 1)[-1], m.weight.numel()) for n, m in block.named_modules() if isinstance(m, kinds)]
    h = getattr(hf, "hidden_size", None) or hf.n_embd
    heads = getattr(hf, "num_attention_heads", None) or hf.n_head
    head_dim = getattr(hf, "head_dim", None) or h // heads
    kv_heads = getattr(hf, "num_key_value_heads", None) or heads
    inter = getattr(hf, "intermediate_size", None) or getattr(hf, "n_inner", None) or 4 * h
    embed = model.get_input_embeddings().weight.numel()
    lean = head == "causal_lm" and lean_supported(model)
    apart = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # Phi-3 stores them fused: no copy
    return Shape(
        model_type=hf.model_type,
        params=sum(p.numel() for p in model.parameters()),
        head=0
        if head == "causal_lm"
        else sum(p.numel() for n in head_modules(model) for p in model.get_submodule(n).parameters()),
        linears=tuple(linears),
        targets=tuple(target_modules(model)),
        layers=len(blocks),
        hidden=h,
        q_dim=heads * head_dim,
        kv_dim=kv_heads * head_dim,
        heads=heads,
        intermediate=inter,
        vocab=hf.vocab_size,
        context=context_length(hf),
        gated=any("gate" in leaf for leaf, _ in block_lin),
        rotary=any(n.endswith("rotary_emb") for n, _ in model.named_modules()),
        eager=getattr(model.config, "_attn_implementation", None) == "eager",
        lean=lean,
        block_linear=sum(n for _, n in block_lin),
        fused_copy=sum(n for leaf, n in block_lin if leaf in apart) if lean else 0,
        largest_module=max(sum(p.numel() for p in block.parameters()), embed),
    )


# ---- the formulas (pure: a Shape and numbers in, bytes out) ----------------------------------------
def block_values(s: Shape, seq_len: int) -> tuple[int, int]:
    """Values one block keeps per token for its backward, (fp32, compute dtype): Korthikanti et al.
    2022 §4.1's count of the saved tensors, for the forward raypai runs. The residual stream (each
    norm's input) stays fp32 under autocast; in the compute dtype: the QKV input, the QKV output (V
    is read from it), the rotated Q and K, the attention output and its head-merged copy, the MLP
    input and its hidden tensors (gated: gate, up, act(gate), act(gate)·up; GPT-2: fc out, act out).
    SDPA keeps no (s × s) scores (Dao et al. 2022); eager attention adds its softmax, heads · s."""
    attn = s.hidden + (s.q_dim + 2 * s.kv_dim) + (s.q_dim + s.kv_dim if s.rotary else 0) + 2 * s.q_dim
    mlp = s.hidden + (4 if s.gated else 2) * s.intermediate
    return 2 * s.hidden, attn + mlp + (s.heads * seq_len if s.eager else 0)


def activation_bytes(s: Shape, seqs: int, seq_len: int, *, value_bytes: int, checkpointing: bool) -> int:
    """Bytes the forward of `seqs` sequences of `seq_len` tokens keeps for the backward, without the
    logits: every block's values (`block_values`) and the final norm's input and output; with
    activation checkpointing (Chen et al. 2016) each block's fp32 input only, plus one block's
    values at a time while the backward recomputes it."""
    fp32, low = block_values(s, seq_len)
    per_block = 4 * fp32 + value_bytes * low
    tokens = seqs * seq_len
    blocks = s.layers * 4 * s.hidden + per_block if checkpointing else s.layers * per_block
    return tokens * (blocks + (4 + value_bytes) * s.hidden)


def logit_bytes(s: Shape, seqs: int, positions: int, *, scalar: bool) -> int:
    """fp32 logits of `positions` per sequence and the log-softmax's gradient of the same size
    (B, T, vocab) · 4 · 2; a scalar head (reward model, critic) has one value per position."""
    return seqs * positions * (1 if scalar else s.vocab) * 8


def weight_copies(s: Shape, *, on_gpu: bool, blocks: int) -> int:
    """Weight copies the forward keeps for its backward: on a GPU each projection's bf16 cast
    (autocast), on the CPU the lean forward's concatenated q/k/v and gate/up weights (fp32)."""
    return blocks * (2 * s.block_linear if on_gpu else 4 * s.fused_copy)


def kv_cache_bytes(s: Shape, rows: int, seq_len: int, value_bytes: int) -> int:
    """A decoder's cache: keys and values of every layer, (rows, seq_len, kv_dim) each."""
    return rows * seq_len * s.layers * 2 * s.kv_dim * value_bytes


# ---- the plan ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Row:
    """One model role: its ranks, the bytes each rank holds by kind (KINDS), the bytes it keeps in
    host memory (ZeRO-Offload) and the capacity it is checked against."""

    role: str
    ranks: int
    device: str  # cuda | cpu
    bytes: dict
    host: int
    capacity: int
    source: str  # where the capacity comes from
    note: str = ""

    @property
    def total(self) -> int:
        """What a rank holds on its device (on the CPU, host memory is the device)."""
        return sum(self.bytes.values()) + (self.host if self.device == "cpu" else 0)

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity


@dataclass(frozen=True)
class Fix:
    """Config changes that make the run fit, and the fullest rank's share of its memory after them."""

    changes: dict
    peak: float  # total / capacity of the fullest role afterwards
    role: str  # that role

    def __str__(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.changes.items())


@dataclass(frozen=True)
class Plan:
    algo: str
    model_dir: str
    seq_len: int
    rows: list
    problems: list = field(default_factory=list)
    fixes: list = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return not self.problems

    def table(self) -> str:
        """A fixed-width table: one line per role, bytes per rank."""
        cols = ("role", "ranks", "device", *KINDS, "host", "total/rank", "capacity", "")
        lines = [f"memory plan: {self.algo} on {self.model_dir}, sequences of {self.seq_len} tokens (bytes per rank)"]
        cells = [cols]
        for r in self.rows:
            kinds = [_size(r.bytes[k]) for k in KINDS]
            mark = "ok" if r.fits else "OVER"
            cells.append(
                (r.role, str(r.ranks), r.device, *kinds, _size(r.host), _size(r.total), _size(r.capacity), mark)
            )
        widths = [max(len(c[i]) for c in cells) for i in range(len(cols))]
        for c in cells:
            cells_ = (v.ljust(w) if i in (0, 2) else v.rjust(w) for i, (v, w) in enumerate(zip(c, widths)))
            lines.append("  ".join(cells_).rstrip())
        for r in self.rows:
            lines.append(f"  {r.role}: capacity = {r.source}" + (f"; {r.note}" if r.note else ""))
        if self.fits:
            return "\n".join([*lines, "fits"])
        lines += ["does not fit:", *(f"  - {p}" for p in self.problems)]
        lines += ["changes that fit (each checked by planning again):", *(f"  - {f}" for f in self.fix_lines())]
        return "\n".join(lines)

    def fix_lines(self) -> list[str]:
        """The fixes as sentences (or what to do when no config change fits)."""
        if not self.fixes:
            return [NO_FIX]
        return [f"{f} ({f.role} then at {f.peak:.0%} of its memory)" for f in self.fixes]

    def to_dict(self) -> dict:
        """The plan as plain data (JSON-ready): each row with its total and whether it fits."""
        return {
            **{k: getattr(self, k) for k in ("algo", "model_dir", "seq_len", "fits", "problems")},
            "rows": [{**asdict(r), "total": r.total, "fits": r.fits} for r in self.rows],
            "fixes": [asdict(f) for f in self.fixes],
        }


def _size(b: float) -> str:
    if b == 0:
        return "-"
    for unit, scale in (("GB", GB), ("MB", 1024**2), ("KB", 1024)):
        if b >= scale:
            return f"{b / scale:.2f} {unit}"
    return f"{int(b)} B"


def plan(
    algo: str,
    model_dir: str,
    cfg,
    *,
    seq_len: int | None = None,
    device_bytes: int | None = None,
    host_bytes: int | None = None,
    reward_model_dir: str | None = None,
) -> Plan:
    """The memory plan of `algo` (a name in `algorithms.ALGORITHMS`) on `model_dir` with `cfg`.

    `seq_len`: tokens per sequence; default `cfg.max_length`, else the model's context capped at
    SEQ_CAP (a context is a limit, not the data's length: pass seq_len for long data).
    Capacity per rank: `cfg.memory_gb` when > 0; else `device_bytes` (a device's memory, to plan
    for another machine); else on a GPU run (`cfg.gpus` > 0) with a GPU visible, its memory; else
    host RAM (`host_bytes`, default this machine's) divided by the run's ranks.
    `reward_model_dir`: a reward model scored in (GRPO, PPO with reward_model_weight > 0; PPO's
    critic starts from it)."""
    from raypai.alignment.algorithms import get

    get(algo, what="memory plan")
    env = _Env(
        device_bytes, host_bytes if host_bytes is not None else _host_ram(), cfg.gpus > 0 and device_bytes is None
    )
    models = _Models(model_dir, reward_model_dir)
    seq = seq_len or cfg.max_length or min(models.get("causal_lm").context, SEQ_CAP)
    rows = _rows(algo, models, cfg, seq, env)
    problems = _problems(rows, env, cfg)
    fixes = _fixes(algo, models, cfg, seq, env) if problems else []
    return Plan(algo, model_dir, seq, rows, problems, fixes)


def check(algo: str, model_dir: str, cfg, **kw) -> Plan:
    """`plan`, or a ConfigError naming each role that does not fit and the changes that would fit."""
    p = plan(algo, model_dir, cfg, **kw)
    if p.fits:
        return p
    fixes = [f"it fits with {f}" for f in p.fix_lines()] if p.fixes else p.fix_lines()
    raise ConfigError(p.problems + fixes, what=f"{algo} memory plan")


# ---- roles -------------------------------------------------------------------------------------------
class _Models:
    def __init__(self, model_dir: str, reward_model_dir: str | None):
        self.dirs = {"policy": model_dir, "reward": reward_model_dir}

    def get(self, head: str, which: str = "policy") -> Shape:
        return read_model(str(self.dirs[which] or self.dirs["policy"]), head)


@dataclass(frozen=True)
class _Env:
    device_bytes: int | None
    host: int
    want_gpu: bool

    @functools.cached_property
    def gpu(self) -> int | None:
        """The visible GPU's memory, when the run asks for one."""
        if not self.want_gpu:
            return None
        import torch

        return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None


def _host_ram() -> int:
    import psutil

    return psutil.virtual_memory().total


def _batches(algo: str, cfg) -> tuple[int, int, int, int]:
    """(units per optimizer step, sequences per unit, sequences sampled per step, reference rows per
    call) as each driver makes them."""
    if algo == "dpo" and getattr(cfg, "online", False):
        algo = "online_dpo"
    if algo == "sft":
        return cfg.batch_size, 2 if cfg.ptx_coef > 0 else 1, 0, 0  # ptx: as many LM rows beside
    if algo == "reward_model":
        return cfg.batch_size, 2, 0, 0  # pairs: chosen and rejected scored in one step
    if algo == "dpo":
        return cfg.batch_size, 2, 0, SCORING_CHUNK  # pairs, stacked; the reference scores the dataset once
    if algo == "online_dpo":
        return cfg.batch_size, 2, cfg.batch_size * cfg.num_samples, 2 * cfg.batch_size  # best vs worst
    if algo == "grpo":
        n = cfg.prompts_per_step * cfg.group_size
        return n, 1, n, n
    return cfg.prompts_per_step, 1, cfg.prompts_per_step, cfg.prompts_per_step  # ppo: one sample per prompt


def _rows(algo: str, models: _Models, cfg, seq: int, env: _Env) -> list[Row]:
    units, per_unit, sampled, ref_rows = _batches(algo, cfg)
    gpu, lora = cfg.gpus > 0, cfg.lora()
    lm = models.get("causal_lm")
    # the heads run on the response tokens only (`_tensors.token_logprobs`): of a sampled sequence at
    # most max_new_tokens under the lean forward; of a dataset's, up to the whole sequence
    positions = min(cfg.max_new_tokens, seq - 1) if sampled and lm.lean else seq
    if algo == "reward_model":
        roles = [("reward-trainer", cfg.ranks, _trained(models.get("score"), cfg, units, per_unit, seq, seq, gpu))]
    else:
        roles = [("policy", cfg.ranks, _trained(lm, cfg, units, per_unit, seq, positions, gpu))]
    if algo == "ppo":  # a scalar per position, from the reward model when given
        roles.append(("critic", cfg.ranks, _trained(models.get("token_value", "reward"), cfg, units, 1, seq, seq, gpu)))
    if ref_rows and not lora and (algo != "grpo" or cfg.beta > 0):  # LoRA: the policy's base is the reference
        rows = math.ceil(ref_rows / cfg.reference_ranks)
        shards = cfg.reference_ranks if getattr(cfg, "reference_zero3", False) else 1
        roles.append(("reference", cfg.reference_ranks, _frozen(lm, rows, seq, positions, gpu, shards)))
    if sampled:
        replicas = getattr(cfg, "rollout_replicas", 1)
        roles.append(("rollout", replicas, _rollout(lm, cfg, math.ceil(sampled / replicas), seq, gpu)))
    if algo in ("grpo", "ppo") and models.dirs["reward"] and cfg.reward_model_weight:
        # the Reward ranks stay on CPUs (fp32), each scoring a share of a step's samples
        ranks = getattr(cfg, "reward_ranks", 1)
        rows = math.ceil(sampled / ranks)
        roles.append(("reward", ranks, _frozen(models.get("score", "reward"), rows, seq, seq, False)))
    total_ranks = sum(r[1] for r in roles)
    out = []
    for role, ranks, (kinds, host, note, device) in roles:
        cap, source = _capacity(cfg, env, device, total_ranks)
        out.append(Row(role, ranks, device, kinds, host, cap, source, note))
    return out


def _capacity(cfg, env: _Env, device: str, total_ranks: int) -> tuple[int, str]:
    if cfg.memory_gb > 0:
        return int(cfg.memory_gb * GB), f"memory_gb={cfg.memory_gb:g}"
    if env.device_bytes is not None:
        return env.device_bytes, "the device's memory (given)"
    if device == "cuda" and env.gpu is not None:
        return env.gpu, "the GPU's memory"
    return env.host // total_ranks, f"host RAM {_size(env.host)} / {total_ranks} ranks of the run"


def _trained(s: Shape, cfg, units: int, per_unit: int, seq: int, positions: int, gpu: bool):
    """A Trainer rank: fp32 weights and AdamW (ZeRO §3 with K = 8, DeepSpeed's fp32 partition at
    stages 1-2), its share of the step's rows in micro-batches, bf16 autocast on a GPU."""
    n, stage, lora = cfg.ranks, cfg.zero_stage, cfg.lora()
    if lora:  # the adapters (and a scalar head's trained copy, peft's modules_to_save) train; the base is frozen
        trainable = s.adapters(lora.r, lora.target_modules) + s.head
        frozen = s.params
    else:
        trainable, frozen = s.params, 0
    w, g, k = model_state_bytes(trainable, n, stage, mixed_precision=False)
    host = 0
    if cfg.offload_optimizer:  # ZeRO-Offload: moments, fp32 partition (stage 3 copies it) and gradient partition
        host = k + (4 * trainable / n if stage == 3 else 0) + 4 * trainable / n
        k = 0
    share = math.ceil(units / n)
    seqs = min(cfg.micro_batch or share, share) * per_unit
    vb = 2 if gpu else 4
    ckpt = cfg.activation_checkpointing
    buffers = weight_copies(s, on_gpu=gpu, blocks=1 if ckpt else s.layers)
    if stage >= 1 or n > 1:
        buffers += 4 * (REDUCE_BUCKET if gpu else min(REDUCE_BUCKET, trainable))
    if stage == 3:
        buffers += 4 * 2 * s.largest_module  # the module being computed and the one prefetched
    kinds = {
        "params": w + 4 * frozen,
        "grads": g,
        "optimizer": k,
        "activations": activation_bytes(s, seqs, seq, value_bytes=vb, checkpointing=ckpt),
        "logits": logit_bytes(s, seqs, positions, scalar=s.head > 0),
        "buffers": buffers,
    }
    note = f"{trainable:,} of {trainable + frozen:,} parameters train; {seqs} sequences per micro-batch"
    return _ints(kinds), int(host), note, "cuda" if gpu else "cpu"


def _frozen(s: Shape, rows: int, seq: int, positions: int, gpu: bool, shards: int = 1):
    """An inference role (reference, reward model): bf16 weights on a GPU, fp32 on the CPU; no
    gradients, so one block's values at a time and the logits of its rows. `shards` > 1: ZeRO-3
    inference, each rank holding 1/shards of the weights plus the largest module while it is gathered."""
    vb = 2 if gpu else 4
    fp32, low = block_values(s, seq)
    kinds = dict.fromkeys(KINDS, 0)
    kinds["params"] = s.params * vb if shards == 1 else (math.ceil(s.params / shards) + s.largest_module) * vb
    kinds["activations"] = rows * seq * (4 * fp32 + vb * low)
    kinds["logits"] = rows * positions * (1 if s.head else s.vocab) * (4 + vb)
    return _ints(kinds), 0, f"{rows} rows per call", "cuda" if gpu else "cpu"


def _rollout(s: Shape, cfg, rows: int, seq: int, gpu: bool):
    """A rollout replica: its weights (none of its own on the CPU when it reads the trainer's live
    parameters, `Trainer._live`), a KV cache for its rows, one block's values while prefilling."""
    vb = 2 if gpu else 4
    b, _, _, device = _frozen(s, rows, seq, 1, gpu)
    b["logits"] = rows * s.vocab * 4  # the sampled position only
    b["buffers"] = kv_cache_bytes(s, rows, seq, vb)
    solo = cfg.zero_stage == 0 and cfg.ranks == 1 and not cfg.lora()  # one whole trainer to read
    live = not gpu and cfg.rollout_engine in LIVE_ENGINES and not getattr(cfg, "async_rollout", False) and solo
    note = f"{rows} sequences per replica"
    tp = getattr(cfg, "rollout_tensor_parallel", 1) if gpu else 1
    if tp > 1:  # vLLM shards the weights and the KV cache's heads over the replica's tp GPUs: one GPU's bytes
        b.update(params=-(-b["params"] // tp), buffers=-(-b["buffers"] // tp))
        note += f", over {tp} GPUs (tensor parallel: the bytes of one)"
    if live:
        b["params"] = 0
        note += "; reads the policy's live parameters"
    elif cfg.lora():  # it merges the adapters into weights of its own and keeps the targeted base weights
        targeted = set(cfg.lora().target_modules or s.targets)
        b["params"] += vb * sum(i * o for leaf, i, o in s.linears if leaf in targeted)
    return b, 0, note, device


def _ints(kinds: dict) -> dict:
    return {k: int(kinds[k]) for k in KINDS}


def _problems(rows: list[Row], env: _Env, cfg) -> list[str]:
    p = []
    for r in rows:
        if not r.fits:
            parts = ", ".join(f"{k} {_size(v)}" for k, v in r.bytes.items() if v)
            p.append(
                f"{r.role} needs {_size(r.total)} per rank ({parts}), over the {_size(r.capacity)} each of its "
                f"{r.ranks} rank(s) has ({r.source})"
            )
    if env.gpu is not None and cfg.memory_gb <= 0:  # a GPU run here: offloaded state and CPU roles in host memory
        host = sum((r.host + (r.total if r.device == "cpu" else 0)) * r.ranks for r in rows)
        if host > env.host:
            p.append(
                f"the run holds {_size(host)} in host memory (offloaded optimizer state, CPU roles), over {_size(env.host)}"
            )
    return p


# ---- fixes ----------------------------------------------------------------------------------------------
class _View:
    """`cfg` with some fields changed, read like the config (no validation: `_fixes` keeps valid ones)."""

    def __init__(self, cfg, changes: dict):
        self._cfg, self._changes = cfg, changes

    def __getattr__(self, name):
        return self._changes[name] if name in self._changes else getattr(self._cfg, name)

    def lora(self):
        return type(self._cfg).lora(self)  # the config's own rule, on the changed fields


def _options(algo: str, cfg) -> dict:
    """Values `fixes` tries for each field (the current one first)."""
    units = _batches(algo, cfg)[0]
    ranks = [cfg.ranks] + [2**i for i in range(1, 7) if cfg.ranks < 2**i <= min(MAX_RANKS, max(units, 1))]
    whole = math.ceil(units / cfg.ranks)
    micro = [cfg.micro_batch] + [m for m in (2**i for i in range(12)) if m < (cfg.micro_batch or whole)]
    return {
        "ranks": ranks,
        "zero_stage": list(range(cfg.zero_stage, 4)),
        "offload_optimizer": [cfg.offload_optimizer] + ([] if cfg.offload_optimizer else [True]),
        "activation_checkpointing": [cfg.activation_checkpointing] + ([] if cfg.activation_checkpointing else [True]),
        "micro_batch": micro,
        "lora_r": [cfg.lora_r] + ([] if cfg.lora_r else [FIX_LORA_R]),
    }


# within one set of changed fields the least change wins: fewer ranks, a lower stage, a larger micro-batch
def _least(changes: dict) -> tuple:
    return (
        sum(changes.get(k, 0) for k in ("ranks", "reference_ranks", "reward_ranks", "rollout_replicas")),
        changes.get("zero_stage", 0),
        changes.get("offload_optimizer", False),
        -(changes.get("micro_batch", 0) or 10**9),
    )


def _fixes(algo: str, models: _Models, cfg, seq: int, env: _Env, most: int = 6) -> list[Fix]:
    """Every combination of the `_options` values, planned again (a reference or rollout replica
    that still does not fit then gets the fewest ranks, or replicas, that make it fit): per set of
    changed fields the least change that fits, no set that contains another that fits; fewest
    changes first, then the most headroom."""
    import itertools

    opts = _options(algo, cfg)
    best: dict = {}
    for values in itertools.product(*opts.values()):
        changes = {k: v for k, v in zip(opts, values) if v != getattr(cfg, k)}
        view = _View(cfg, changes)
        if (view.offload_optimizer and view.zero_stage < 1) or (view.zero_stage == 3 and view.lora_r):
            continue  # the config refuses these (config.Scale)
        rows = _rows(algo, models, view, seq, env)
        for role, name in (
            ("reference", "reference_ranks"),
            ("reward", "reward_ranks"),
            ("rollout", "rollout_replicas"),
        ):
            # rows shared by more ranks (each still holds the whole model); online DPO has one replica
            while (
                hasattr(cfg, name)
                and any(r.role == role and not r.fits for r in rows)
                and getattr(view, name) < MAX_RANKS
            ):
                changes[name] = 2 * getattr(view, name)
                rows = _rows(algo, models, view, seq, env)
        if not changes or _problems(rows, env, view):
            continue
        key = frozenset(changes)
        if key not in best or _least(changes) < _least(best[key][0]):
            worst = max(rows, key=lambda r: r.total / r.capacity)
            best[key] = (changes, worst.total / worst.capacity, worst.role)
    kept = [v for k, v in best.items() if not any(o < k for o in best)]
    kept.sort(key=lambda v: (len(v[0]), v[1]))
    fixes = []
    for changes, peak, role in kept:
        try:
            replace(cfg, **changes)  # the config's own checks, once per fix
        except ConfigError:
            continue
        fixes.append(Fix(changes, peak, role))
    return fixes[:most]


__all__ = ["Fix", "Plan", "Row", "Shape", "check", "plan", "read_model"]
