"""The user's data, rewards and model folders: formats, sources, and one clear error per bad input,
raised before any actor starts (the reward's own output is checked at the first step)."""

import json
import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raypai.alignment import GRPOConfig, SFTConfig, run_grpo, run_sft
from raypai.alignment.data import load, load_rows, preference_examples, prompt_examples, sft_examples, split
from raypai.alignment.rewards import RewardError, check_output, resolve
from raypai.alignment.tasks import arithmetic as ar
from raypai.alignment.tasks.tiny import build_tiny_model
from raypai.chat import ChatFormat
from raypai.errors import ConfigError, DataError


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("g") / "m", family="gpt2", hidden=32, layers=1, context=32)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("q") / "m", family="qwen2", hidden=32, layers=1)


def test_formats_and_sources(tmp_path):
    chats = [
        {
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"},
            ]
        }
    ]
    ar.write_jsonl(chats, tmp_path / "a.jsonl")
    pq.write_table(pa.Table.from_pylist([{"prompt": "1+1=", "completion": "2"}]), tmp_path / "b.parquet")
    rows = load_rows(tmp_path)  # a folder of JSONL + Parquet
    ex = sft_examples(rows)
    assert ex[0].messages[2]["content"] == "hello" and ex[1].prompt == "1+1=" and ex[1].completion == "2"
    # the implicit prompt: chosen/rejected conversations sharing their opening turns
    user = {"role": "user", "content": "2+2="}
    [p] = preference_examples(
        [
            {
                "chosen": [user, {"role": "assistant", "content": "4"}],
                "rejected": [user, {"role": "assistant", "content": "5"}],
            }
        ]
    )
    assert p.prompt == [user] and p.chosen[0]["content"] == "4" and p.rejected[0]["content"] == "5"
    [q] = prompt_examples([{"prompt": "3+4=", "answer": 7, "tests": ["x"]}])
    assert q.extras == {"answer": 7, "tests": ["x"]}
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list([{"prompt": "a", "completion": "b"}] * 3).save_to_disk(str(tmp_path / "hf"))
    assert len(load(tmp_path / "hf", "sft")) == 3
    train, held = split(list(range(10)), 0.2, seed=1)
    assert (
        len(held) == 2 and sorted(train + held) == list(range(10)) and split(list(range(10)), 0.2, 1) == (train, held)
    )


@pytest.mark.parametrize(
    "rows, kind, match",
    [
        ([{"text": "x", "label": 1}], "sft", r"has columns \['label', 'text'\].*accepted: \{'messages'"),
        ([{"question": "q"}], "prompt", r"has columns \['question'\].*'prompt'"),
        ([{"prompt": "p", "chosen": "c"}], "preference", r"has columns \['chosen', 'prompt'\].*'rejected'"),
        ([{"prompt": 3, "completion": "x"}], "sft", r"row 0: prompt must be a string or a list of"),
        ([{"messages": [{"role": "user", "content": "hi"}]}], "sft", r"row 0: `messages` needs at least one assistant"),
        ([{"prompt": "p", "completion": [{"role": "assistant", "content": "c"}]}], "sft", "both be strings"),
        ([], "sft", "is empty"),
        (
            [{"prompt": "a", "answer": 1}, {"prompt": "b"}],
            "prompt",
            r"row 1 has extra columns \[\], row 0 has \['answer'\]",
        ),
    ],
)
def test_bad_rows_get_one_clear_error(rows, kind, match):
    with pytest.raises(DataError, match=match):
        load(rows, kind)


def test_bad_json_line_and_missing_file(tmp_path):
    (tmp_path / "x.jsonl").write_text('{"prompt": "a"}\n{not json\n')
    with pytest.raises(DataError, match=r"x.jsonl:2 is not valid JSON"):
        load_rows(tmp_path / "x.jsonl")
    with pytest.raises(DataError, match="does not exist"):
        load_rows(tmp_path / "nope.jsonl")


