"""The pure-PyTorch parts of raypai on a CUDA device: what can be checked on a GPU machine that has
PyTorch and transformers but no Ray, DeepSpeed or MLflow (the session's lent GPU machine).

    python benchmarks/gpu_check.py            # one JSON line per check; exit 1 if any failed

1. losses: every loss and advantage function on CUDA in fp32 (equal to the CPU result) and bf16
   (close to it), outputs on the inputs' device and dtype;
2. training: a tiny random-init Llama and Qwen2 (transformers configs) trained on CUDA with bf16
   autocast through raypai's token log-probs and the GRPO / DPO losses: loss falls, gradients finite;
   seconds per step on CUDA and on the CPU;
3. serving: the continuous-batching engine (`raypai.serving.engine.Engine`) and `generate_batch` with
   the model on CUDA give the CPU's greedy tokens, requests joining a running batch; tokens/s both ways.
4. rollout (issue #14): a ~0.5B random-init Qwen2 (Qwen2-0.5B's shape): in fp32, the greedy tokens of
   HF `generate`, raypai's decoding loop (`raypai.alignment._decode.decode`) eager and as a replayed CUDA
   graph agree, and the graph's sampled log-probs equal a teacher-forced forward; in bf16, tokens/s of
   the three sampling 64 distinct prompts and 64 prompts × 8 samples, 128 new tokens each; one GRPO
   policy update (bf16 autocast, fp32 AdamW) through the model's own forward and raypai's lean one,
   taking turns for several rounds, in seconds and tokens/s; then sleep/wake of that trainer's weights and optimizer state
   (`raypai.alignment.offload`): bitwise equal after wake, seconds and GB/s.
   `python benchmarks/gpu_check.py rollout` (engines) and `... update` (update and offload) run these alone.
   `... attention`: SDPA at the lean forward's grouped-attention shape, forward + backward, per backend.

5. roles (issue #14): the colocated GPU roles of a synchronous GRPO run with `gpus=1`, in one process
   (policy trainer, bf16 rollout, bf16 reference on one GPU): bf16 weight sync, trainer sleep/wake
   around sampling, seconds per phase, exactness of both. Needs DeepSpeed there: carry it as a wheel
   (`pip wheel --no-deps deepspeed==<version>` here, plus hjson and pydantic for Python 3.12).

The pretraining loop (Ray Train) and the role actors as Ray actors cannot run there: not checked here.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _import_raypai() -> None:
    """Without an install (no Ray/MLflow there): a bare `raypai` package over the source folders, so
    the pure modules (losses, chat, serving engine) import without the core's __init__."""
    if importlib.util.find_spec("ray") is not None:
        return  # installed: the real package
    pkg = types.ModuleType("raypai")
    pkg.__path__ = [str(ROOT / "platform" / "raypai"), str(ROOT)]  # raypai.alignment → alignment/, ...
    sys.modules["raypai"] = pkg
    train = types.ModuleType("raypai.train")  # its __init__ loads Ray Train; the roles need train/clipping.py only
    train.__path__ = [str(ROOT / "train")]
    sys.modules["raypai.train"] = train


_import_raypai()

import torch  # noqa: E402

from raypai.alignment._tensors import token_logprobs  # noqa: E402
from raypai.alignment.losses import (  # noqa: E402
    ChosenRejected,
    bradley_terry_loss,
    clipped_surrogate,
    clipped_value_loss,
    dpo_loss,
    gae,
    grpo_advantages,
    grpo_loss,
    k3_kl,
    kl_penalized_rewards,
    masked_whiten,
)

RESULTS: list[dict] = []


def emit(**row) -> None:
    RESULTS.append(row)
    print(json.dumps(row), flush=True)


def _losses(device: str, dtype: torch.dtype, seed: int = 0, through: torch.dtype | None = None) -> list[torch.Tensor]:
    """Every loss/advantage output for the same random inputs, made on `device` in `dtype`
    (`through`: rounded through that dtype first, so a float32 reference sees bf16's inputs)."""
    g = torch.Generator().manual_seed(seed)
    B, T = 8, 12

    def t(*shape):
        x = torch.randn(*shape, generator=g)
        return (x.to(through) if through is not None else x).to(device, dtype)

    mask = (torch.rand(B, T, generator=g) > 0.2).to(device, dtype)
    lp, old, ref, values = t(B, T) * 0.1 - 2, t(B, T) * 0.1 - 2, t(B, T) * 0.1 - 2, t(B, T)
    return [
        dpo_loss(ChosenRejected(t(B), t(B)), ChosenRejected(t(B), t(B)), beta=0.1).loss,
        dpo_loss(
            ChosenRejected(t(B), t(B)),
            ChosenRejected(t(B), t(B)),
            beta=0.1,
            loss_type="ipo",
            lengths=ChosenRejected(t(B).abs() + 1, t(B).abs() + 1),
        ).loss,
        bradley_terry_loss(t(B), t(B), margin=0.5)[0],
        grpo_advantages(t(B), 4),
        k3_kl(lp, ref),
        grpo_loss(lp, old, ref, t(B), mask, clip_eps=0.2, clip_eps_high=0.28, beta=0.04, aggregation="dapo")[0],
        clipped_surrogate(lp, old, t(B, T), clip_eps=0.2)[0],
        masked_whiten(lp, mask),
        kl_penalized_rewards(t(B), lp, ref, mask, 0.05),
        *gae(t(B, T), values, mask, 1.0, 0.95),
        clipped_value_loss(values, t(B, T), t(B, T), mask, 0.2),
    ]


