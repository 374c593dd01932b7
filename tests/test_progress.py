"""The run display: raypai's step lines plus one summary line per running step (done/total, rate,
time left) instead of Ray Data's bars and the workers' log spam, which go to a log file under
RAYPAI_HOME whose path is printed; `verbose` prints the worker lines too. One local Ray for the
module (the runner's own, started with log_to_driver as the CLI does)."""

import re
import time
from pathlib import Path

from rich.console import Console

from raypai import Runner, StepContext, pipeline, step
from raypai.cli.render import Progress
from raypai.progress import Meter, Update, WorkerLogs, _DataBars, parse_progress_line

NOISE = "noisy worker line"


def _slow_double(batch):
    time.sleep(0.4)  # one block at a time (concurrency=1) for 4 s or more: Ray Data redraws its bars meanwhile
    return {"id": batch["id"] * 2}


@step(cpus=0.5, cache=False)
def rows(ctx: StepContext, n: int = 20000) -> dict:
    import ray.data

    ds = ray.data.range(n, override_num_blocks=10).map_batches(_slow_double, concurrency=1)
    return {"rows": ds.count()}


@step(cpus=0.25, cache=False)
def counted(ctx: StepContext, items: int = 12) -> dict:
    for i in range(items):
        print(NOISE, flush=True)  # the same line from every iteration: Ray's console would dedup it with a notice
        ctx.progress(i + 1, items, "items")
        time.sleep(0.25)
    return {"items": items}


@pipeline
def busy(items: int = 12):
    return {"rows": rows(), "items": counted(items=items)}


@pipeline
def chatty(items: int = 4):
    return counted(items=items)


def _display(verbose=False):
    return Progress(out=Console(width=200, force_terminal=False), verbose=verbose, every_s=600)


def test_one_summary_line_per_running_step_no_raw_bars_and_a_log_file(raypai_home, capfd):
    result = Runner(raypai_home, progress=_display()).run(busy.build())
    captured = capfd.readouterr()
    text = captured.out + captured.err
    assert result.ok, text
    # Ray Data's bars ("Running Dataset: …", "- ReadRange->…: Tasks: 1; Queued blocks: …"), raw progress
    # records, the workers' own lines and Ray's dedup notices ("[repeated 11x across cluster]")
    for raw in (
        "__ray_tqdm_magic_token__",
        "__raypai_progress__",
        "Running Dataset",
        "Tasks:",
        "Queued blocks",
        NOISE,
        "repeated",
        "pid=",
    ):
        assert raw not in text, (raw, text)

    running = [line for line in text.splitlines() if "⋯" in line]
    # every_s=600: exactly one line while running per step that reported progress
    assert len([line for line in running if " counted " in line]) == 1, running
    assert len([line for line in running if " rows " in line]) == 1, running
    assert re.search(r"⋯ counted  \d+/12 items \(\d+%\)", text), text
    assert re.search(r"⋯ rows  [\d,]+/20,000 rows \(\d+%\).* · Ray Data ", text), text
    # the step's finished line carries its last summary, with the rate
    assert re.search(r"✓ counted succeeded [\d.]+s · 12/12 items \(100%\) · [\d.]+ items/s", text), text

    log = Path(re.search(r"logs: (\S+)", text).group(1))
    assert log.is_relative_to(raypai_home.home / "logs")
    body = log.read_text()
    assert body.count(NOISE) == 12  # everything the workers printed, undeduplicated
    assert "(busy.counted pid=" in body and "(busy.rows pid=" in body
    assert "__ray_tqdm_magic_token__" not in body


def test_verbose_prints_every_worker_line(raypai_home, capfd):
    result = Runner(raypai_home, progress=_display(verbose=True)).run(chatty.build(items=4))
    captured = capfd.readouterr()
    text = captured.out + captured.err
    assert result.ok, text
    assert text.count(NOISE) == 4 and "(chatty.counted pid=" in text
    assert "__raypai_progress__" not in text and "repeated" not in text


def test_ray_print_logs_handler_is_back_after_a_run(raypai_home):
    """Outside a run (`raypai train`, notebooks) Ray prints worker output as usual."""
    from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

    Runner(raypai_home, progress=lambda e: None).run(chatty.build(items=1))
    names = [name for name, _ in dispatcher.handlers]
    assert names.count("ray_print_logs") == 1 and "raypai_worker_logs" not in names


def test_meter_rate_and_time_left():
    """50 of 100 done 10 s after 0: 5 steps/s, so 50 left take 10 s."""
    m = Meter()
    m.add(Update("train", 0, 100, "steps", t=1000.0))
    assert m.rate is None and m.summary() == "0/100 steps (0%)"
    m.add(Update("train", 50, 100, "steps", t=1010.0))
    assert m.rate == 5.0 and m.seconds_left == 10.0
    assert m.summary() == "50/100 steps (50%) · 5.0 steps/s · ~10s left"
    m.add(Update("train", note="evaluating", t=1011.0))  # a note keeps the counts
    assert m.summary() == "50/100 steps (50%) · 5.0 steps/s · ~10s left · evaluating"
    m.add(Update("train", 3, 10, "epochs", t=1012.0))  # another unit: a new phase, no stale rate
    assert m.rate is None and m.summary() == "3/10 epochs (30%)"


