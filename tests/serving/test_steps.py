"""The register and deploy steps: the deploy gate (the evaluation, metric thresholds) and the cached
deploy's still-serving check (the steps inside a whole run: tests/e2e/test_tinychat.py)."""


def test_deploy_metric_gate_lists_every_unmet_threshold():
    from raypai.serving.steps import unmet_gates

    assert unmet_gates({"acc": 0.8, "ppl": 3.0}, {"acc": 0.5}) == []
    assert unmet_gates({"acc": 0.4}, {"acc": 0.5, "bleu": 0.1}) == ["acc=0.4 < 0.5", "bleu=None < 0.1"]
    assert unmet_gates(None, None) == []


def test_a_cached_deploy_holds_only_while_its_deployment_serves_that_version(tmp_path):
    """The deploy step's cache check (Serve's own status is checked in tests/test_runtime.py's demo run)."""
    from raypai.deployment import DeploymentSpec
    from raypai.serving.steps import still_serving
    from raypai.store import MetadataStore

    store = MetadataStore(f"sqlite:///{tmp_path}/meta.db")
    cached = {"deployed": True, "deployment": "chat", "model": "m", "version": 3, "endpoint": "http://x/v1"}
    assert still_serving({"deployed": False, "reason": "metric gate: acc=0.1 < 0.5"}, store) is None
    assert still_serving(cached, store) == "deployment 'chat' is gone now"
    store.save_deployment("chat", DeploymentSpec(model="m", version=4), "running")
    assert still_serving(cached, store) == "deployment 'chat' now serves version 4, not 3"
    store.save_deployment("chat", DeploymentSpec(model="m", version=3), "failed")
    assert still_serving(cached, store) == "deployment 'chat' is failed now"


def _deploy_node(dag):
    """The deploy node of a built pipeline, and the register and evaluate nodes it reads."""
    deploy = dag.nodes["deploy"]
    register = dag.nodes[deploy.args["registered"].node]
    evaluate = dag.nodes[register.args["evaluation"].node]
    return deploy, register, evaluate


def test_the_pipelines_deploy_only_what_their_evaluation_promoted_unless_told_otherwise():
    """tinychat and finetune hand `require_improvement` (default on) to the deploy step as
    `require_promoted`, and the version deploy reads is the one `register` judged on `evaluate`'s report."""
    from raypai.pipelines.finetune import finetune
    from raypai.pipelines.tinychat import tinychat

    files = {
        "model_dir": "m",
        "sft_data": "chats.jsonl",
        "eval_prompts": "held.jsonl",
        "pref_data": "prefs.jsonl",
        "rewards": ["pkg.mod:fn"],
    }
    for pipe, params in ((tinychat, {}), (finetune, files)):
        deploy, register, evaluate = _deploy_node(pipe.build(**params))
        assert (register.step.name, evaluate.step.name) == ("register", "evaluate"), pipe.name
        assert deploy.args["require_promoted"] is True, pipe.name
        for off in (False, "false"):  # the override, as Python and as `--param require_improvement=false`
            deploy, _, _ = _deploy_node(pipe.build(**params, require_improvement=off))
            assert deploy.args["require_promoted"] is False, (pipe.name, off)


def test_an_evaluation_without_improvement_deploys_nothing_and_says_why(raypai_home, tmp_path):
    """The register and deploy steps' own functions on a real step context (SQLite store, MLflow
    registry): an aligned model that only ties the baseline is registered without the champion alias,
    and the gated deploy step creates no deployment and says why; the override lets it through."""
    from raypai.alignment.evaluate import decide
    from raypai.artifacts import ArtifactStore
    from raypai.context import StepContext
    from raypai.runner import tracker_for
    from raypai.serving.steps import deploy, deploy_gate, register
    from raypai.store import MetadataStore

    store = MetadataStore(raypai_home.database_url)
    run_id = store.create_run("tinychat", {})
    srid = store.create_step_run(run_id, "register", "raypai.serving.steps:register", {}, None)
    tracker = tracker_for(raypai_home)
    ctx = StepContext(
        raypai_home, run_id, srid, "register", "tinychat", store, ArtifactStore(raypai_home.artifact_uri), tracker, None
    )
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text('{"model_type": "llama"}')
    model = ctx.save(tmp_path / "model", kind="model", name="aligned_model")

    tie = {"metric": "held_out_reward", "candidate": 0.5, "baseline": 0.5}
    tie["improved"] = decide(tie["metric"], tie["candidate"], tie["baseline"])  # as the evaluate step decides
    registered = register.fn(ctx, model, name="chat", evaluation=tie)
    assert registered["promoted"] is False and registered["alias"] is None
    assert "champion" not in tracker.client.get_registered_model("chat").aliases

    assert deploy_gate(registered, require_promoted=True) == "evaluation did not beat the baseline"
    out = deploy.fn(ctx, registered, name="chat", require_promoted=True)  # refused before any Serve call
    assert out["deployed"] is False and out["reason"] == "evaluation did not beat the baseline", out
    assert store.get_deployment("chat") is None and store.list_deployments() == []

    assert deploy_gate(registered, require_promoted=False) is None  # require_improvement=false: deployed anyway
    better = {**tie, "candidate": 0.75}
    better["improved"] = decide(better["metric"], better["candidate"], better["baseline"])
    promoted = register.fn(ctx, model, name="chat", evaluation=better)
    assert promoted["promoted"] is True and promoted["alias"] == "champion"
    assert deploy_gate(promoted, require_promoted=True) is None
    assert (
        deploy_gate(promoted, require_promoted=True, evaluation=better, min_metrics={"candidate": 0.8})
        == "metric gate: candidate=0.75 < 0.8"
    )
