"""A deployment on vLLM (`engine="vllm"`, raypai.serving.vllm_server) over real HTTP with the official
`openai` client: chat, completion and streaming answered; ChatFormat's stop tokens end an answer as
raypai's engine ends it (the same version deployed on both engines answers the same); the router's
401, 413 and 429 in front of it.

vLLM's CPU build lives in its own environment (`make test-vllm`), because vLLM pins transformers,
fastapi and numpy below this project's venv. In the main suite vLLM is absent and this module is
skipped; under `make test-vllm` (RAYPAI_REQUIRE_VLLM=1) a vLLM that does not import fails it instead."""

import os
import socket
import time

import pytest

try:
    import vllm  # noqa: F401

    NO_VLLM = None
except Exception as exc:  # noqa: BLE001 - a broken install raises more than ImportError (a missing .so, an ABI clash)
    NO_VLLM = f"{type(exc).__name__}: {exc}"
if NO_VLLM and os.environ.get("RAYPAI_REQUIRE_VLLM") == "1":
    pytest.fail(f"RAYPAI_REQUIRE_VLLM=1 (make test-vllm) but vLLM does not import: {NO_VLLM}", pytrace=False)
if NO_VLLM:
    pytest.skip(
        f"vLLM does not import here ({NO_VLLM}): `make test-vllm` runs these with vLLM's CPU build",
        allow_module_level=True,
    )

import httpx  # noqa: E402
import openai  # noqa: E402
import ray  # noqa: E402
from ray import serve  # noqa: E402

from raypai.serving.control import Controller, serve_port  # noqa: E402
from raypai.serving.limits import Limits  # noqa: E402
from raypai.serving.router import app_name  # noqa: E402
from raypai.settings import Settings  # noqa: E402
from raypai.tracking import Tracker  # noqa: E402

# vLLM's CPU attention takes head sizes of 32 and up
SHAPE = {"hidden": 64, "heads": 2, "kv_heads": 1, "context": 256}
LIMITS = Limits(max_concurrent_per_key=2)
STOP = "<|eot_id|>"  # the template's end of turn: a ChatFormat stop id that is not the tokenizer's EOS
PROMPTS = ["1+2=", "13+27=", "The quick brown", "7+7="]


def _stopping_model(path: str) -> tuple[int, str]:
    """Make the random model end its turn (STOP) right after it reads one trigger token T, as a chat
    model ends after its answer: a residual dimension nobody writes but the embedding (0 everywhere,
    1 for T) carries "the last token was T", and only STOP's output row reads it. T is the greedy first
    token of a prompt that does not hold it, so that prompt's answer is T then the stop. Returns
    (T, that prompt)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, tie_word_embeddings=False).eval()
    stop = tok.convert_tokens_to_ids(STOP)
    with torch.no_grad():
        torch.manual_seed(0)  # an output matrix of its own: the tied one mostly repeats the last token
        model.lm_head.weight.normal_(0.0, 1.0)
        for layer in model.model.layers:  # nothing writes residual dimension 0 but the embedding
            layer.self_attn.o_proj.weight[0] = 0.0
            layer.mlp.down_proj.weight[0] = 0.0
        model.model.embed_tokens.weight[:, 0] = 0.0
        model.lm_head.weight[:, 0] = 0.0
        for prompt in PROMPTS:  # the first prompt whose greedy next token is none of its own
            ids = tok(prompt, add_special_tokens=True, return_tensors="pt")["input_ids"]
            trigger = int(model(ids).logits[0, -1].argmax())
            if trigger != stop and trigger not in ids[0].tolist():
                break
        else:
            raise AssertionError("no prompt continues with a token it lacks: change PROMPTS")
        model.model.embed_tokens.weight[trigger, 0] = 1.0
        model.lm_head.weight[stop, 0] = 1e4  # after T: the stop token outweighs every other
    model.config.tie_word_embeddings = False
    model.save_pretrained(path)
    return trigger, prompt


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """(Named `stack` as test_serving.py's, so tests/conftest.py marks its users integration.)"""
    from raypai.alignment.tasks.tiny import build_tiny_model
    from raypai.store import MetadataStore

    home = tmp_path_factory.mktemp("vllm-home")
    path = build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", family="llama3", **SHAPE)
    trigger, triggered = _stopping_model(path)
    settings = Settings.load({"RAYPAI_HOME": str(home)})
    tracker = Tracker(settings.mlflow_tracking_uri, artifact_root=home / "mlartifacts")
    version = tracker.register_model(path, "tiny")
    store = MetadataStore(settings.database_url)
    tokens = {who: store.create_token(who, ["infer"]) for who in ("client", "held", "other")}
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    ctl = Controller(settings, store=store, tracker=tracker, limits=LIMITS)
    created = ctl.create("tv", "tiny", version, engine="vllm", max_batch_size=8)
    ctl.create("tr", "tiny", version, engine="raypai")  # the same version on raypai's engine
    yield {
        "tokens": tokens,
        "created": created,
        "ctl": ctl,
        "app": app_name("tv", version),
        "trigger": trigger,
        "triggered": triggered,
    }
    serve.shutdown()
    ray.shutdown()


def _client(stack, who="client") -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{serve_port()}/v1", api_key=stack["tokens"][who], max_retries=0, timeout=120
    )


def test_the_deployment_runs_on_vllm_and_says_so(stack):
    assert stack["created"]["spec"]["engine"] == "vllm"
    assert stack["ctl"].describe("tv")["spec"]["engine"] == "vllm"
    assert stack["ctl"].describe("tr")["spec"]["engine"] == "raypai"
    info = serve.get_app_handle(stack["app"]).info.remote().result()
    assert info["engine"] == "vllm" and info["active_rows"] == 0, info


