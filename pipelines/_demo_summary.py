"""What `make demo` prints at the end: endpoint, a token, ready-to-paste curl/openai, where to look."""

from __future__ import annotations

import uuid

from rich.panel import Panel

from raypai.cli.render import console


def _f(x, digits: int = 2) -> str:
    return "n/a" if not isinstance(x, (int, float)) else f"{x:.{digits}f}"


def demo_token(settings, result) -> str | None:
    """An inference token for the demo's endpoint (shown once by print_summary), when it deployed.
    A separate call, not a side effect of printing: `make demo` asks for one explicitly."""
    from raypai.store import MetadataStore

    dep = result.result if isinstance(result.result, dict) else {}
    if not result.ok or not dep.get("deployed", True):
        return None
    return MetadataStore(settings.database_url).create_token(f"demo-{uuid.uuid4().hex[:6]}", ["infer"])


def print_summary(settings, result, token: str | None = None) -> None:
    """Endpoint, how to query it (with `token` when given), where to look. Writes nothing."""
    dep = result.result if isinstance(result.result, dict) else {}
    if not dep.get("deployed", True):
        console.print(
            Panel(
                f"[bold]not deployed[/]: {dep.get('reason')}\n(registered as {dep.get('model')} version "
                f"{dep.get('version')}; re-run with --param require_improvement=false to deploy anyway)",
                title="tinychat",
                expand=False,
            )
        )
        return
    name = dep.get("deployment", "tinychat")
    endpoint = dep.get("endpoint", "http://127.0.0.1:8000/v1")
    token = token or "$RAYPAI_INFER_TOKEN"  # `raypai token create NAME --scope infer` makes one
    ev = result.steps.get("evaluate")
    metrics = ev.value if ev is not None and isinstance(ev.value, dict) else {}
    base = result.steps.get("pretrain")
    base_ppl = (base.output().metadata or {}).get("eval_ppl") if base is not None and base.outputs else None
    vocab = (
        (result.steps["tokenize"].output().metadata or {}).get("vocab_size")
        if "tokenize" in result.steps and result.steps["tokenize"].outputs
        else None
    )
    lines = [
        f"[bold]deployed[/] {name} (model version {dep.get('version')}) at {endpoint}",
        f"held-out exact match (share of 20 unseen sums answered right, greedy): SFT {_f(metrics.get('baseline'))} → "
        f"aligned {_f(metrics.get('candidate'))}; promoted: {metrics.get('improved')}",
        f"held-out perplexity on the cleaned corpus (lower is better; a uniform guess = vocabulary size {vocab}): "
        f"pretrained {_f(base_ppl, 1)}, SFT {_f(metrics.get('ppl_baseline'), 1)}, aligned {_f(metrics.get('ppl_candidate'), 1)}",
        "",
        "[bold]try it[/] (token shown once):",
        f"  curl {endpoint}/chat/completions -H 'Authorization: Bearer {token}' -H 'Content-Type: application/json' "
        f'-d \'{{"model": "{name}", "messages": [{{"role": "user", "content": "3+4="}}], "max_tokens": 4}}\' -i',
        f"  python -c \"import openai; c = openai.OpenAI(base_url='{endpoint}', api_key='{token}'); "
        f"print(c.chat.completions.create(model='{name}', messages=[{{'role': 'user', 'content': '3+4='}}], max_tokens=4))\"",
        "",
        f"[bold]lineage[/]   raypai lineage --deployment {name}",
        "[bold]MLflow UI[/] raypai ui  →  the URL it prints (port 5000 unless taken)",
        f"[bold]Ray dashboard[/] {_dashboard(settings)}",
        "[bold]deploy API[/] raypai server  →  /docs on the port it prints (8080 unless taken)",
    ]
    console.print(Panel("\n".join(lines), title="tinychat is up", expand=False))


def _dashboard(settings) -> str:
    """The dashboard of the Ray head `make demo` started (its port is chosen and recorded at start)."""
    from raypai.runtime import load_state

    head = load_state(settings).head
    return (head.dashboard_url or "off") if head is not None else "only while a run's local Ray is up"