LOSS_NAMES = [
    "dpo_sigmoid",
    "dpo_ipo",
    "bradley_terry",
    "grpo_advantages",
    "k3_kl",
    "grpo_loss",
    "clipped_surrogate",
    "masked_whiten",
    "kl_penalized_rewards",
    "gae_advantages",
    "gae_returns",
    "clipped_value_loss",
]


def check_losses() -> None:
    """fp32 on CUDA must equal the CPU; bf16 is reported against a float32 CPU run on the same
    bf16-rounded inputs (bf16 keeps ~3 significant digits, so the gap is bf16 arithmetic's)."""
    cpu = _losses("cpu", torch.float32)
    got = _losses("cuda", torch.float32)
    on_device = all(o.device.type == "cuda" and o.dtype == torch.float32 for o in got)
    worst = max(float(((o.cpu() - c).abs() / (c.abs() + 1)).max()) for o, c in zip(got, cpu))
    emit(
        check="losses_cuda_float32",
        ok=on_device and worst <= 1e-4,
        outputs=len(got),
        on_inputs_device_and_dtype=on_device,
        max_rel_diff_vs_cpu=worst,
    )
    ref = _losses("cpu", torch.float32, through=torch.bfloat16)
    got = _losses("cuda", torch.bfloat16)
    on_device = all(o.device.type == "cuda" and o.dtype == torch.bfloat16 for o in got)
    finite = all(torch.isfinite(o.float()).all() for o in got)
    diffs = {
        n: round(float(((o.float().cpu() - c).abs() / (c.abs() + 1)).max()), 4) for n, o, c in zip(LOSS_NAMES, got, ref)
    }
    emit(
        check="losses_cuda_bfloat16",
        ok=on_device and finite,
        outputs=len(got),
        on_inputs_device_and_dtype=on_device,
        finite=finite,
        rel_diff_vs_fp32_on_same_inputs=diffs,
    )


def _tiny(family: str, vocab: int = 256):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    common = dict(
        vocab_size=vocab,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    cfg = LlamaConfig(**common) if family == "llama" else Qwen2Config(**common)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg)


def _pattern_batch(b: int, t: int, vocab: int, g: torch.Generator) -> torch.Tensor:
    """Sequences following next = (3·x + 1) mod vocab from a random start: learnable in a few steps."""
    x = torch.empty(b, t, dtype=torch.long)
    x[:, 0] = torch.randint(0, vocab, (b,), generator=g)
    for i in range(1, t):
        x[:, i] = (3 * x[:, i - 1] + 1) % vocab
    return x


def _train(family: str, device: str, steps: int, autocast: bool) -> dict:
    model = _tiny(family).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    losses, times, finite = [], [], True
    for step in range(steps):
        x = _pattern_batch(16, 64, 256, g).to(device)
        mask = torch.ones_like(x)
        t0 = time.perf_counter()
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=autocast):
            lp = token_logprobs(model, x, mask)  # (B, T-1), float32 log-probs
            if step % 2 == 0:  # SFT-style: mean negative log-likelihood
                loss = -lp.mean()
            else:  # GRPO-style on the same tokens: advantages favour half the rows
                adv = torch.tensor([1.0, -1.0] * 8, device=device)
                loss, _ = grpo_loss(lp, lp.detach(), None, adv, torch.ones_like(lp), aggregation="dapo")
                loss = loss - lp.mean()  # keep the likelihood term so the curve is comparable
        opt.zero_grad(set_to_none=True)
        loss.backward()
        finite = finite and all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())
        opt.step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
    # DPO on two halves of a batch, reference = a frozen copy taken now
    ref = _tiny(family).to(device).eval()
    ref.load_state_dict(model.state_dict())
    x = _pattern_batch(16, 32, 256, g).to(device)
    with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=autocast):
        lp = token_logprobs(model, x, torch.ones_like(x)).sum(1)
        with torch.no_grad():
            rlp = token_logprobs(ref, x, torch.ones_like(x)).sum(1)
        out = dpo_loss(ChosenRejected(lp[:8], lp[8:]), ChosenRejected(rlp[:8], rlp[8:]), beta=0.1)
    out.loss.backward()
    dpo_ok = torch.isfinite(out.loss).item() and abs(float(out.loss) - 0.6931) < 1e-2  # policy == reference: log 2
    steady = sorted(times[2:])[len(times[2:]) // 2]
    return {
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "grads_finite": bool(finite),
        "dpo_at_reference_is_log2": dpo_ok,
        "median_step_s": steady,
    }


def check_training(steps: int = 40) -> None:
    for family in ("llama", "qwen2"):
        gpu = _train(family, "cuda", steps, autocast=True)
        cpu = _train(family, "cpu", 6, autocast=False)
        ok = gpu["last_loss"] < 0.5 * gpu["first_loss"] and gpu["grads_finite"] and gpu["dpo_at_reference_is_log2"]
        emit(
            check=f"train_{family}_cuda_bf16_autocast",
            ok=ok,
            steps=steps,
            **gpu,
            cpu_median_step_s=cpu["median_step_s"],
            speedup_vs_cpu=cpu["median_step_s"] / gpu["median_step_s"],
        )


class _Tok:
    """The engine needs a tokenizer only to decode and for its pad id: ids as text."""

    pad_token_id = 0

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(i) for i in ids)


