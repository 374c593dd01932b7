"""Alignment on the user's own model, data and reward, for four model families with their own
tokenizer conventions (built here from transformers configs, no downloads):

- Llama with a Llama-3-style template (<|eot_id|>, generation_config EOS list, no pad token),
- Qwen2 with a ChatML template (<|im_start|>/<|im_end|>, EOS <|endoftext|>),
- GPT-2 with no chat template (completion format, no pad token),
- Phi-3 (q/k/v and gate/up fused in `qkv_proj`/`gate_up_proj`, untied head) with Phi-3's template:
  <|end|> ends a turn, EOS <|endoftext|> closes a conversation, which no generation config lists.

Per family: SFT (conversational and prompt/completion), the rollout's decoding of the SFT model
against `generate`, DPO from a preference file, GRPO with a reward given by import path — each
moving its held-out metric the right way — online DPO and PPO (short runs: their phases hand over
through Ray on the family's tokens), an export of the GRPO model that plain `transformers` loads
and whose generation stops at that family's end token, and its deployment through the deploy API
answering the OpenAI-compatible API, stopping at the same token."""

import json
import os
import socket
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from raypai.alignment import DPOConfig, GRPOConfig, PPOConfig, SFTConfig, run_dpo, run_grpo, run_ppo, run_sft
from raypai.alignment.data import load
from raypai.alignment.tasks import arithmetic as ar
from raypai.chat import ChatFormat

FAMILIES = {"llama3": "<|eot_id|>", "qwen2": "<|im_end|>", "gpt2": "<|endoftext|>", "phi3": "<|end|>"}
CHAT = {"llama3": True, "qwen2": True, "gpt2": False, "phi3": True}
LEAN = {"llama3": True, "qwen2": True, "gpt2": False, "phi3": True}  # raypai's lean forward covers the family
TRAIN, HELD = ar.split()

REWARDS = '''
import json

from raypai.chat import text_of

LOG = {log!r}


def exact_answer(prompts, completions, answer, **_):
    """1 when the completion starts with the right sum (the user's reward, imported by path)."""
    out = []
    for c, a in zip(completions, answer):
        t = text_of(c).strip()
        out.append(1.0 if t.split(" ")[0] == str(a) else 0.0)
    return out


def recorded_exact_answer(prompts, completions, answer, **_):
    """exact_answer, each call's scores appended to LOG as one JSON line (the Reward actor is a process
    of its own): the test recounts from them the pairs online DPO had to train on."""
    out = exact_answer(prompts, completions, answer)
    with open(LOG, "a") as f:
        f.write(json.dumps(out) + "\\n")
    return out
'''


@pytest.fixture(scope="module")
def user_files(tmp_path_factory):
    """The user's files: chats, prompt/completion rows, preference pairs, prompts with answers, and a
    reward module on sys.path (shipped to the Ray actors by value)."""
    d = tmp_path_factory.mktemp("user")
    (d / "fam_rewards.py").write_text(textwrap.dedent(REWARDS).format(log=str(d / "scores.jsonl")))
    sys.path.insert(0, str(d))
    files = {"scores": d / "scores.jsonl"}
    for chat in (True, False):
        tag = "chat" if chat else "plain"
        files[f"sft_{tag}"] = ar.write_jsonl(ar.sft_rows(TRAIN, chat), d / f"sft_{tag}.jsonl")
        files[f"sft_{tag}_held"] = ar.write_jsonl(ar.sft_rows(HELD, chat), d / f"sft_{tag}_held.jsonl")
        files[f"prefs_{tag}"] = ar.write_jsonl(ar.preference_rows(TRAIN, 0, 1, chat), d / f"prefs_{tag}.jsonl")
        files[f"prefs_{tag}_held"] = ar.write_jsonl(ar.preference_rows(HELD, 7, 1, chat), d / f"prefs_{tag}_held.jsonl")
        files[f"prompts_{tag}"] = ar.write_jsonl(ar.prompt_rows(TRAIN, chat), d / f"prompts_{tag}.jsonl")
        files[f"prompts_{tag}_held"] = ar.write_jsonl(ar.prompt_rows(HELD, chat), d / f"prompts_{tag}_held.jsonl")
    yield files
    sys.path.remove(str(d))


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, ray_plain, user_files, tmp_path_factory, tiny_family):
    """A tiny random model of the family, then SFT on the user's file in the family's natural format."""
    fam = request.param
    d = tmp_path_factory.mktemp(fam)
    base = tiny_family(fam, d / "base")
    tag = "chat" if CHAT[fam] else "plain"
    sft = run_sft(
        base,
        str(d / "sft"),
        load(user_files[f"sft_{tag}"], "sft"),
        load(user_files[f"sft_{tag}_held"], "sft"),
        SFTConfig(steps=300, lr=3e-3, batch_size=16),
        run_name=f"fam-sft-{fam}",
    )
    return {
        "name": fam,
        "dir": d,
        "base": base,
        "sft": str(d / "sft"),
        "sft_metrics": sft,
        "tag": tag,
        "end": FAMILIES[fam],
    }


