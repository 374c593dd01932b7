"""sleep/wake of a model and its optimizer (alignment/offload.py) on tiny real transformers models.

Each round trip runs with the model on the CPU (where sleeping to the CPU must leave every tensor in
place) and on CUDA (where every tensor must leave the device and come back bitwise equal)."""

import pytest
import torch
import transformers

from raypai.alignment.offload import sleep
from raypai.errors import TrainError

CUDA = pytest.param(
    "cuda",
    marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(
            not torch.cuda.is_available(),
            reason="needs a CUDA device (these passed on an H200; benchmarks/gpu_check.py times sleep/wake on one)",
        ),
    ],
)
DEVICES = ["cpu", CUDA]


def _llama(device: str = "cpu", seed: int = 0):
    cfg = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _gpt2(device: str = "cpu"):
    cfg = transformers.GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=4)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model, opt, steps: int, seed: int = 1) -> None:
    """`steps` AdamW steps on fixed random tokens; the last step's gradients are left in place."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, 128, (2, 8), generator=g).to(model.device)
        opt.zero_grad()
        model(ids, labels=ids).loss.backward()
        opt.step()


def _tensors(model, opt) -> dict[str, torch.Tensor]:
    """Every tensor sleep must move, by name, computed here without the module's own walk."""
    out = {f"param:{n}": p for n, p in model.named_parameters()}
    out |= {f"grad:{n}": p.grad for n, p in model.named_parameters() if p.grad is not None}
    out |= {f"buffer:{n}": b for n, b in model.named_buffers()}
    names = {id(p): n for n, p in model.named_parameters()}
    out |= {f"state:{names[id(p)]}:{k}": v for p, s in opt.state.items() for k, v in s.items()}
    return out


def _expected_bytes(model, opt, to: str = "cpu") -> int:
    """Bytes of the distinct tensors not already on `to` (a tied weight counts once)."""
    distinct = {id(t): t for t in _tensors(model, opt).values()}.values()
    return sum(t.numel() * t.element_size() for t in distinct if t.device.type != to)


@pytest.mark.parametrize("device", DEVICES)
def test_round_trip_is_bitwise_and_keeps_every_object(device):
    """After 3 AdamW steps every parameter, gradient, buffer and optimizer state tensor sleeps on the CPU
    (or stays there) and wakes on its own device with the same bytes, the same Parameter objects and the
    same optimizer state keys; AdamW's CPU `step` counter is neither moved nor counted."""
    model, opt = _llama(device)
    _train(model, opt, 3)
    before = {k: (t, t.device, t.cpu().clone()) for k, t in _tensors(model, opt).items()}
    assert any(k.startswith("grad:") for k in before) and any(k.endswith(":exp_avg_sq") for k in before)
    params, state_keys = list(model.parameters()), list(opt.state)
    expected = _expected_bytes(model, opt)
    if device == "cuda":
        torch.cuda.empty_cache()
        allocated = torch.cuda.memory_allocated()

    slept = sleep(model, opt)

    assert slept.bytes == expected and slept.seconds > 0
    assert all(t.device.type == "cpu" for t in _tensors(model, opt).values())
    if device == "cuda":
        assert expected > 0 and allocated - torch.cuda.memory_allocated() >= expected
        assert all(t.is_pinned() for t, dev, _ in before.values() if dev.type == "cuda")

    assert slept.wake() >= 0

    after = _tensors(model, opt)
    assert after.keys() == before.keys()
    for k, (t, dev, value) in before.items():
        assert after[k] is t and t.device == dev and torch.equal(t.cpu(), value), k
    assert list(model.parameters()) == params and all(a is b for a, b in zip(opt.state, state_keys))
    if device == "cuda":
        assert torch.cuda.memory_allocated() == allocated


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA device (these passed on an H200; benchmarks/gpu_check.py times sleep/wake on one)",
)
def test_sleep_hands_the_memory_back_to_the_device():
    """The freed blocks leave torch's cache too, so that another process (the colocated rollout engine)
    can take them: torch's reserved memory falls by most of the 64 MiB moved (a 16 MiB weight, its
    gradient and AdamW's two moments; one may share a segment with a block still in use elsewhere)."""
    model = torch.nn.Linear(2048, 2048, bias=False, device="cuda")  # (2048, 2048) fp32: 16 MiB
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 2048, device="cuda")).sum().backward()
    opt.step()
    torch.cuda.empty_cache()
    reserved = torch.cuda.memory_reserved()
    slept = sleep(model, opt)
    assert slept.bytes == 4 * 2**24 and reserved - torch.cuda.memory_reserved() >= slept.bytes // 2
    slept.wake()


def test_a_model_on_the_cpu_stays_in_place():
    """Sleeping a CPU model to the CPU moves nothing: the same storages (a CPU role's weights may live in
    shared memory that a replica reads) and 0 bytes."""
    model, opt = _llama()
    _train(model, opt, 1)
    ptrs = {k: t.data_ptr() for k, t in _tensors(model, opt).items()}
    slept = sleep(model, opt)
    assert slept.bytes == 0 and {k: t.data_ptr() for k, t in _tensors(model, opt).items()} == ptrs
    slept.wake()
    assert {k: t.data_ptr() for k, t in _tensors(model, opt).items()} == ptrs