def _engine_run(model, prompts, max_tokens: int, stop: set[int]) -> tuple[list[str], float, int]:
    from raypai.serving.engine import Engine
    from raypai.serving.generation import GenRequest

    eng = Engine(model, _Tok(), stop, max_batch_size=16)
    reqs = [GenRequest(p, max_tokens, 0.0) for p in prompts]
    done: dict[int, str] = {}
    t0 = time.perf_counter()
    half = len(reqs) // 2
    events = eng.add(list(enumerate(reqs[:half])))  # the rest join a running batch two steps later
    for _ in range(2):
        events += eng.step()
    events += eng.add([(i + half, r) for i, r in enumerate(reqs[half:])])
    while True:
        for e in events:
            if e.result is not None:
                done[e.key] = e.result.text
        if eng.active == 0:
            break
        events = eng.step()
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    return [done[i] for i in range(len(reqs))], time.perf_counter() - t0, eng.tokens


def check_serving() -> None:
    from raypai.serving.generation import GenRequest, generate_batch

    model = _tiny("llama").eval()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 256, (int(n),), generator=g).tolist() for n in torch.randint(3, 40, (16,), generator=g)]
    stop = {7}
    cpu_text, cpu_s, cpu_tokens = _engine_run(model, prompts, 48, stop)
    model.cuda()
    _engine_run(model, prompts[:2], 4, stop)  # warm-up (kernels, allocator)
    gpu_text, gpu_s, gpu_tokens = _engine_run(model, prompts, 48, stop)
    same = sum(a == b for a, b in zip(cpu_text, gpu_text))
    # greedy on two devices can part where two logits tie within float error: most rows must agree
    emit(
        check="serving_engine_cuda_greedy_matches_cpu",
        ok=same >= len(prompts) - 1,
        rows=len(prompts),
        rows_equal=same,
        cpu_tokens_per_s=cpu_tokens / cpu_s,
        cuda_tokens_per_s=gpu_tokens / gpu_s,
    )
    out = generate_batch(model, _Tok(), [GenRequest(p, 8, 0.0) for p in prompts[:4]], stop)
    emit(check="serving_generate_batch_cuda", ok=all(r.completion_tokens > 0 for r in out), rows=len(out))


def _qwen2_half_b():
    """Qwen2-0.5B's shape (24 layers, hidden 896, 14/2 heads, vocab 151,936: 494M parameters), random init."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg)


def _random_prompts(n: int = 64) -> list[list[int]]:
    """n prompts of 16–47 random token ids (the same ones for every check)."""
    g = torch.Generator().manual_seed(5)
    return [
        torch.randint(10, 150000, (int(k),), generator=g).tolist() for k in torch.randint(16, 48, (n,), generator=g)
    ]


def _rollout_engines(model, prompts: list[list[int]], stop: list[int]) -> dict:
    """name → fn(temperature, max_new) → per-row token lists: HF generate, raypai's loop shrinking
    the batch (eager), and raypai's fixed-shape step replayed as a CUDA graph."""
    from raypai.alignment._decode import decode, left_pad

    def hf(temperature: float, max_new: int):
        ids, att = left_pad(prompts, 0, "cuda")
        kw = {"do_sample": False} if temperature == 0 else {"do_sample": True, "temperature": temperature, "top_k": 0}
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=att,
                max_new_tokens=max_new,
                eos_token_id=stop,
                pad_token_id=0,
                min_new_tokens=max_new,
                **kw,
            )
        return [row[ids.shape[1] :].tolist() for row in out.cpu()]

    def raypai(static: bool):
        return lambda temperature, max_new: (
            decode(
                model,
                prompts,
                pad_id=0,
                stop_ids=stop,
                max_new_tokens=max_new,
                temperature=temperature,
                logprobs=True,
                static=static,
            ).tokens
        )

    return {"hf_generate": hf, "raypai_eager": raypai(False), "raypai_cuda_graph": raypai(True)}


