"""Checkpoints are read without running code from them (raypai.checkpoint_io): DeepSpeed's files with
`weights_only=True` and an allow-list, raypai's own state as JSON + npz."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from raypai.checkpoint_io import CheckpointError, read_state, write_state


class _Payload:
    """Unpickling this object creates the file `marker` (what a planted checkpoint file would do)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_state_round_trips_tuples_tensors_and_arrays_without_pickle(tmp_path):
    rng = random.Random(7)
    rng.random()
    state = {
        "step": 12,
        "rng": rng.getstate(),
        "rollout_rng": [torch.get_rng_state(), [torch.get_rng_state(), torch.arange(3)]],
        "numpy": np.random.RandomState(3).get_state(),
        "extra": {"before": {"reward": 0.25, "n": np.int64(4)}, "names": ["a", None]},
    }
    write_state(tmp_path, state)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["raypai_state.json", "raypai_state.npz"]
    back = read_state(tmp_path)
    again = random.Random()
    again.setstate(back["rng"])
    assert again.random() == rng.random()  # the data position: the same next draw
    assert torch.equal(back["rollout_rng"][0], state["rollout_rng"][0])
    assert torch.equal(back["rollout_rng"][1][1], torch.arange(3))
    np_rng = np.random.RandomState()
    np_rng.set_state(back["numpy"])
    assert np_rng.random_sample() == np.random.RandomState(3).random_sample()
    assert back["extra"] == {"before": {"reward": 0.25, "n": 4}, "names": ["a", None]}
    assert read_state(tmp_path / "nothing-here") is None


def test_state_that_is_not_plain_data_is_refused_when_saved(tmp_path):
    with pytest.raises(TypeError, match="_Payload"):
        write_state(tmp_path, {"x": _Payload(str(tmp_path / "m"))})
    assert not (tmp_path / "raypai_state.json").exists()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from raypai.alignment.tasks.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("m") / "m", family="llama3")


def _batch():
    from raypai.alignment._tensors import pad

    seqs = [list(range(3, 12)), list(range(5, 11))]
    return pad(seqs, [[0] * 4 + [1] * (len(s) - 4) for s in seqs], 0)


@pytest.mark.parametrize("stage", [1, 3])
def test_a_trainer_resumes_from_its_checkpoint_read_weights_only(model_dir, tmp_path, stage):
    """ZeRO-1 holds DeepSpeed's optimizer types (the allow-list), ZeRO-3 the partitioned layout."""
    from raypai.alignment.losses.objectives import SFT
    from raypai.alignment.roles.trainer import Trainer

    t = Trainer(model_dir, 1e-2, zero_stage=stage, seed=0)
    t.update_on(SFT(), _batch())
    t.save_checkpoint(str(tmp_path), "step-000001", {"step": 1, "rng": random.Random(1).getstate()})
    expected = t.update_on(SFT(), _batch())["loss"]

    fresh = Trainer(model_dir, 1e-2, zero_stage=stage, seed=0)
    state = fresh.load_checkpoint(str(tmp_path))
    assert state["step"] == 1 and state["rng"] == random.Random(1).getstate()
    assert fresh.update_on(SFT(), _batch())["loss"] == pytest.approx(expected, rel=1e-6)
    # nothing of raypai's own state went into DeepSpeed's pickles
    files = list((tmp_path / "step-000001").iterdir())
    assert any(f.name == "raypai_state.json" for f in files)


def test_a_planted_pickle_in_a_checkpoint_is_refused_and_never_run(model_dir, tmp_path):
    from raypai.alignment.losses.objectives import SFT
    from raypai.alignment.roles.trainer import Trainer

    t = Trainer(model_dir, 1e-2, zero_stage=0, seed=0)
    t.update_on(SFT(), _batch())
    t.save_checkpoint(str(tmp_path), "step-000001", {"step": 1})
    states = tmp_path / "step-000001" / "mp_rank_00_model_states.pt"
    sd = torch.load(states, weights_only=False)
    marker = tmp_path / "code-ran"
    sd["planted"] = _Payload(str(marker))
    torch.save(sd, states)

    fresh = Trainer(model_dir, 1e-2, zero_stage=0, seed=0)
    with pytest.raises(CheckpointError, match="mp_rank_00_model_states.pt") as err:
        fresh.load_checkpoint(str(tmp_path))
    assert "without running code" in str(err.value)
    assert not marker.exists()