def test_sft_lowers_held_out_loss_in_the_family_format(family):
    m = family["sft_metrics"]
    assert m["eval_response_loss_after"] < 0.3 * m["eval_response_loss_before"], m
    assert m["truncated"] == 0


def test_sft_prompt_completion_format_also_learns(family, user_files):
    """Standard prompt/completion rows on every family (chat templates unused: completion + EOS).
    GPT-2's own format is this one: the module's SFT of its base already trained on these rows, so
    its metrics are checked instead of a second, shorter run on the same rows."""
    if family["tag"] == "plain":
        m = family["sft_metrics"]
        assert m["eval_response_loss_after"] < 0.5 * m["eval_response_loss_before"], m
        return
    out = family["dir"] / "sft-plain"
    m = run_sft(
        family["base"],
        str(out),
        load(user_files["sft_plain"], "sft"),
        load(user_files["sft_plain_held"], "sft"),
        SFTConfig(steps=40, lr=3e-3),
        run_name=f"fam-sftp-{family['name']}",
    )
    assert m["eval_response_loss_after"] < 0.5 * m["eval_response_loss_before"], m


def test_the_rollout_decodes_the_family_as_generate_does_and_stops_at_its_end_token(family):
    """raypai's decoding loop on the SFT model (the lean forward where the family has one: Phi-3's
    fused projections too; GPT-2 its own forward), greedy: the tokens of `generate` and the log-prob
    of each under generate's own logits; the SFT model ends its answers with the family's end token."""
    from transformers import AutoModelForCausalLM

    from raypai.alignment._decode import decode

    model = AutoModelForCausalLM.from_pretrained(family["sft"]).eval()
    fmt = ChatFormat.from_pretrained(family["sft"])
    end = fmt.tok.convert_tokens_to_ids(family["end"])
    assert end in fmt.stop_ids
    prompts = [fmt.prompt_ids(row["prompt"]) for row in ar.prompt_rows(HELD[:4], CHAT[family["name"]])]
    mine = decode(
        model,
        prompts,
        pad_id=fmt.tok.pad_token_id,
        stop_ids=fmt.stop_ids,
        max_new_tokens=8,
        temperature=0,
        logprobs=True,
    )
    assert mine.path == ("lean" if LEAN[family["name"]] else "model")
    for p, toks, lps in zip(prompts, mine.tokens, mine.logprobs):  # one prompt at a time: no padding on HF's side
        ref = model.generate(
            torch.tensor([p]),
            attention_mask=torch.ones(1, len(p), dtype=torch.long),
            max_new_tokens=8,
            do_sample=False,
            eos_token_id=list(fmt.stop_ids),
            pad_token_id=fmt.tok.pad_token_id,
            output_logits=True,
            return_dict_in_generate=True,
        )
        assert toks == ref.sequences[0, len(p) :].tolist()
        lp = torch.stack([torch.log_softmax(step[0].float(), -1)[t] for step, t in zip(ref.logits, toks)])
        torch.testing.assert_close(lps, lp, atol=1e-4, rtol=0)
    assert all(t and t[-1] == end for t in mine.tokens), [fmt.tok.convert_ids_to_tokens(t) for t in mine.tokens]


