"""What `make demo` prints at the end: endpoint, a token, ready-to-paste curl/openai, where to look."""

from __future__ import annotations

import uuid

from rich.panel import Panel

from raypai.cli.render import console


def print_summary(settings, result) -> None:
    from raypai.store import MetadataStore

    dep = result.result if isinstance(result.result, dict) else {}
    name = dep.get("deployment", "tinychat")
    endpoint = dep.get("endpoint", "http://127.0.0.1:8000/v1")
    store = MetadataStore(settings.database_url)
    token = store.create_token(f"demo-{uuid.uuid4().hex[:6]}", ["infer"])
    ev = result.steps.get("evaluate")
    metrics = ev.value if ev is not None and isinstance(ev.value, dict) else {}
    lines = [
        f"[bold]deployed[/] {name} (model version {dep.get('version')}) at {endpoint}",
        f"held-out arithmetic accuracy: SFT {metrics.get('accuracy_baseline')} → aligned "
        f"{metrics.get('accuracy_candidate')}; perplexity {metrics.get('ppl_baseline', 0):.1f} → "
        f"{metrics.get('ppl_candidate', 0):.1f}",
        "",
        "[bold]try it[/] (token shown once):",
        f"  curl {endpoint}/chat/completions -H 'Authorization: Bearer {token}' -H 'Content-Type: application/json' "
        f"-d '{{\"model\": \"{name}\", \"messages\": [{{\"role\": \"user\", \"content\": \"3+4=\"}}], \"max_tokens\": 4}}' -i",
        f"  python -c \"import openai; c = openai.OpenAI(base_url='{endpoint}', api_key='{token}'); "
        f"print(c.chat.completions.create(model='{name}', messages=[{{'role': 'user', 'content': '3+4='}}], max_tokens=4))\"",
        "",
        f"[bold]lineage[/]   raypai lineage --deployment {name}",
        "[bold]MLflow UI[/] raypai ui  →  http://127.0.0.1:5000",
        "[bold]Ray dashboard[/] http://127.0.0.1:8265",
        "[bold]deploy API[/] raypai server  →  http://127.0.0.1:8080/docs",
    ]
    console.print(Panel("\n".join(lines), title="tinychat is up", expand=False))
