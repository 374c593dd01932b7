"""Step progress and worker logs: how a running step tells the driver how far it is, and where
the rest of what Ray's workers print goes.

A step calls `ctx.progress(done, total, unit)` (or hands `ctx.progress_reporter()` to the Ray
Train workers or actors it starts). The reporter prints one tagged line on its stdout; Ray's log
stream carries it to the driver like any worker output (as it does for Ray Data's progress bars,
whose `tqdm_ray` lines are read the same way). On the driver, `WorkerLogs` takes Ray's place on
that stream for the length of a run: every line goes to a log file under RAYPAI_HOME, progress
lines become `Update`s the runner hands to its display, and nothing else reaches the console
unless the display asks for it (`--verbose`).
"""

from __future__ import annotations

import json
import queue
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

__all__ = ["MAGIC", "StepProgress", "Update", "Meter", "WorkerLogs", "parse_progress_line"]

MAGIC = "__raypai_progress__ "
_TQDM_MAGIC = "__ray_tqdm_magic_token__"  # ray.experimental.tqdm_ray.RAY_TQDM_MAGIC


@dataclass(frozen=True)
class Update:
    """How far one step is: `done` of `total` `unit`s (total None: open-ended), or a note."""

    node: str
    done: float | None = None
    total: float | None = None
    unit: str = "steps"
    note: str | None = None
    t: float = field(default_factory=time.time)


@dataclass
class StepProgress:
    """A step's progress reporter; picklable, so Ray Train workers and actors can report for it.
    Prints at most one count per `min_interval_s` (always the first, the last and notes; a note
    does not count against the interval, so a count right after it still goes)."""

    node: str
    min_interval_s: float = 1.0
    _last: float = 0.0  # when the last count was printed

    def __call__(
        self,
        done: float | str | None = None,
        total: float | None = None,
        unit: str = "steps",
        *,
        note: str | None = None,
    ) -> None:
        if isinstance(done, str):  # ctx.progress("a message"): a note, no count
            note, done = done, None
        now = time.time()
        final = done is not None and total is not None and done >= total
        if note is None and not final and self._last and now - self._last < self.min_interval_s:
            return
        if done is not None:
            self._last = now
        print(MAGIC + json.dumps(asdict(Update(self.node, done, total, unit, note, now))), flush=True)


def parse_progress_line(line: str) -> Update | None:
    """The Update in a reporter's line, None for any other line."""
    if not line.startswith(MAGIC):
        return None
    try:
        return Update(**json.loads(line[len(MAGIC) :]))
    except (ValueError, TypeError):
        return None


class _DataBars:
    """Ray Data draws one bar per operator (plus a dataset bar without a total); the step's line
    shows the last operator of the chain that has a row total: rows through the whole plan."""

    def __init__(self):
        self.bars: dict[str, dict] = {}

    def update(self, node: str, state: dict) -> Update | None:
        uuid = state.get("uuid", "")
        self.bars[uuid] = state
        ops = [b for b in self.bars.values() if (b.get("total") or 0) > 1 and b.get("pos", 0) >= 1]
        if state.get("closed"):
            self.bars.pop(uuid, None)  # its final count still shows below, once
        if not ops:
            return None
        bar = max(ops, key=lambda b: b.get("pos", 0))
        op = str(bar.get("desc", "")).lstrip("- ").split(":")[0]
        return Update(
            node,
            float(bar.get("x", 0)),
            float(bar["total"]),
            (bar.get("unit") or "rows").strip() + "s",
            note=f"Ray Data {op}",
        )