def _tokens_per_s(fn, new_tokens: int, repeats: int = 2) -> float:
    fn(1.0, 8)  # warm-up: kernels, allocator
    best = 0.0
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        toks = fn(1.0, new_tokens)
        torch.cuda.synchronize()
        best = max(best, sum(map(len, toks)) / (time.perf_counter() - t0))
    return best


def check_rollout(new_tokens: int = 128) -> None:
    """Issue #14's GPU measurement: rollout engines and one policy update on a ~0.5B model in bf16."""
    from raypai.alignment._decode import decode

    model = _qwen2_half_b().cuda().eval()
    n_params = sum(p.numel() for p in model.parameters())
    distinct = _random_prompts()
    stop = [151643]  # Qwen2's <|endoftext|>; a random model almost never samples it, so rows run to the limit

    # correctness in fp32 (bf16 greedy parts at near-ties): greedy tokens of the three engines, and the
    # graph's sampled log-probs against a teacher-forced forward over prompt + completion
    engines = _rollout_engines(model, distinct[:16], stop)
    greedy = {name: fn(0.0, 16) for name, fn in engines.items()}
    same = {name: sum(a == b for a, b in zip(greedy["hf_generate"], toks)) for name, toks in greedy.items()}
    d = decode(
        model,
        distinct[:16],
        pad_id=0,
        stop_ids=stop,
        max_new_tokens=16,
        logprobs=True,
        static=True,
        generator=torch.Generator("cuda").manual_seed(1),
    )
    seqs = [p + t for p, t in zip(distinct[:16], d.tokens)]
    width = max(map(len, seqs))
    x = torch.zeros((16, width), dtype=torch.long)
    att = torch.zeros((16, width), dtype=torch.long)
    for i, sq in enumerate(seqs):
        x[i, : len(sq)], att[i, : len(sq)] = torch.tensor(sq), 1
    with torch.no_grad():
        full = token_logprobs(model, x.cuda(), att.cuda(), lean=False)
    lp_diff = max(
        float((lp.cuda() - full[i, len(p) - 1 : len(p) - 1 + len(lp)]).abs().max())
        for i, (p, lp) in enumerate(zip(distinct[:16], d.logprobs))
    )
    emit(
        check="rollout_engines_fp32_agree",
        ok=same["raypai_eager"] >= 15 and same["raypai_cuda_graph"] >= 15 and lp_diff < 1e-3,
        rows=16,
        greedy_rows_equal_to_hf=same,
        graph_logprob_max_abs_diff=lp_diff,
    )

    model = model.to(torch.bfloat16)
    for label, prompts in (("64_distinct", distinct), ("64x8_grouped", [p for p in distinct for _ in range(8)])):
        rates = {name: _tokens_per_s(fn, new_tokens) for name, fn in _rollout_engines(model, prompts, stop).items()}
        emit(
            check=f"rollout_qwen2_0.5b_bf16_{label}",
            ok=True,
            params_m=round(n_params / 1e6, 1),
            rows=len(prompts),
            new_tokens=new_tokens,
            tokens_per_s={k: round(v) for k, v in rates.items()},
            graph_vs_hf=round(rates["raypai_cuda_graph"] / rates["hf_generate"], 2),
            eager_vs_hf=round(rates["raypai_eager"] / rates["hf_generate"], 2),
        )


def _update_once(model, x, m, resp, adv, lean: bool, grpo_loss) -> None:
    """One micro-batch's forward and backward (gradients cleared after)."""
    with torch.autocast("cuda", dtype=torch.bfloat16):
        lp = token_logprobs(model, x[:32], m[:32], where=resp[:32] if lean else None, lean=lean)
        loss, _ = grpo_loss(lp, lp.detach(), None, adv[:32], resp[:32], aggregation="dapo")
    loss.backward()
    model.zero_grad(set_to_none=True)