def test_dpo_from_a_preference_file_raises_preference_accuracy(family, user_files):
    tag = family["tag"]
    d = run_dpo(
        family["sft"],
        str(family["dir"] / "dpo"),
        load(user_files[f"prefs_{tag}"], "preference"),
        load(user_files[f"prefs_{tag}_held"], "preference"),
        DPOConfig(steps=25, lr=5e-4, beta=0.1),
        run_name=f"fam-dpo-{family['name']}",
    )
    assert (
        d["preference_accuracy_after"] > d["preference_accuracy_before"] and d["margin_after"] > d["margin_before"]
    ), d


class _Rows:
    """Keeps the per-step metrics a run logs (the pipeline step's logger writes them to MLflow)."""

    def __init__(self):
        self.rows = []

    def log_metrics(self, metrics, step=None):
        self.rows.append((step, dict(metrics)))


def _sampled_reward(model_dir: str, problems: list, chat: bool, n: int = 16) -> float:
    """Mean of the user's reward over n fresh samples (temperature 1) per prompt, seeded alike for every model."""
    import fam_rewards

    from raypai.alignment.roles.rollout import Rollout

    prompts = [row["prompt"] for row in ar.prompt_rows(problems, chat)]
    out = Rollout(model_dir, seed=123).generate(prompts, n=n, max_new_tokens=4, temperature=1.0)
    answers = [p.answer for p in problems for _ in range(n)]
    return sum(fam_rewards.exact_answer(None, out["completions"], answers)) / len(answers)


ASYNC = ("gpt2", "qwen2")  # the families whose GRPO run below overlaps sampling and update


@pytest.fixture(scope="module")
def grpo(family, user_files):
    """GRPO from the family's SFT model with the user's reward by import path: the model the GRPO
    test measures and the export and deployment tests load (a failed run fails them all)."""
    tag = family["tag"]
    out = str(family["dir"] / "grpo")
    logger = _Rows()
    metrics = run_grpo(
        family["sft"],
        out,
        load(user_files[f"prompts_{tag}"], "prompt"),
        load(user_files[f"prompts_{tag}_held"], "prompt"),
        GRPOConfig(
            steps=30,
            prompts_per_step=16,
            group_size=8,
            lr=1e-3,
            max_new_tokens=4,
            eval_every=100,
            async_rollout=family["name"] in ASYNC,
        ),
        rewards=["fam_rewards:exact_answer"],
        run_name=f"fam-grpo-{family['name']}",
        logger=logger,
    )
    return {"dir": out, "metrics": metrics, "rows": logger.rows}


def test_grpo_with_a_reward_by_import_path_raises_the_reward_of_its_samples(family, grpo):
    """GRPO maximises the expected reward of the policy's samples on its prompts: measured afresh, the
    exported policy's samples (1,280: 16 per training prompt) score higher under the user's reward than
    the SFT model's, with the same seed (an update that did nothing would score exactly the same).
    Not asserted: the held-out greedy reward. A 2-layer model does not learn addition from 80 sums, so
    over 30 steps it wandered (−0.05, −0.1, +0.1 for Qwen2, GPT-2 and Llama on one machine; it rose for
    all three on the machine earlier sessions used) while the training samples' reward rose by
    0.08–0.10 for all three (≈ 6 standard errors); it is printed with the failure message.
    GPT-2 (its own forward, not the Llama-family fast path) and Qwen2 (the fast path, with q/k/v
    biases) train with `async_rollout=True`: the next batch is sampled from the weights one step
    behind, with its behaviour log-probs from the rollout engine, and the policy must still learn.
    Llama-3 and Phi-3 stay synchronous (each phase hands its outputs to the next through Ray)."""
    lags = [m["policy_lag_steps"] for step, m in grpo["rows"] if step is not None]
    assert lags == ([0] + [1] * 29 if family["name"] in ASYNC else [0] * 30), lags  # async: one step behind
    before, after = (_sampled_reward(m, TRAIN, CHAT[family["name"]]) for m in (family["sft"], grpo["dir"]))
    assert after > before + 0.03, (before, after, grpo["metrics"])