def test_reward_import_paths_and_output_checks(tmp_path, monkeypatch):
    (tmp_path / "myrew.py").write_text("def good(prompts, completions, **_):\n    return [1.0] * len(completions)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    [(fn, w)] = resolve(["myrew:good=0.5"])
    assert fn.__name__ == "good" and w == 0.5
    with pytest.raises(ConfigError, match=r"module 'no_such_mod' does not import"):
        resolve(["no_such_mod:f"])
    with pytest.raises(ConfigError, match=r"myrew has no function 'bad'; callables there: good"):
        resolve(["myrew:bad"])
    with pytest.raises(ConfigError, match="weight after '=' must be a number"):
        resolve(["myrew:good=heavy"])
    with pytest.raises(RewardError, match=r"reward good returned 1 values for 2 completions"):
        check_output(fn, [1.0], ["a", "b"], ["x", "y"])
    with pytest.raises(RewardError, match=r"reward good returned nan for sample 1 \(prompt 'b'"):
        check_output(fn, [1.0, math.nan], ["a", "b"], ["x", "y"])


def test_model_and_format_errors_come_before_any_actor(tmp_path, gpt2, qwen):
    chats = sft_examples(ar.sft_rows(ar.problems()[:4], chat=True))
    # a conversational dataset on a tokenizer without a chat template
    with pytest.raises(DataError, match="conversational .* has no chat template"):
        run_sft(gpt2, str(tmp_path / "o"), chats, chats, SFTConfig(steps=1))
    # a folder that is not a causal LM, and one that is no model at all
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertModel"]}))
    with pytest.raises(ConfigError, match="'bert' model .* not a causal language model"):
        run_sft(str(tmp_path / "bert"), str(tmp_path / "o"), chats, chats, SFTConfig(steps=1))
    with pytest.raises(ConfigError, match="not a Hugging Face model folder"):
        run_sft(str(tmp_path), str(tmp_path / "o"), chats, chats, SFTConfig(steps=1))
    # over the context (32 tokens): refused by default, naming the example; counted when truncating
    long = sft_examples([{"prompt": "1+1=" * 20, "completion": "2"}])
    with pytest.raises(DataError, match="training example 0 is .* tokens, longer than the context of 32"):
        run_sft(gpt2, str(tmp_path / "o"), long, long, SFTConfig(steps=1))
    fmt = ChatFormat.from_pretrained(gpt2)
    long_prompts = prompt_examples([{"prompt": "1+1=" * 20, "answer": 2}])
    with pytest.raises(DataError, match="training prompt 0 is .* exceeds the context of 32"):
        run_grpo(
            gpt2, str(tmp_path / "o"), long_prompts, long_prompts, GRPOConfig(steps=1), rewards=[ar.exact_match_reward]
        )
    with pytest.raises(ConfigError, match="GRPO needs a reward"):
        run_grpo(qwen, str(tmp_path / "o"), long_prompts, long_prompts, GRPOConfig(steps=1))
    assert fmt.stop_ids == (fmt.tok.eos_token_id,)


def test_a_reward_that_breaks_is_named_at_the_first_step(ray_plain, qwen, tmp_path):
    prompts = prompt_examples(ar.prompt_rows(ar.problems()[:8]))

    def nan_on_second(prompts, completions, answer, **_):
        return [math.nan if i == 1 else 0.0 for i in range(len(completions))]

    with pytest.raises(
        RewardError,
        match=r"reward nan_on_second returned nan for sample 1 \(prompt \"\[\{'role': 'user', 'content': '0\+1='",
    ):
        run_grpo(
            qwen,
            str(tmp_path / "o"),
            prompts,
            prompts,
            GRPOConfig(steps=2, prompts_per_step=2, group_size=2),
            rewards=[nan_on_second],
            run_name="t-bad-reward",
        )

    def strips(prompts, completions, answer, **_):  # written for plain strings; conversational data gives messages
        return [float(c.strip() == a) for c, a in zip(completions, answer)]

    with pytest.raises(
        RewardError,
        match=r"reward strips raised AttributeError: 'list' object has no attribute "
        r"'strip'\. .*as lists of messages .*completion\[0\]\['content'\].*\['answer'\]",
    ):
        run_grpo(
            qwen,
            str(tmp_path / "o2"),
            prompts,
            prompts,
            GRPOConfig(steps=2, prompts_per_step=2, group_size=2),
            rewards=[strips],
            run_name="t-raising-reward",
        )
