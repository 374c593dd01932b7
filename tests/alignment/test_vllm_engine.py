"""The optional vLLM rollout engine (`rollout_engine="vllm"`, `raypai.alignment.roles._vllm`) with a real
vLLM: its CPU build, in its own environment (`make test-vllm`), because vLLM pins transformers, fastapi
and numpy below this project's venv. In the main suite vLLM is absent and this module is skipped;
the engine's install error is tested there (tests/alignment/test_config.py). Under `make test-vllm`
(RAYPAI_REQUIRE_VLLM=1) a vLLM that does not import fails the module instead: a broken install must
not pass with no test run."""

import os

import pytest
import torch

try:
    import vllm  # noqa: F401

    NO_VLLM = None
except Exception as exc:  # noqa: BLE001 - a broken install raises more than ImportError (a missing .so, an ABI clash)
    NO_VLLM = f"{type(exc).__name__}: {exc}"
if NO_VLLM and os.environ.get("RAYPAI_REQUIRE_VLLM") == "1":
    pytest.fail(f"RAYPAI_REQUIRE_VLLM=1 (make test-vllm) but vLLM does not import: {NO_VLLM}", pytrace=False)
if NO_VLLM:
    pytest.skip(
        f"vLLM does not import here ({NO_VLLM}): `make test-vllm` runs these with vLLM's CPU build",
        allow_module_level=True,
    )

from raypai.alignment._tensors import token_logprobs  # noqa: E402
from raypai.alignment.roles.rollout import Rollout  # noqa: E402
from raypai.alignment.sync import SharedWeights  # noqa: E402
from raypai.alignment.tasks.tiny import build_tiny_model  # noqa: E402
from raypai.chat import ChatFormat  # noqa: E402

# vLLM's CPU attention takes head sizes of 32 and up (the tiny models' default is 16)
SHAPE = {"hidden": 64, "heads": 2, "kv_heads": 1}
PROMPTS = ["1+2=", "13+27=", "a much longer prompt: 40+41=", "7+7="]


@pytest.fixture(scope="module", params=["llama3", "qwen2", "gpt2"])
def family(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = build_tiny_model(tmp_path_factory.mktemp(request.param) / "m", family=request.param, **SHAPE)
    rollout = Rollout(path, engine="vllm", seed=0)
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    return rollout, hf, ChatFormat.from_pretrained(path)


def _hf_greedy(hf, fmt, max_new: int) -> list[list[int]]:
    stops, out = list(fmt.stop_ids), []
    for p in PROMPTS:  # one prompt at a time: no padding on HF's side
        ids = fmt.prompt_ids(p)
        ref = hf.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=max_new,
            do_sample=False,
            eos_token_id=stops,
            pad_token_id=fmt.tok.pad_token_id,
        )[0, len(ids) :].tolist()
        cut = next((j for j, t in enumerate(ref) if t in stops), None)
        out.append(ref if cut is None else ref[: cut + 1])
    return out


def _completions(out) -> list[list[int]]:
    return [s[m.index(1) :] if 1 in m else [] for s, m in zip(out["seqs"], out["masks"])]


def _logprobs_under(hf, out) -> torch.Tensor:
    b = out["batch"]
    with torch.no_grad():
        return token_logprobs(hf, b["input_ids"], b["attention_mask"], where=b["response_mask"])


def test_greedy_completions_are_those_of_hf_generate(family):
    rollout, hf, fmt = family
    out = rollout.generate(PROMPTS, n=1, max_new_tokens=12, temperature=0)
    assert _completions(out) == _hf_greedy(hf, fmt, 12)