def test_open_ended_counts_and_long_waits_read_well():
    m = Meter()
    m.add(Update("clean", 0, None, "rows", t=0.0))
    m.add(Update("clean", 12000, None, "rows", t=4.0))
    assert m.summary() == "12,000 rows · 3,000 rows/s"
    m = Meter()
    m.add(Update("train", 0, 10000, "steps", t=0.0))
    m.add(Update("train", 10, 10000, "steps", t=2.0))
    assert m.summary().endswith("~33m18s left")


def test_ray_data_bars_become_the_last_operator_with_a_row_total():
    bars = _DataBars()
    dataset = {"uuid": "d", "pos": 0, "x": 0, "total": None, "desc": "Running Dataset: ds_1", "unit": " row"}
    read = {
        "uuid": "r",
        "pos": 1,
        "x": 9000,
        "total": 20000,
        "desc": "- ReadRange->MapBatches(_double): Tasks: 2",
        "unit": " row",
    }
    count = {"uuid": "c", "pos": 2, "x": 0, "total": 1, "desc": "- AggregateNumRows: Tasks: 0", "unit": " row"}
    assert bars.update("rows", dataset) is None  # no total: nothing to show yet
    bars.update("rows", read)
    u = bars.update("rows", count)  # total 1: an aggregate, not the rows flowing through
    assert (u.done, u.total, u.unit, u.note) == (9000, 20000, "rows", "Ray Data ReadRange->MapBatches(_double)")
    done = bars.update("rows", {**read, "x": 20000, "closed": True})  # the last count shows once
    assert (done.done, done.total) == (20000, 20000)
    assert bars.update("rows", {**count, "x": 1, "closed": True}) is None


def test_progress_lines_parse_back_and_other_lines_do_not(capsys):
    from raypai.progress import StepProgress

    report = StepProgress("train", min_interval_s=60)
    report(1, 10, "steps")
    report(2, 10, "steps")  # within min_interval_s: dropped
    report(10, 10, "steps")  # the last one always goes
    report("saving")  # notes always go
    lines = capsys.readouterr().out.splitlines()
    assert [(u.done, u.note) for u in map(parse_progress_line, lines)] == [(1, None), (10, None), (None, "saving")]
    assert parse_progress_line("step 1/10 loss 3.2") is None


def test_a_note_does_not_hold_back_the_first_count_after_it(capsys):
    """A step that says what it starts, then reports its starting count at once (clean: "8 to
    filter", then 0/38,820 rows): the count is the start the line's rate is measured from, so it
    must not be dropped as too soon after the note (it was, and the rate came out ~20x too high)."""
    from raypai.progress import StepProgress

    report = StepProgress("clean", min_interval_s=60)
    report("8 shards to filter")
    report(0, 100, "rows")
    report(5, 100, "rows")  # within min_interval_s of the last count: dropped
    lines = capsys.readouterr().out.splitlines()
    assert [(u.done, u.note) for u in map(parse_progress_line, lines)] == [(None, "8 shards to filter"), (0, None)]


def test_an_alignment_loop_that_finished_ends_its_line_at_its_total(capsys):
    """The alignment loops log metrics every few steps and their summary once, after the last step:
    the step's line must end at total/total (it ended at the last logged step, 580/600 ~3s left)."""
    from raypai.alignment.steps import _StepLogger
    from raypai.progress import StepProgress

    class Ctx:  # what _StepLogger reads of a StepContext: no MLflow logger here, the step's reporter
        logger = None

        def progress_reporter(self):
            return StepProgress("sft", min_interval_s=0)

    log = _StepLogger(Ctx(), total=600)
    log.log_metrics({"sft/loss": 1.0}, step=580)
    log.log_metrics({"eval_loss": 0.5})  # the summary, after the loop
    lines = capsys.readouterr().out.splitlines()
    assert [(u.done, u.total) for u in map(parse_progress_line, lines)] == [(580, 600), (600, 600)]


def test_worker_logs_route_lines_to_the_file_and_progress_to_events(tmp_path):
    logs = WorkerLogs(tmp_path / "run.log", "p")
    logs._file = open(logs.path, "a")  # as __enter__ does, without Ray
    progress = "__raypai_progress__ " + '{"node": "s", "done": 3, "total": 4, "unit": "items"}'
    logs({"pid": "11", "task_name": "p.s", "actor_name": "", "is_err": False, "lines": ["hello", progress]})
    logs({"pid": "autoscaler", "lines": ["=== Autoscaler status ==="]})
    logs._file.close()
    events = logs.drain()
    assert [e["event"] for e in events] == ["worker_log", "step_progress"]
    assert events[1]["update"].done == 3 and events[0]["line"] == "(p.s pid=11) hello"
    body = (tmp_path / "run.log").read_text()
    assert "(p.s pid=11) hello" in body and "Autoscaler" not in body and progress not in body