def _top_kernels(fn, n: int = 8) -> list:
    """The n CUDA kernels with the most device time in one call of fn: [name, ms, calls]."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = []
    for ev in prof.key_averages():
        us = getattr(ev, "self_device_time_total", None)
        us = getattr(ev, "self_cuda_time_total", 0) if us is None else us
        if us:
            rows.append([ev.key[:90], round(us / 1e3, 2), ev.count])
    return sorted(rows, key=lambda r: -r[1])[:n]


def check_attention() -> None:
    """SDPA at the shape of the lean forward's grouped attention in `check_update` (64 continuations
    of 127 inputs over a prompt of up to 47 keys and their own, Qwen2-0.5B's 14 query / 2 key heads,
    bf16), forward + backward, per backend: grouped heads under the mask (what `_lean` does), the
    key/value heads repeated to the query heads under the mask (what transformers' SDPA path does
    under a mask), and causal attention over the whole 174-token rows with no mask, for scale. Each
    backend is forced in turn; one that refuses the inputs says why."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    F = torch.nn.functional
    B, H, KV, D, Li, Lp = 64, 14, 2, 64, 127, 47
    g = torch.Generator("cuda").manual_seed(0)

    def t(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()

    q, qf, k, v = t(B, H, Li, D), t(B, H, Lp + Li, D), t(B, KV, Lp + Li, D), t(B, KV, Lp + Li, D)
    plen = torch.randint(16, Lp + 1, (B,), device="cuda", generator=g)
    pmask = (torch.arange(Lp, device="cuda")[None] < plen[:, None])[:, None, None, :].expand(B, 1, Li, Lp)
    causal = torch.ones((Li, Li), dtype=torch.bool, device="cuda").tril().expand(B, 1, Li, Li)
    mask = torch.cat([pmask, causal], dim=-1)
    forms = {
        "grouped_heads_under_mask": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True),
        "repeated_heads_under_mask": lambda: F.scaled_dot_product_attention(
            q, k.repeat_interleave(H // KV, 1), v.repeat_interleave(H // KV, 1), attn_mask=mask
        ),
        "grouped_heads_causal_whole_rows": lambda: F.scaled_dot_product_attention(
            qf, k, v, is_causal=True, enable_gqa=True
        ),
    }
    with torch.no_grad():
        same = float(
            (forms["grouped_heads_under_mask"]().float() - forms["repeated_heads_under_mask"]().float()).abs().max()
        )
    backends = {
        "default": None,
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "math": SDPBackend.MATH,
    }
    table = {}
    for form, fn in forms.items():
        table[form] = {}
        for label, backend in backends.items():

            def once():
                fn().float().sum().backward()

            try:
                with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
                    once()
                    times = []
                    for _ in range(10):
                        torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        once()
                        torch.cuda.synchronize()
                        times.append(time.perf_counter() - t0)
                table[form][label] = round(sorted(times)[5] * 1e3, 3)
            except RuntimeError as exc:
                table[form][label] = f"refused: {str(exc).splitlines()[0][:120]}"
    emit(
        check="sdpa_grouped_attention_bf16_fwd_bwd_ms",
        ok=same < 0.05,
        max_abs_diff_repeated_vs_grouped=same,
        ms_by_backend=table,
    )


def check_update(new_tokens: int = 128, rounds: int = 4) -> None:
    """One GRPO policy update on 8 prompts × 8 samples of the ~0.5B model: bf16 autocast over fp32
    master weights, AdamW; the model's own forward (full-vocabulary logits) vs raypai's (response
    positions only, each prompt once); then sleep/wake of that trainer (`check_offload`)."""
    from raypai.alignment._decode import decode
    from raypai.alignment.losses import grpo_loss

    model = _qwen2_half_b().cuda().to(torch.bfloat16).eval()
    distinct = _random_prompts()
    stop = [151643]
    prompts = [p for p in distinct[:8] for _ in range(8)]
    comps = decode(model, prompts, pad_id=0, stop_ids=stop, max_new_tokens=new_tokens).tokens
    model = model.float().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    seqs = [p + t for p, t in zip(prompts, comps)]
    width = max(map(len, seqs))
    x = torch.zeros((64, width), dtype=torch.long)
    m = torch.zeros((64, width), dtype=torch.long)
    resp = torch.zeros((64, width - 1))
    for i, (p, sq) in enumerate(zip(prompts, seqs)):
        x[i, : len(sq)], m[i, : len(sq)] = torch.tensor(sq), 1
        resp[i, len(p) - 1 : len(sq) - 1] = 1
    x, m, resp = x.cuda(), m.cuda(), resp.cuda()
    adv = torch.randn(64).cuda()

    # in fp32 the lean forward (each prompt once) gives the model's own log-probs on CUDA too
    rows = slice(0, 16)
    with torch.no_grad():
        ref = token_logprobs(model, x[rows], m[rows], lean=False) * resp[rows]
        diff = float((token_logprobs(model, x[rows], m[rows], where=resp[rows]) - ref).abs().max())
    emit(check="lean_grouped_logprobs_fp32_cuda_equal_model_forward", ok=diff < 1e-3, rows=16, max_abs_diff=diff)

    # the two forwards take turns, `rounds` times, 4 steps each (the first of each turn not counted):
    # one machine's spread between runs is larger than the difference being measured
    times = {"model_forward": [], "raypai_lean": []}
    peak = {}
    for _ in range(rounds):
        for name, lean in (("model_forward", False), ("raypai_lean", True)):
            torch.cuda.reset_peak_memory_stats()
            for k in range(4):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for half in (slice(0, 32), slice(32, 64)):  # two micro-batches of 4 prompts × 8
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        lp = token_logprobs(model, x[half], m[half], where=resp[half] if lean else None, lean=lean)
                        loss, _ = grpo_loss(lp, lp.detach(), None, adv[half], resp[half], aggregation="dapo")
                    (loss / 2).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                torch.cuda.synchronize()
                if k:
                    times[name].append(time.perf_counter() - t0)
            peak[name] = torch.cuda.max_memory_allocated() / 2**30
    for name, lean in (("model_forward", False), ("raypai_lean", True)):
        ts = sorted(times[name])
        step = ts[len(ts) // 2]
        emit(
            check=f"grpo_update_qwen2_0.5b_bf16_autocast_{name}",
            ok=bool(torch.isfinite(loss).item()),
            rows=64,
            tokens=int(m.sum()),
            rounds=rounds,
            median_step_s=round(step, 4),
            min_step_s=round(ts[0], 4),
            max_step_s=round(ts[-1], 4),
            tokens_per_s=round(int(m.sum()) / step),
            peak_memory_gb=round(peak[name], 2),
            top_kernels=_top_kernels(lambda: _update_once(model, x, m, resp, adv, lean, grpo_loss)),
        )
    check_offload(model, opt)


class _Forward:
    """The trainer role's forward for an objective (`losses.objectives.Model`), on CUDA: bf16 autocast,
    raypai's lean log-probs (with LoRA: the adapters applied as merged weights)."""

    def __init__(self, model):
        self.model = model

    def logprobs(self, batch: dict, where=None) -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return token_logprobs(self.model, batch["input_ids"], batch["attention_mask"], where=where)


def check_lora(new_tokens: int = 128, steps: int = 4, r: int = 16) -> None:
    """Issue #34 on a GPU: a GRPO update of the ~0.5B Qwen2 (8 prompts × 8, bf16 autocast over fp32
    weights, AdamW) with full fine-tuning against LoRA r = 16 on every projection of its blocks (peft;
    raypai's lean forward applying the adapters): peak memory, seconds a step and tokens/s; in fp32 the
    lean LoRA log-probs equal peft's own forward and the adapters-off base equals the model before
    LoRA; then the rollout's side: the adapters merged into a bf16 replica (`lora.merge_into`), the
    bytes a sync sends, and the replica's decoding tokens/s."""
    from raypai.alignment import lora as L
    from raypai.alignment._decode import decode
    from raypai.alignment.config import LoRASpec
    from raypai.alignment.losses.objectives import GRPO

    sampler = _qwen2_half_b().cuda().to(torch.bfloat16).eval()
    prompts = [p for p in _random_prompts()[:8] for _ in range(8)]
    comps = decode(sampler, prompts, pad_id=0, stop_ids=[151643], max_new_tokens=new_tokens).tokens
    seqs = [p + t for p, t in zip(prompts, comps)]
    width = max(map(len, seqs))
    x = torch.zeros((64, width), dtype=torch.long)
    m = torch.zeros((64, width), dtype=torch.long)
    resp = torch.zeros((64, width - 1))
    for i, (p, sq) in enumerate(zip(prompts, seqs)):
        x[i, : len(sq)], m[i, : len(sq)] = torch.tensor(sq), 1
        resp[i, len(p) - 1 : len(sq) - 1] = 1
    seq = {"input_ids": x.cuda(), "attention_mask": m.cuda(), "response_mask": resp.cuda()}
    halves = [{k: v[h] for k, v in seq.items()} for h in (slice(0, 32), slice(32, 64))]
    adv = torch.randn(64).cuda()
    objective = GRPO(group_size=8, aggregation="dapo", max_new_tokens=new_tokens)
    spec = LoRASpec(r=r, alpha=2.0 * r)
    del sampler
    rows = {}
    for mode in ("full", "lora"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        model = _qwen2_half_b().cuda().train()
        if mode == "lora":
            peft_model = L.attach(model, spec)
            net = peft_model.get_base_model()
            with torch.no_grad():  # B = 0 at the start: nudge the adapters so the equality checks can fail
                for n, p in peft_model.named_parameters():
                    if "lora_B" in n:
                        p.normal_(0, 1e-3)
            b = {k: v[:8] for k, v in seq.items()}
            with torch.no_grad():
                lean = token_logprobs(net, b["input_ids"], b["attention_mask"], where=b["response_mask"])
                own = token_logprobs(net, b["input_ids"], b["attention_mask"], lean=False) * b["response_mask"]
                with peft_model.disable_adapter():
                    base = token_logprobs(net, b["input_ids"], b["attention_mask"], where=b["response_mask"])
                plain = _qwen2_half_b().cuda()
                want = token_logprobs(plain, b["input_ids"], b["attention_mask"], where=b["response_mask"])
                del plain
            emit(
                check="lora_lean_logprobs_fp32_cuda_equal_peft_forward",
                ok=float((lean - own).abs().max()) < 1e-3 and float((lean - base).abs().max()) > 1e-4,
                max_abs_diff=float((lean - own).abs().max()),
                adapters_move_logprobs_by=float((lean - base).abs().max()),
            )
            emit(
                check="lora_reference_is_the_base_with_adapters_off",
                ok=float((base - want).abs().max()) < 1e-5,
                max_abs_diff=float((base - want).abs().max()),
            )
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        else:
            net = model
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-6)
        fwd, times = _Forward(net), []
        for k in range(steps + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for h in (0, 1):  # two micro-batches of 4 prompts × 8
                half = {"seq": halves[h], "advantages": adv[32 * h : 32 * h + 32], "old_lp": None, "ref_lp": None}
                out = objective.loss(fwd, half)
                (out.total / out.normaliser / 2).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            if k:
                times.append(time.perf_counter() - t0)
        step = sorted(times)[len(times) // 2]
        trainable = sum(p.numel() for p in params)
        sync = (
            sum(v.numel() * v.element_size() for v in L.adapter_state(peft_model).values())
            if mode == "lora"
            else sum(p.numel() * 2 for p in model.parameters())  # a bf16 replica's copy of every weight
        )
        rows[mode] = {
            "peak_memory_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2),
            "median_step_s": round(step, 4),
            "tokens_per_s": round(int(m.sum()) / step),
            "trainable_params": trainable,
            "sync_bytes": sync,
        }
        emit(
            check=f"grpo_update_qwen2_0.5b_{mode}", ok=bool(torch.isfinite(out.total).item()), steps=steps, **rows[mode]
        )
        if mode == "lora":  # the replica's side: merge the factors into a bf16 copy, decode with it
            replica = _qwen2_half_b().cuda().to(torch.bfloat16).eval()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            L.merge_into(replica, L.adapter_state(peft_model), spec, {})
            torch.cuda.synchronize()
            merge_s = time.perf_counter() - t0
            distinct = _random_prompts()
            rate = _tokens_per_s(
                lambda temperature, most: (
                    decode(
                        replica, distinct, pad_id=0, stop_ids=[], max_new_tokens=most, temperature=temperature
                    ).tokens
                ),
                new_tokens,
            )
            emit(
                check="lora_replica_merge_and_decode_bf16", ok=True, merge_s=round(merge_s, 3), tokens_per_s=round(rate)
            )
            del replica
        del model, opt, params, fwd
        if mode == "lora":
            del peft_model, net
    full, lora = rows["full"], rows["lora"]
    emit(
        check="lora_vs_full_grpo_update_qwen2_0.5b",
        ok=lora["peak_memory_gb"] < full["peak_memory_gb"],
        memory_ratio=round(lora["peak_memory_gb"] / full["peak_memory_gb"], 3),
        step_time_ratio=round(lora["median_step_s"] / full["median_step_s"], 3),
        sync_bytes_ratio=round(lora["sync_bytes"] / full["sync_bytes"], 4),
    )


def check_offload(model, opt) -> None:
    """Sleep/wake of a trainer between phases (raypai.alignment.offload): the 0.5B model's fp32
    weights and AdamW state leave the GPU and come back bitwise equal; seconds and GB/s, twice (the
    second sleep reuses the pinned host buffers)."""
    from raypai.alignment.offload import sleep

    before = {k: v.clone() for k, v in model.state_dict().items()}
    torch.cuda.synchronize()
    resident = torch.cuda.memory_allocated()
    rows = []
    for _ in range(2):
        slept = sleep(model, opt)
        freed = resident - torch.cuda.memory_allocated()
        wake_s = slept.wake()
        rows.append(
            {
                "gb": round(slept.bytes / 1e9, 3),
                "sleep_s": round(slept.seconds, 4),
                "wake_s": round(wake_s, 4),
                "freed_gb": round(freed / 1e9, 3),
            }
        )
    exact = all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    on_gpu = all(p.is_cuda for p in model.parameters()) and all(
        t.is_cuda for st in opt.state.values() for t in st.values() if torch.is_tensor(t) and t.dim() > 0
    )
    emit(
        check="offload_sleep_wake_qwen2_0.5b_fp32_adamw",
        ok=exact and on_gpu and rows[-1]["freed_gb"] >= 0.9 * rows[-1]["gb"],
        bitwise_equal_after_wake=exact,
        back_on_gpu=on_gpu,
        rounds=rows,
        sleep_gb_per_s=round(rows[-1]["gb"] / max(rows[-1]["sleep_s"], 1e-9), 1),
        wake_gb_per_s=round(rows[-1]["gb"] / max(rows[-1]["wake_s"], 1e-9), 1),
    )


def check_roles(steps: int = 4, new_tokens: int = 128) -> None:
    """Issue #14's colocated GPU roles, in one process (no Ray there): the policy trainer (DeepSpeed
    ZeRO 0, fp32 weights, bf16 autocast), a bf16 rollout and a bf16 reference on one GPU, taking
    turns as synchronous GRPO does with `gpus` set: sync (bf16 through host shared memory), trainer
    asleep while the rollout samples 8 prompts × 8 with the CUDA-graph engine, wake, reference,
    update. Checks the replica's weights equal the trainer's rounded to bf16 after each sync and
    that sleep/wake leaves the trainer bitwise unchanged; seconds per phase; one batch with
    `rollout_engine="hf"` for comparison. Needs DeepSpeed (carried as a wheel there)."""
    import tempfile

    from transformers import AutoModelForCausalLM

    from raypai.alignment.losses.objectives import GRPO
    from raypai.alignment.roles.reference import Reference
    from raypai.alignment.roles.rollout import Rollout
    from raypai.alignment.roles.trainer import Trainer
    from raypai.alignment.tasks.tiny import build_tiny_model

    folder = build_tiny_model(Path(tempfile.mkdtemp()) / "m", family="qwen2")  # a ChatML tokenizer
    big = _qwen2_half_b()
    tok_cfg = AutoModelForCausalLM.from_pretrained(folder).config
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(big.config, k, getattr(tok_cfg, k, None))
    big.save_pretrained(folder)
    del big
    policy = Trainer(folder, 1e-6, device="cuda", sync_dtype="bfloat16")
    objective = GRPO(group_size=8, aggregation="dapo", max_new_tokens=new_tokens)
    rollout = Rollout(folder, device="cuda")
    reference = Reference(folder, device="cuda")
    prompts = [f"{a}+{b}=" for a, b in zip(range(10, 18), range(30, 38))]
    rows, exact_sync, exact_wake = [], True, True

    def timed(fn):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        return out, time.perf_counter() - t0

    for _ in range(steps):
        r = {}
        _, r["sync_s"] = timed(lambda: rollout.load_shared(policy.write_shared()))
        trainer = {k: v.to(torch.bfloat16) for k, v in policy.engine.module.state_dict().items()}
        exact_sync &= all(torch.equal(v, trainer[k]) for k, v in rollout.model.state_dict().items())
        before = {k: v.clone() for k, v in policy.engine.module.state_dict().items()}
        resident = torch.cuda.memory_allocated()
        off, r["sleep_s"] = timed(policy.sleep)
        r["freed_gb"] = round((resident - torch.cuda.memory_allocated()) / 1e9, 2)
        out, r["rollout_s"] = timed(lambda: rollout.generate(prompts, n=8, max_new_tokens=new_tokens))
        _, r["wake_s"] = timed(policy.wake)
        exact_wake &= all(torch.equal(v, before[k]) for k, v in policy.engine.module.state_dict().items())
        ref, r["reference_s"] = timed(lambda: reference.logprobs(out["batch"]))
        adv = torch.randn(64)
        m, r["train_s"] = timed(
            lambda: policy.update(objective, {"seq": out["batch"], "advantages": adv, "old_lp": None, "ref_lp": ref})
        )
        r["tokens"] = int(out["batch"]["response_mask"].sum())
        r["grad_norm"] = round(m["grad_norm"], 4)
        r["offload_gb"] = round(off["offload_bytes"] / 1e9, 2)
        rows.append({k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()})
    steady = rows[1:]
    med = {
        k: sorted(x[k] for x in steady)[len(steady) // 2]
        for k in ("sync_s", "sleep_s", "rollout_s", "wake_s", "reference_s", "train_s")
    }
    step_s = sum(med.values())
    hf = Rollout(folder, device="cuda", engine="hf")
    hf.load_shared(policy.write_shared())
    hf.generate(prompts[:1], n=2, max_new_tokens=4)  # warm-up
    out, hf_s = timed(lambda: hf.generate(prompts, n=8, max_new_tokens=new_tokens))
    emit(
        check="colocated_gpu_roles_grpo_qwen2_0.5b",
        ok=exact_sync and exact_wake and all(math.isfinite(x["grad_norm"]) for x in rows),
        steps=steps,
        rows_per_step=64,
        replica_equals_trainer_in_bf16_after_every_sync=exact_sync,
        trainer_bitwise_equal_after_every_wake=exact_wake,
        steady_median_s=med,
        step_s=round(step_s, 3),
        samples_per_s=round(64 / step_s, 1),
        generated_tokens_per_s=round(steady[-1]["tokens"] / med["rollout_s"]),
        hf_engine_rollout_s=round(hf_s, 3),
        hf_engine_tokens_per_s=round(int(out["batch"]["response_mask"].sum()) / hf_s),
        per_step=rows,
        peak_memory_gb=round(torch.cuda.max_memory_allocated() / 2**30, 2),
    )


def main() -> int:
    if not torch.cuda.is_available():
        emit(check="cuda_available", ok=False, reason="no CUDA device: run this on a GPU machine")
        return 1
    emit(
        check="device",
        ok=True,
        name=torch.cuda.get_device_name(0),
        torch=torch.__version__,
        transformers=__import__("transformers").__version__,
    )
    checks = (
        check_losses,
        check_training,
        check_serving,
        check_rollout,
        check_attention,
        check_update,
        check_roles,
        check_lora,
    )
    if len(sys.argv) > 1:
        checks = tuple(fn for fn in checks if fn.__name__ == f"check_{sys.argv[1]}")
    for fn in checks:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - one failing check must not hide the others
            emit(check=fn.__name__, ok=False, error=f"{type(exc).__name__}: {exc}"[:800])
    return 0 if all(r["ok"] for r in RESULTS) else 1


if __name__ == "__main__":
    sys.exit(main())
