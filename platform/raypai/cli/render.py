"""Rich rendering for the CLI: the run display (steps, one progress line each), run tables, lineage trees."""

from __future__ import annotations

import os
import time

from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.table import Table
from rich.text import Text
from rich.tree import Tree

from raypai.progress import Meter

console = Console(stderr=False)
_STYLE = {
    "succeeded": "green",
    "cached": "cyan",
    "failed": "red",
    "skipped": "yellow",
    "running": "blue",
    "pending": "white",
}


class Progress:
    """The run display: one line per step event, and for each running step ONE line that
    summarises its progress (done/total, rate, time left) instead of the workers' own bars and
    logs, which go to the run's log file (its path is printed first). On a terminal the running
    lines redraw in place; in a pipe or file a step's line is printed when it first reports and then
    at most every `every_s` seconds. `verbose` also prints every worker log line."""

    def __init__(self, *, verbose: bool | None = None, every_s: float = 10.0, out: Console | None = None):
        self.t0 = time.time()
        self.console = out or console
        self.verbose = os.environ.get("RAYPAI_VERBOSE", "") == "1" if verbose is None else verbose
        self.every_s = every_s
        self.meters: dict[str, Meter] = {}
        self.started: dict[str, float] = {}
        self.printed: dict[str, float] = {}
        self.live: Live | None = None

    def __call__(self, event: dict) -> None:
        el = f"[dim]{time.time() - self.t0:7.1f}s[/]"
        kind = event["event"]
        if kind == "run_started":
            self.console.print(
                f"{el} [bold]run {event['run_id'][:8]}[/] of [bold]{event['pipeline']}[/]: {' → '.join(event['steps'])}"
            )
            if event.get("ray"):
                self.console.print(f"{' ' * 9} [dim]ray:[/]  {escape(event['ray'])}", soft_wrap=True)
            if event.get("log"):
                self.console.print(
                    f"{' ' * 9} [dim]logs:[/] {escape(event['log'])}"
                    + ("" if self.verbose else "  (--verbose prints them here too)"),
                    soft_wrap=True,
                )
        elif kind == "step_started":
            self.started[event["node"]] = time.time()
            self.meters[event["node"]] = Meter()
            self.console.print(f"{el}   [blue]▶[/] {event['node']}")
            self._live()
        elif kind == "step_progress":
            u = event["update"]
            meter = self.meters.setdefault(u.node, Meter())
            meter.add(u)
            if (
                self.live is None
                and u.node in self.started
                and (u.node not in self.printed or time.time() - self.printed[u.node] >= self.every_s)
            ):
                self.printed[u.node] = time.time()
                self.console.print(f"{el}     [blue]⋯[/] {u.node}  {escape(meter.summary())}", soft_wrap=True)
        elif kind == "worker_log":
            if self.verbose:
                self.console.print(f"[dim]{escape(event['line'])}[/]", soft_wrap=True, highlight=False)
        elif kind == "artifact_damaged":  # a committed output whose files' sizes changed: not reused
            self.console.print(f"{el}   [yellow]![/] {event['node']}: {escape(event['reason'])}", soft_wrap=True)
        elif kind == "step_retry":
            self.console.print(
                f"{el}   [yellow]↻[/] {event['node']} retry {event['attempt']} in "
                f"{event['delay_s']:.1f}s: {event['error']}"
            )
        elif kind == "step_finished":
            r = event["result"]
            self.started.pop(r.node, None)
            meter = self.meters.pop(r.node, None)
            done = f" [dim]· {escape(meter.summary())}[/]" if meter is not None and meter.last is not None else ""
            style = _STYLE.get(r.state, "white")
            note = " [dim](cache hit)[/]" if r.state == "cached" else ""
            err = f"\n{' ' * 12}[red]{escape(r.error)}[/]" if r.error and r.state == "failed" else ""
            self.console.print(
                f"{el}   [{style}]{'✓' if r.state in ('succeeded', 'cached') else '✗'} {r.node} "
                f"{r.state}[/] {r.seconds:.1f}s{note}{done}{err}",
                soft_wrap=True,
            )
        elif kind == "run_finished" and self.live is not None:
            self.live.stop()
            self.live = None

    def _live(self) -> None:
        """On a terminal, the running steps' lines stay under the printed ones and redraw in place."""
        if self.live is None and self.console.is_terminal:
            self.live = Live(get_renderable=self._running, console=self.console, refresh_per_second=4, transient=True)
            self.live.start()

    def _running(self):
        lines = [
            f"{' ' * 11}[blue]⋯[/] {node} [dim]{time.time() - t:.0f}s[/]  "
            f"{escape(self.meters[node].summary()) if node in self.meters else ''}"
            for node, t in self.started.items()
        ]
        return Text.from_markup("\n".join(lines)) if lines else Text("")


