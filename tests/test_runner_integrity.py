"""A committed artifact whose files were cut short (a crash before the data reached the disk, a disk
that lost blocks) is never served as a cache hit: the runner's size check on every hit names the
file, the step runs again, and its save replaces the damaged copy. On real Ray with the embedded
stores (SQLite, local artifact folder)."""

from pathlib import Path

from raypai import Runner
from raypai.pipelines.toy import toy
from raypai.store import MetadataStore


def test_a_truncated_output_is_no_cache_hit_and_show_names_the_file(raypai_home):
    first = Runner(raypai_home).run(toy.build(n=6))
    text = first["write_text"].output()
    f = Path(text.uri) / "text.txt"
    size = f.stat().st_size
    same = Runner(raypai_home).run(toy.build(n=6))
    assert [s.state for s in same.steps.values()] == ["cached"] * 3  # negative: whole outputs are hits

    with open(f, "r+b") as fh:
        fh.truncate(size // 2)
    events: list[dict] = []
    again = Runner(raypai_home, progress=events.append).run(toy.build(n=6))
    states = {n: s.state for n, s in again.steps.items()}
    # write_text runs again; its save of the same content replaces the damaged copy, so the steps
    # after it (same input digest, whole outputs) are still hits
    assert states == {"write_text": "succeeded", "transform": "cached", "count": "cached"}, states
    assert f.stat().st_size == size and again.result.digest == first.result.digest
    reason = MetadataStore(raypai_home.database_url).get_step_run(again["write_text"].step_run_id)["cache_reason"]
    assert f"text.txt is {size // 2} bytes, {size} were recorded" in reason, reason
    assert reason.startswith("cache miss:"), reason
    damaged = [e for e in events if e["event"] == "artifact_damaged"]  # said while the run goes, too
    assert [e["node"] for e in damaged] == ["write_text"] and damaged[0]["reason"] == reason
