"""CPU tensors between raypai's role processes travel as numpy arrays (raypai.alignment._wire):
dtype, shape and values arrive as sent, read-only arrays become writable tensors, and tensors the
arrays cannot carry exactly go torch's own way."""

import pickle

import pytest
import ray
import torch

from raypai.alignment._wire import from_wire, install, to_wire


@pytest.mark.parametrize(
    "t",
    [
        torch.randn(3, 4),
        torch.arange(6).view(2, 3).t(),
        torch.tensor(2.5),
        torch.randn(5).to(torch.bfloat16),
        torch.ones(3, dtype=torch.bool),
        torch.randint(0, 9, (4,), dtype=torch.int32),
        torch.randn(4, 2)[:, 1],
    ],
)
def test_a_tensor_arrives_as_it_was_sent(t):
    wire = to_wire(t)
    assert wire[0] == "array"
    back = from_wire(pickle.loads(pickle.dumps(wire, protocol=5)))
    assert back.dtype == t.dtype and back.shape == t.shape and torch.equal(back, t)
    back.zero_()  # memory of its own, writable


def test_read_only_arrays_become_writable_tensors():
    wire = to_wire(torch.arange(4.0))
    wire[1].setflags(write=False)
    back = from_wire(wire)
    back[0] = 7.0
    assert back.tolist() == [7.0, 1.0, 2.0, 3.0]


def test_tensors_arrays_cannot_carry_go_torchs_way():
    grad, conj, fp8 = (
        torch.randn(3, requires_grad=True),
        torch.randn(2, dtype=torch.complex64).conj(),
        torch.randn(3).to(torch.float8_e4m3fn),
    )
    for t, same in (
        (grad, lambda a, b: torch.equal(a.detach(), b.detach()) and a.requires_grad),
        (conj, lambda a, b: torch.equal(a.resolve_conj(), b.resolve_conj())),
        (fp8, lambda a, b: torch.equal(a.view(torch.uint8), b.view(torch.uint8))),
    ):
        wire = to_wire(t)
        assert wire[0] == "torch"
        back = from_wire(pickle.loads(pickle.dumps(wire)))
        assert back.dtype == t.dtype and same(back, t)


@ray.remote(num_cpus=0.1)
class _Echo:
    def install(self):
        install()

    def echo(self, batch):
        for k, v in batch.items():
            if k != "view":
                v.mul_(2)  # what arrived is writable here
        return batch


def test_tensors_cross_ray_both_ways_with_the_wire_installed(ray_plain):
    install()
    echo = _Echo.remote()
    ray.get(echo.install.remote())
    base = torch.arange(6.0)
    batch = {
        "ids": torch.arange(6).view(2, 3),
        "lp": torch.randn(2, 3),
        "w": torch.randn(4).to(torch.bfloat16),
        "big": torch.randn(256, 1024),  # 1 MiB: Ray hands it over from its object store
        "base": base,
        "view": base[:3],
    }
    out = ray.get(echo.echo.remote(batch))
    for k in ("ids", "lp", "w", "big", "base"):
        assert out[k].dtype == batch[k].dtype and torch.equal(out[k], batch[k] * 2), k
    # the wire sends each tensor on its own: a view arrives as a copy (torch's pickling would have
    # shared the storage, and doubled it with its base)
    assert out["view"].tolist() == [0.0, 1.0, 2.0]
    out["big"].add_(1)  # writable on this side too