def summary_table(result) -> Table:
    t = Table(title=f"run {result.run_id[:8]} · {result.pipeline} · {result.state} · {result.seconds:.1f}s")
    for col in ("step", "status", "time", "cache hit", "key metric"):
        t.add_column(col)
    for node, r in result.steps.items():
        metric = ", ".join(f"{k}={_fmt(v)}" for k, v in list(r.metrics.items())[:2])
        t.add_row(
            node,
            f"[{_STYLE.get(r.state, 'white')}]{r.state}[/]",
            f"{r.seconds:.1f}s",
            "yes" if r.state == "cached" else "",
            metric,
        )
    return t


def runs_table(runs: list[dict]) -> Table:
    t = Table(title="pipeline runs")
    for col in ("run", "pipeline", "state", "started", "took", "resumed from"):
        t.add_column(col)
    for r in runs:
        took = (r["finished_at"] - r["started_at"]).total_seconds() if r["finished_at"] else None
        t.add_row(
            r["id"][:12],
            r["pipeline"],
            f"[{_STYLE.get(r['state'], 'white')}]{r['state']}[/]",
            r["started_at"].strftime("%Y-%m-%d %H:%M:%S"),
            f"{took:.1f}s" if took is not None else "-",
            (r["origin_run_id"] or "")[:12],
        )
    return t


def steps_table(steps: list[dict]) -> Table:
    t = Table(title="steps")
    for col in ("step", "state", "attempts", "cache", "took", "ray node", "mlflow run", "error"):
        t.add_column(col)
    for s in steps:
        took = (s["finished_at"] - s["started_at"]).total_seconds() if s["finished_at"] and s["started_at"] else None
        t.add_row(
            s["node"],
            f"[{_STYLE.get(s['state'], 'white')}]{s['state']}[/]",
            str((s["attempt"] or 0) + 1),
            "hit" if s["cache_hit"] else "",
            f"{took:.1f}s" if took is not None else "-",
            (s.get("ray_node_id") or "")[:8],
            (s["mlflow_run_id"] or "")[:12],
            (s["error"] or "")[:80],
        )
    return t


def lineage_tree(tree: dict, *, down: bool = False) -> Tree:
    root = Tree(_art_label(tree["artifact"]))
    (_down if down else _up)(root, tree)
    return root


def _art_label(a: dict) -> str:
    return (
        f"[bold]{a['kind']}[/] [green]{a['name']}[/] [dim]{a['id'][:10]} sha256:{a['digest'][:12]} "
        f"{_size(a['size_bytes'])}[/]\n[dim]{a['uri']}[/]"
    )


def _step_label(s: dict) -> str:
    ml = f" mlflow:{s['mlflow_run_id'][:10]}" if s.get("mlflow_run_id") else ""
    metrics = ", ".join(f"{k}={_fmt(v)}" for k, v in list((s.get("metrics") or {}).items())[:3])
    return f"[blue]⟵ step {s['pipeline']}.{s['node']}[/] [dim]run {s['run_id'][:8]}{ml}[/]" + (
        f" [dim]{metrics}[/]" if metrics else ""
    )


def _up(branch: Tree, node: dict) -> None:
    step = node.get("produced_by")
    if node.get("repeated"):
        branch.add("[dim](shown above)[/]")
        return
    if step is None:
        branch.add("[yellow]raw source[/]")
        return
    sb = branch.add(_step_label(step))
    for inp in step["inputs"]:
        child = sb.add(f"[dim]{inp['name']}:[/] " + _art_label(inp["lineage"]["artifact"]))
        _up(child, inp["lineage"])


def _down(branch: Tree, node: dict) -> None:
    for step in node.get("consumed_by", []):
        sb = branch.add(_step_label(step).replace("⟵", "⟶"))
        for out in step["outputs"]:
            _down(sb.add(_art_label(out["artifact"])), out)


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024:
            return f"{n:.0f}{unit}"
        n /= 1024
    return f"{n:.1f}TB"


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def deployment_view(graph: dict) -> None:
    """Deployment → model version(s) → the lineage tree of each, ending at the raw sources."""
    console.print(f"[bold]deployment {graph['deployment']}[/] ({graph['state']})")
    for m in graph["models"]:
        root = Tree(
            f"[bold magenta]{m['role']}[/] model [green]{m['model']} v{m['version']}[/] [dim]{m['mlflow_source']}[/]"
        )
        if "lineage" in m:
            child = root.add(_art_label(m["lineage"]["artifact"]))
            _up(child, m["lineage"])
            console.print(root)
            names = ", ".join(f"{a['name']} ({a['uri']})" for a in m["raw_sources"])
            console.print(f"  [yellow]raw sources:[/] {names}")
        else:
            root.add("[yellow]registered outside raypai: no lineage tag[/]")
            console.print(root)


def head_lines(head) -> list[str]:
    """Where raypai's Ray head listens (a `raypai.runtime.HeadState`), one line per service."""
    return [
        f"  Ray GCS         {head.address}",
        f"  Ray dashboard   {head.dashboard_url or 'off (RAYPAI_DASHBOARD=0)'}",
        f"  Ray client      ray://127.0.0.1:{head.client_port}",
        f"  Serve HTTP      http://127.0.0.1:{head.serve_port}/v1  (the OpenAI-compatible endpoint, once deployed)",
        f"  session         {head.session_dir}",
    ]