def test_samples_carry_the_models_logprobs_end_at_stop_tokens_and_follow_the_seed(family):
    rollout, hf, fmt = family
    # a model this small rarely emits its stop token: stop on two frequent tokens as well
    frequent = torch.topk(hf(torch.tensor([fmt.prompt_ids(PROMPTS[0])])).logits[0, -1], 2).indices.tolist()
    stop = tuple(fmt.tok.convert_ids_to_tokens(frequent))
    torch.manual_seed(5)
    out = rollout.generate(PROMPTS, n=4, max_new_tokens=10, stop=stop, logprobs=True)
    comps = _completions(out)
    stops = set(frequent) | set(fmt.stop_ids)
    ended = [c for c in comps if c and c[-1] in stops]
    assert 0 < len(ended) < len(comps)  # some rows stopped (the stop token kept), others ran to the limit
    assert out["stopped_fraction"] == len(ended) / len(comps)
    assert all(t not in stops for c in comps for t in c[:-1]) and all(1 <= len(c) <= 10 for c in comps)
    assert len({tuple(c) for c in comps[:4]}) > 1  # the n samples of a prompt are separate draws
    mask = out["batch"]["response_mask"].bool()
    torch.testing.assert_close(out["logprobs"][mask], _logprobs_under(hf, out)[mask], atol=1e-4, rtol=0)
    torch.manual_seed(5)  # the rollout's generator state (checkpointed) fixes the samples
    assert _completions(rollout.generate(PROMPTS, n=4, max_new_tokens=10, stop=stop, logprobs=True)) == comps


def test_weights_pushed_after_an_update_are_the_ones_sampled_with(family, tmp_path):
    rollout, hf, fmt = family
    with torch.no_grad():  # a trainer's update: every weight moves
        g = torch.Generator().manual_seed(0)
        for p in hf.parameters():
            p.mul_(0.5).add_(0.05 * torch.randn(p.shape, generator=g))
    state = hf.state_dict()
    assert _completions(rollout.generate(PROMPTS, n=1, max_new_tokens=12, temperature=0)) != _hf_greedy(hf, fmt, 12)
    assert rollout.load_weights(state, version=3) > 0  # through the object store's path (a state dict)
    out = rollout.generate(PROMPTS, n=1, max_new_tokens=12, temperature=0, logprobs=True)
    assert _completions(out) == _hf_greedy(hf, fmt, 12) and out["weights_version"] == 3
    mask = out["batch"]["response_mask"].bool()
    torch.testing.assert_close(out["logprobs"][mask], _logprobs_under(hf, out)[mask], atol=1e-4, rtol=0)

    # through shared memory (a same-node trainer), version-checked, exact; a live buffer is refused
    with torch.no_grad():
        for p in hf.parameters():
            p.mul_(1.5)
    SharedWeights(tmp_path / "w.bin", hf.state_dict(), create=True).write(hf.state_dict(), 4)
    assert rollout.load_shared((str(tmp_path / "w.bin"), 4, False)) > 0
    out = rollout.generate(PROMPTS, n=1, max_new_tokens=12, temperature=0)
    assert _completions(out) == _hf_greedy(hf, fmt, 12) and out["weights_version"] == 4
    with pytest.raises(RuntimeError, match="cannot read the trainer's parameters in place"):
        rollout.load_shared((str(tmp_path / "w.bin"), 4, True))


class _Sink:
    def __init__(self):
        self.rows = []

    def log_metrics(self, metrics, step=None):
        self.rows.append((step, dict(metrics)))


def test_a_grpo_run_pushes_every_update_into_its_vllm_rollout(ray_align, tmp_path):
    """Through Ray and DeepSpeed: the trainer is not made live for a vLLM rollout, so every step's
    sync copies the update into vLLM, and the rollout samples with exactly the trainer's version."""
    from raypai.alignment import GRPOConfig, run_grpo
    from raypai.alignment.data import prompt_examples
    from raypai.alignment.tasks import arithmetic as ar

    train, held = ar.split()
    path = build_tiny_model(tmp_path / "m", **SHAPE)
    cfg = GRPOConfig(
        steps=4, prompts_per_step=2, group_size=4, lr=1e-3, max_new_tokens=4, eval_every=10**6, rollout_engine="vllm"
    )
    logger = _Sink()
    run_grpo(
        path,
        str(tmp_path / "out"),
        prompt_examples(ar.prompt_rows(train[:16])),
        prompt_examples(ar.prompt_rows(held[:4])),
        cfg,
        run_name="t-grpo-vllm",
        logger=logger,
        rewards=[(ar.exact_match_reward, 1.0)],
    )
    steps = [m for s, m in logger.rows if s is not None]
    assert len(steps) == 4
    assert all(m["sync_bytes"] > 100_000 for m in steps[1:])  # a copy per update (a live trainer sends none)
    assert [m["policy_lag_steps"] for m in steps] == [0, 0, 0, 0]  # sampled with the trainer's current weights