@pytest.mark.parametrize("device", DEVICES)
def test_training_after_a_sleep_matches_training_without_one(device):
    """Two copies from one seed: 3 steps, a sleep and wake for one of them, 3 more steps; the parameters
    end bitwise equal (the optimizer's moments and step count came back intact)."""
    (a, opt_a), (b, opt_b) = _llama(device), _llama(device)
    _train(a, opt_a, 3)
    _train(b, opt_b, 3)
    sleep(b, opt_b).wake()
    _train(a, opt_a, 3, seed=2)
    _train(b, opt_b, 3, seed=2)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name


@pytest.mark.parametrize("device", DEVICES)
def test_tied_weights_move_once_and_stay_tied(device):
    """GPT-2's lm_head and wte share one tensor: it is counted once and is still shared, by object and by
    storage, asleep and awake."""
    model, opt = _gpt2(device)
    _train(model, opt, 1)
    assert model.lm_head.weight is model.transformer.wte.weight
    expected = _expected_bytes(model, opt)
    slept = sleep(model, opt)
    assert slept.bytes == expected
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    slept.wake()
    assert model.lm_head.weight is model.transformer.wte.weight
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    assert model.lm_head.weight.device.type == device


@pytest.mark.parametrize("device", DEVICES)
def test_views_of_one_storage_share_it_again_after_wake(device):
    """Two parameters that are views of one flat buffer (as DeepSpeed's and sync.py's flat buffers make
    them) move as one storage and are views of one storage again after wake."""
    flat = torch.arange(10, dtype=torch.float32, device=device)
    model = torch.nn.Module()
    model.a, model.b = torch.nn.Parameter(flat[:4]), torch.nn.Parameter(flat[4:].view(2, 3))
    slept = sleep(model)
    assert slept.bytes == (40 if device == "cuda" else 0)
    slept.wake()
    assert model.a.untyped_storage().data_ptr() == model.b.untyped_storage().data_ptr()
    assert model.b.storage_offset() == 4 and model.a.device.type == device
    model.b.data[0, 0] = -1.0  # a write through one view shows in the shared storage
    assert torch.equal(
        torch.empty(0, device=device).set_(model.a.untyped_storage()),
        torch.tensor([0, 1, 2, 3, -1, 5, 6, 7, 8, 9], dtype=torch.float32, device=device),
    )


def test_sleeping_twice_or_waking_twice_names_the_model_and_the_fix():
    model, opt = _llama()
    slept = sleep(model, opt)
    with pytest.raises(TrainError, match=r"LlamaForCausalLM is already asleep .*call wake\(\)"):
        sleep(model, opt)
    slept.wake()
    with pytest.raises(TrainError, match=r"LlamaForCausalLM was already woken .*sleep the model again"):
        slept.wake()
    again = sleep(model, opt)  # awake again: a new sleep is fine, and the old Slept stays spent
    with pytest.raises(TrainError, match="already woken"):
        slept.wake()
    again.wake()


def test_an_asleep_model_refuses_a_forward_pass_and_its_optimizer_a_step():
    model, opt = _llama()
    ids = torch.zeros(1, 4, dtype=torch.long)
    slept = sleep(model, opt)
    with pytest.raises(TrainError, match=r"LlamaForCausalLM is asleep .*call wake\(\) .*before this role's next"):
        model(ids)
    with pytest.raises(TrainError, match="is asleep"):
        opt.step()
    slept.wake()
    model(ids, labels=ids).loss.backward()
    opt.step()


@pytest.mark.parametrize("device", DEVICES)
def test_an_optimizer_wrapped_as_dot_optimizer_is_reached(device):
    """A wrapper exposing the torch optimizer as `.optimizer` (DeepSpeed's engine.optimizer may) has its
    state moved and its step refused while asleep; an object with no optimizer state is refused."""
    model, opt = _llama(device)
    _train(model, opt, 1)
    wrapper = type("Wrapper", (), {})()
    wrapper.optimizer = opt
    expected = _expected_bytes(model, opt)
    slept = sleep(model, wrapper)
    assert slept.bytes == expected
    assert all(v.device.type == "cpu" for s in opt.state.values() for v in s.values())
    with pytest.raises(TrainError, match="is asleep"):
        opt.step()
    slept.wake()
    assert all(s["exp_avg"].device.type == device for s in opt.state.values())
    with pytest.raises(TrainError, match=r"Wrapper has neither a `.state` dict nor `.optimizer.state`"):
        sleep(model, type("Wrapper", (), {})())


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA device (these passed on an H200; benchmarks/gpu_check.py times sleep/wake on one)",
)
def test_pinned_host_buffers_are_reused_by_the_next_sleep():
    """The second sleep copies into the pages the first one pinned; pin=False copies into fresh, unpinned
    memory and keeps nothing."""
    model, opt = _llama("cuda")
    _train(model, opt, 1)
    weight = model.model.embed_tokens.weight
    slept = sleep(model, opt)
    first = weight.data_ptr()
    assert weight.is_pinned() and opt.state[weight]["exp_avg"].is_pinned()
    slept.wake()
    slept = sleep(model, opt)
    assert weight.data_ptr() == first and weight.is_pinned()
    slept.wake()

    plain, plain_opt = _llama("cuda")
    _train(plain, plain_opt, 1)
    slept = sleep(plain, plain_opt, pin=False)
    assert not plain.model.embed_tokens.weight.is_pinned() and not getattr(plain, "_raypai_host_buffers", None)
    slept.wake()
    with pytest.raises(TrainError, match="pin=True.*must be 'cpu'"):
        sleep(plain, plain_opt, to="cuda", pin=True)