def _moved(model_dir: str, start_dir: str) -> bool:
    """Whether any weight of the model in `model_dir` differs from the one in `start_dir`."""
    from transformers import AutoModelForCausalLM

    a, b = (AutoModelForCausalLM.from_pretrained(d).state_dict() for d in (model_dir, start_dir))
    return any(not torch.equal(a[k], b[k]) for k in a)


def test_online_dpo_and_ppo_hand_their_phases_over_on_the_family(family, user_files):
    """Online DPO (pairs ranked by the user's reward from the policy's own samples) and PPO (policy,
    critic with the family's token-classification head, rollout, reference, reward) run on the
    family's tokenizer and format, each phase taking its inputs from the last through Ray: the
    trainers pad the family's sampled token ids themselves. Every step that learns is logged with
    finite losses, and the exported policy is not the SFT model any more. Short runs: their
    learning is asserted on raypai's own model (tests/alignment/test_algorithms.py)."""
    tag, name = family["tag"], family["name"]
    train = load(user_files[f"prompts_{tag}"], "prompt")
    held = load(user_files[f"prompts_{tag}_held"], "prompt")[:4]
    logger = _Rows()
    out = str(family["dir"] / "odpo")
    user_files["scores"].unlink(missing_ok=True)  # the reward's record of this run's scores
    run_dpo(
        family["sft"],
        out,
        [],
        load(user_files[f"prefs_{tag}_held"], "preference"),
        DPOConfig(steps=4, batch_size=8, num_samples=4, max_new_tokens=4, lr=1e-3, online=True),
        prompts=train,
        held_out=held,
        rewards=["fam_rewards:recorded_exact_answer"],
        run_name=f"fam-odpo-{name}",
        logger=logger,
    )
    steps = [m for step, m in logger.rows if step is not None]
    assert steps and all(torch.isfinite(torch.tensor(m["dpo/loss"])) for m in steps), steps
    # per step, the pairs best vs worst takes from the step's 8 groups of 4 samples, recounted from the
    # reward's scores (the held-out scoring calls score 4 greedy completions): every group whose samples
    # do not all tie, and a step where all tie is not logged
    calls = [json.loads(line) for line in user_files["scores"].read_text().splitlines()]
    per_step = [c for c in calls if len(c) == 8 * 4]
    assert len(per_step) == 4 and len(held) != 8 * 4, [len(c) for c in calls]
    expected = [sum(max(c[g : g + 4]) > min(c[g : g + 4]) for g in range(0, 32, 4)) for c in per_step]
    logged = {step: m["dpo/pairs"] for step, m in logger.rows if step is not None}
    assert logged == {s: k for s, k in enumerate(expected, 1) if k}, (logged, expected)
    assert _moved(out, family["sft"])
    logger = _Rows()
    out = str(family["dir"] / "ppo")
    p = run_ppo(
        family["sft"],
        out,
        train,
        held,
        PPOConfig(steps=2, prompts_per_step=8, max_new_tokens=4, ppo_epochs=1),
        rewards=["fam_rewards:exact_answer"],
        run_name=f"fam-ppo-{name}",
        logger=logger,
    )
    steps = [m for step, m in logger.rows if step is not None]
    assert p["steps_run"] == 2 == len(steps)
    assert all(torch.isfinite(torch.tensor([m["policy_loss"], m["value_loss"], m["kl"]])).all() for m in steps), steps
    assert _moved(out, family["sft"])


