"""The cleaning library runs on the Ray its caller started or joined; it never starts one itself
(which Ray, with which resources, is the entry point's decision: raypai.runtime)."""

import pytest
import ray

from raypai.data import IngestConfig, clean, ingest, synth
from raypai.errors import DataError


def test_clean_without_a_connected_ray_refuses_and_writes_nothing(tmp_path):
    if ray.is_initialized():  # this file's own process state: another module's Ray must not leak in
        ray.shutdown()
    synth(tmp_path / "raw", docs=40, files=1, seed=0)
    ingest(tmp_path / "raw", tmp_path / "ingested", IngestConfig(text_mode="paragraphs"))
    with pytest.raises(
        DataError, match=r"none is connected in this process: call raypai.runtime.ensure_ray\(Settings.load\(\)\) first"
    ):
        clean(tmp_path / "ingested", tmp_path / "cleaned", work_dir=tmp_path / "work")
    assert not ray.is_initialized()  # it did not start one
    assert not (tmp_path / "cleaned").exists() and not (tmp_path / "work").exists()  # nothing half-written