class Meter:
    """Rate and time left of one step from its updates (over the last `window_s` seconds)."""

    def __init__(self, window_s: float = 30.0):
        self.window_s = window_s
        self.points: list[tuple[float, float]] = []  # (time, done)
        self.last: Update | None = None

    def add(self, u: Update) -> None:
        if (
            u.done is not None
            and self.last is not None
            and (u.unit != self.last.unit or u.done < (self.last.done or 0))
        ):
            self.points = []  # a new phase (another unit, or a counter that restarted)
        if u.done is not None:
            self.points.append((u.t, u.done))
            self.points = [p for p in self.points if p[0] >= u.t - self.window_s] or self.points[-1:]
        self.last = (
            u
            if u.done is not None or self.last is None
            else Update(u.node, self.last.done, self.last.total, self.last.unit, u.note, u.t)
        )

    @property
    def rate(self) -> float | None:
        """Units per second, None until two points span some time."""
        if len(self.points) < 2 or self.points[-1][0] - self.points[0][0] <= 0:
            return None
        (t0, d0), (t1, d1) = self.points[0], self.points[-1]
        return (d1 - d0) / (t1 - t0)

    @property
    def seconds_left(self) -> float | None:
        u, rate = self.last, self.rate
        if u is None or u.total is None or u.done is None or not rate or rate <= 0:
            return None
        return max(0.0, (u.total - u.done) / rate)

    def summary(self) -> str:
        """`120/200 steps (60%) · 3.1 steps/s · ~26s left`, or the note alone."""
        u = self.last
        if u is None:
            return ""
        parts = []
        if u.done is not None:
            count = f"{_num(u.done)}/{_num(u.total)} {u.unit}" if u.total else f"{_num(u.done)} {u.unit}"
            if u.total:
                count += f" ({100 * u.done / u.total:.0f}%)"
            parts.append(count)
            if self.rate is not None:
                parts.append(f"{_num(self.rate, rate=True)} {u.unit}/s")
            if self.seconds_left is not None and u.done < (u.total or 0):
                parts.append(f"~{_duration(self.seconds_left)} left")
        if u.note:
            parts.append(u.note)
        return " · ".join(parts)


def _num(x: float | None, rate: bool = False) -> str:
    if x is None:
        return "?"
    if rate and x < 10:
        return f"{x:.2g}" if x < 1 else f"{x:.1f}"
    return f"{x:,.0f}"


def _duration(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else (f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s")


class WorkerLogs:
    """For the length of a run, the driver's consumer of Ray's worker-log stream (in place of Ray's
    printer): every line of this job goes to `path`; progress becomes Updates. `drain()` returns
    what arrived since the last call, as runner events (`step_progress`, `worker_log`), for the
    display to render on the driver's main thread."""

    def __init__(self, path: Path, pipeline: str):
        self.path = Path(path)
        self.prefix = f"{pipeline}."
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._bars: dict[str, _DataBars] = {}
        self._lock = threading.Lock()
        self._file = None
        self._replaced: list = []

    # the dispatcher runs handlers on Ray's log thread: only the file and a queue are touched there
    def __call__(self, data: dict) -> None:
        if data.get("pid") == "autoscaler":
            return  # cluster status dumps; Ray's session logs keep them
        node = self._node(data)
        who = data.get("actor_name") or data.get("task_name") or ""
        prefix = f"({who + ' ' if who else ''}pid={data.get('pid')})"
        stamp = time.strftime("%H:%M:%S")
        out = []
        for line in data.get("lines", []):
            update = parse_progress_line(line)
            if update is None and _TQDM_MAGIC in line and node is not None:
                try:
                    update = self._bars.setdefault(node, _DataBars()).update(node, json.loads(line))
                except ValueError:
                    update = None
                if update is None:
                    continue
                self._events.put({"event": "step_progress", "update": update})
                continue  # a bar redraw: the summary line replaces it, in the file too
            if update is not None:
                self._events.put({"event": "step_progress", "update": update})
                if update.note is None:
                    continue
                line = f"progress: {update.note}"
            out.append(f"[{stamp}] {prefix} {line}")
            # the display prints these only when verbose
            self._events.put({"event": "worker_log", "node": node, "line": f"{prefix} {line}"})
        if out:
            with self._lock:
                if self._file is not None:
                    self._file.write("\n".join(out) + "\n")
                    self._file.flush()

    def _node(self, data: dict) -> str | None:
        name = data.get("task_name") or ""
        return name[len(self.prefix) :] if name.startswith(self.prefix) else None

    def drain(self) -> list[dict]:
        out = []
        while True:
            try:
                out.append(self._events.get_nowait())
            except queue.Empty:
                return out

    def __enter__(self) -> "WorkerLogs":
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")
        with dispatcher._lock:
            # Ray's console printer steps aside (its bars and dedup notices are what this replaces)
            self._replaced = [h for h in dispatcher.handlers if h[0] == "ray_print_logs"]
            dispatcher.handlers = [h for h in dispatcher.handlers if h[0] != "ray_print_logs"]
        dispatcher.add_handler("raypai_worker_logs", self)
        return self

    def __exit__(self, *exc) -> None:
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

        time.sleep(0.2)  # the log monitor's last batch of this run
        dispatcher.remove_handler("raypai_worker_logs")
        with dispatcher._lock:
            dispatcher.handlers = [*dispatcher.handlers, *self._replaced]
        with self._lock:
            self._file.close()
            self._file = None