def test_export_loads_in_plain_transformers_and_stops_at_the_family_end_token(family, grpo):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = grpo["dir"]
    assert json.loads((Path(out) / "raypai.json").read_text())["algorithm"] == "grpo"
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    end_id = tok.convert_tokens_to_ids(family["end"])
    assert end_id in model.generation_config.eos_token_id  # plain generate stops where raypai does
    fmt = ChatFormat(tok)
    prompt = [{"role": "user", "content": "2+3="}] if CHAT[family["name"]] else "2+3="
    ids = torch.tensor([fmt.prompt_ids(prompt)])
    with torch.no_grad():
        gen = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id
        )[0, ids.shape[1] :].tolist()
    assert end_id in gen and len(gen) < 8, tok.convert_ids_to_tokens(gen)  # stopped at the end token
    assert gen.index(end_id) == len(gen) - 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def serving_stack(ray_plain, tmp_path_factory):
    """One deploy API (uvicorn) + Ray Serve for the module; each family adds its deployment."""
    import uvicorn
    from ray import serve

    from raypai.serving.api import create_app
    from raypai.settings import Settings
    from raypai.store import MetadataStore
    from raypai.tracking import Tracker

    home = tmp_path_factory.mktemp("serve-home")
    before = os.environ.get("RAYPAI_SERVE_PORT")  # other modules set theirs at import: restore it afterwards
    os.environ["RAYPAI_SERVE_PORT"] = str(_free_port())
    settings = Settings.load({"RAYPAI_HOME": str(home)})
    store = MetadataStore(settings.database_url)
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    deadline = time.time() + 60
    while not server.started and time.time() < deadline:
        time.sleep(0.1)
    yield {
        "api": f"http://127.0.0.1:{port}",
        "tracker": Tracker(settings.mlflow_tracking_uri, artifact_root=home / "mlartifacts"),
        "deploy": store.create_token("d", ["deploy"]),
        "infer": store.create_token("i", ["infer"]),
        "openai": f"http://127.0.0.1:{os.environ['RAYPAI_SERVE_PORT']}/v1",
    }
    server.should_exit = True
    serve.shutdown()
    if before is None:
        os.environ.pop("RAYPAI_SERVE_PORT", None)
    else:
        os.environ["RAYPAI_SERVE_PORT"] = before


def test_each_family_deploys_and_answers_the_openai_api_stopping_at_its_end_token(family, grpo, serving_stack):
    """The GRPO model, registered from its exported folder, deployed through the deploy API, queried
    with `openai`."""
    import openai

    version = serving_stack["tracker"].register_model(grpo["dir"], f"fam-{family['name']}")
    r = httpx.post(
        f"{serving_stack['api']}/api/v1/deployments",
        timeout=300,
        headers={"Authorization": f"Bearer {serving_stack['deploy']}"},
        json={"name": family["name"], "model": f"fam-{family['name']}", "version": version},
    )
    assert r.status_code == 201, r.text
    client = openai.OpenAI(base_url=serving_stack["openai"], api_key=serving_stack["infer"])
    if CHAT[family["name"]]:
        out = client.chat.completions.create(
            model=family["name"], messages=[{"role": "user", "content": "2+3="}], max_tokens=8, temperature=0
        )
        text, reason = out.choices[0].message.content, out.choices[0].finish_reason
    else:
        out = client.completions.create(model=family["name"], prompt="2+3=", max_tokens=8, temperature=0)
        text, reason = out.choices[0].text, out.choices[0].finish_reason
    assert reason == "stop" and out.usage.completion_tokens < 8, out  # stopped at the end token
    assert family["end"] not in text and text.strip().isdigit(), text