def test_chat_and_completion_answer_with_the_version(stack):
    client = _client(stack)
    r = client.chat.completions.create(
        model="tv", messages=[{"role": "user", "content": "3+4="}], max_tokens=8, temperature=0
    )
    assert r.choices[0].message.role == "assistant" and r.system_fingerprint == "tiny/1"
    assert r.choices[0].finish_reason in ("stop", "length") and 0 < r.usage.prompt_tokens
    assert r.usage.completion_tokens <= 8
    raw = client.completions.with_raw_response.create(model="tv", prompt="The quick", max_tokens=5, temperature=0)
    assert raw.headers["x-raypai-model-version"] == "tiny/1"
    c = raw.parse()
    assert c.usage.completion_tokens <= 5 and c.choices[0].finish_reason in ("stop", "length"), c


def test_streaming_sends_the_same_text_as_the_whole_answer(stack):
    client = _client(stack)
    for prompt in PROMPTS[1:]:
        whole = client.completions.create(model="tv", prompt=prompt, max_tokens=12, temperature=0)
        chunks = list(client.completions.create(model="tv", prompt=prompt, max_tokens=12, temperature=0, stream=True))
        assert "".join(ch.choices[0].text for ch in chunks) == whole.choices[0].text, prompt
        assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    stream = client.chat.completions.create(
        model="tv", messages=[{"role": "user", "content": "1+2="}], max_tokens=6, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices[0].finish_reason is not None


def test_chatformat_stop_tokens_end_the_answer_as_on_raypais_engine(stack):
    """The model ends its turn after the trigger token: the stop token is no text and no token of the
    answer, the finish reason is `stop`, and raypai's engine answers exactly the same."""
    client = _client(stack)
    answers = {}
    for model in ("tv", "tr"):
        r = client.completions.create(model=model, prompt=stack["triggered"], max_tokens=20, temperature=0)
        answers[model] = (r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens)
    assert answers["tv"][1:] == ("stop", 1), answers  # the trigger, then the stop token (not counted)
    assert answers["tv"] == answers["tr"], answers
    # the other prompts agree too, and a stop string is cut, not returned, on both engines alike
    for prompt in PROMPTS:
        got = {
            m: client.completions.create(model=m, prompt=prompt, max_tokens=12, temperature=0).choices[0].text
            for m in ("tv", "tr")
        }
        assert got["tv"] == got["tr"] and got["tv"], (prompt, got)
        stop = got["tv"][-1]  # the answer's last character: cut there, wherever it first occurs
        for m in ("tv", "tr"):
            r = client.completions.create(model=m, prompt=prompt, max_tokens=12, temperature=0, stop=[stop])
            assert r.choices[0].text == got["tv"][: got["tv"].index(stop)], (m, prompt, stop, r)
            assert r.choices[0].finish_reason == "stop", (m, prompt, r)


def test_401_without_a_valid_token(stack):
    bad = openai.OpenAI(base_url=f"http://127.0.0.1:{serve_port()}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as err:
        bad.completions.create(model="tv", prompt="1", max_tokens=1)
    assert err.value.status_code == 401


def test_413_for_a_body_past_the_cap(stack):
    with pytest.raises(openai.APIStatusError) as err:
        _client(stack).completions.create(model="tv", prompt="a" * (LIMITS.max_body_bytes + 1), max_tokens=1)
    assert err.value.status_code == 413 and "request_too_large" in str(err.value.body), err.value.body


def _held(stack) -> socket.socket:
    """A request of the `held` key whose body never finishes: it holds one of the key's slots."""
    s = socket.create_connection(("127.0.0.1", serve_port()), timeout=30)
    head = [
        "POST /v1/completions HTTP/1.1",
        "Host: 127.0.0.1",
        "Content-Type: application/json",
        "Content-Length: 100",
        f"Authorization: Bearer {stack['tokens']['held']}",
    ]
    s.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + b'{"model": ')
    return s


def test_429_past_the_concurrency_per_key(stack):
    held = [_held(stack) for _ in range(LIMITS.max_concurrent_per_key)]
    try:
        deadline = time.time() + 10
        while True:
            try:
                _client(stack, "held").completions.create(model="tv", prompt="1", max_tokens=1)
            except openai.RateLimitError as exc:
                assert exc.response.headers["retry-after"] == "1"
                break
            assert time.time() < deadline, "the held requests never took their slots"
            time.sleep(0.1)
        assert _client(stack, "other").completions.create(model="tv", prompt="1", max_tokens=1).choices
    finally:
        for s in held:
            s.close()


def test_a_disconnected_stream_is_aborted_in_vllm(stack):
    """The client leaves mid-stream: the router cancels its call and the replica aborts the vLLM request."""
    handle = serve.get_app_handle(stack["app"])
    before = handle.info.remote().result()["cancelled"]
    body = {"model": "tv", "prompt": PROMPTS[2], "max_tokens": 200, "temperature": 1.0, "seed": 1, "stream": True}
    headers = {"Authorization": f"Bearer {stack['tokens']['client']}"}
    with httpx.stream("POST", f"http://127.0.0.1:{serve_port()}/v1/completions", json=body, headers=headers) as r:
        assert r.status_code == 200
        next(r.iter_lines())  # the first event: it is decoding
    deadline = time.time() + 10
    while (info := handle.info.remote().result())["active_rows"] or info["listeners"]:
        assert time.time() < deadline, info
        time.sleep(0.05)
    # a 200-token stream may also have ended by itself (the random model's stop token) before the close
    assert info["cancelled"] in (before, before + 1), info
