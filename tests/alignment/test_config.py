"""Typed configs: every problem reported at once, before any actor starts (no Ray needed)."""

import pytest
import torch

from raypai.alignment import DPOConfig, GRPOConfig, PPOConfig
from raypai.alignment import config as C
from raypai.errors import ConfigError


def test_grpo_config_lists_every_problem_with_its_fix():
    with pytest.raises(ConfigError) as err:
        GRPOConfig(group_size=1, aggregation="mean", rollout_engine="sglang", clip_eps=2).validate()
    assert len(err.value.problems) == 4
    text = str(err.value)
    assert "group_size must be > 1 (got 1): with one sample per prompt every advantage is 0" in text
    assert "aggregation 'mean' is unknown; choose one of grpo, bnpo, dr_grpo, dapo" in text
    assert "rollout_engine 'sglang' is unknown; choose one of raypai, hf, vllm" in text
    assert "clip_eps must be in (0, 1) (got 2)" in text


def test_dpo_ppo_and_file_configs_are_checked():
    with pytest.raises(ConfigError) as err:
        DPOConfig(loss_type="kto", label_smoothing=0.5, online=True, num_samples=1).validate()
    assert len(err.value.problems) == 3 and "choose one of sigmoid, ipo, hinge" in str(err.value)
    with pytest.raises(ConfigError, match="gamma and lam must be in"):
        PPOConfig(lam=1.5).validate()
    with pytest.raises(
        ConfigError, match="unknown option 'lr_rate'; valid options: steps, batch_size, checkpoint_every, lr,"
    ):
        C.from_dict("sft", {"lr_rate": 1})
    with pytest.raises(ConfigError, match="unknown algorithm 'ppo2'; choose one of sft, reward_model"):
        C.from_dict("ppo2", {})
    assert C.from_dict("online_dpo", {"steps": 3}).online is True
    assert C.from_dict("ppo", {"kl_coef": 0.1}).kl_coef == 0.1


def test_align_cli_rejects_a_bad_config_file_before_ray_starts(tmp_path):
    import ray

    from raypai.alignment.cli import align_command

    cfg = tmp_path / "grpo.yaml"
    cfg.write_text("group_size: 1\nlearning_rate: 0.1\n")
    with pytest.raises(ConfigError) as err:
        align_command("grpo", tmp_path / "model", tmp_path / "out", config=cfg)
    assert len(err.value.problems) == 2  # the unknown option and the bad value, together
    assert "unknown option 'learning_rate'" in str(err.value) and "group_size must be > 1" in str(err.value)
    assert not ray.is_initialized()


def test_numbers_written_as_text_are_read_and_wrong_types_named(tmp_path):
    """PyYAML reads `lr: 3e-3` (no dot) as a string; --config files in JSON or YAML both give floats."""
    import yaml

    from raypai.alignment.cli import _read_config
    from raypai.alignment.config import from_dict

    (tmp_path / "a.json").write_text('{"steps": 40, "lr": 3e-3}')
    (tmp_path / "a.yaml").write_text("steps: 40\nlr: 3e-3\n")
    assert yaml.safe_load((tmp_path / "a.yaml").read_text())["lr"] == "3e-3"  # the quirk this guards against
    for name in ("a.json", "a.yaml"):
        cfg = from_dict("sft", _read_config(tmp_path / name))
        assert cfg.lr == 0.003 and isinstance(cfg.lr, float) and cfg.steps == 40
    with pytest.raises(ConfigError) as err:
        from_dict("sft", {"steps": "many", "lr": [1], "truncation": 3, "batch_size": 2.5})
    assert set(err.value.problems) == {
        "steps must be int (got str 'many')",
        "lr must be float (got list [1])",
        "truncation must be str (got int 3)",
        "batch_size must be int (got float 2.5)",
    }
    assert "sft config (SFTConfig)" in str(err.value)  # which config the problems belong to
    (tmp_path / "bad.yaml").write_text("- steps\n- 3\n")
    with pytest.raises(ConfigError, match="expected a mapping of options"):
        _read_config(tmp_path / "bad.yaml")


def test_gpu_requests_a_role_cannot_use_are_refused_naming_the_role_and_the_fix():
    """A role is one process on one device: more than one GPU for a role is refused, naming it,
    before anything is reserved (no Ray needed); a GRPO config asks for a share of one GPU, and not
    with async rollout (rollout and update would run at once on one device); a role placed with a
    GPU whose torch sees none says so, naming the role and the fix."""
    from raypai.alignment.config import GRPOConfig
    from raypai.alignment.placement import Placement, RoleSpec
    from raypai.alignment.roles._device import role_device

    with pytest.raises(ConfigError) as err:
        Placement(
            "gpu-test",
            {
                "policy": RoleSpec(cpus=1, gpus=2),
                "rollout": RoleSpec(cpus=0.5, gpus=0.5),
                "reward": RoleSpec(cpus=0.25),
            },
        )
    assert err.value.problems == [
        "role 'policy' asks for 2 GPUs: a role runs in one process on one device, so give "
        "it at most 1 (a fraction shares one GPU)"
    ]
    with pytest.raises(ConfigError, match=r"GRPOConfig.gpus must be a share of one GPU in \[0, 1\] or a whole number"):
        GRPOConfig(gpus=2.5).validate()
    with pytest.raises(
        ConfigError, match=r"GRPOConfig.placement 'spread' is unknown; choose one of colocated, separate"
    ):
        GRPOConfig(gpus=2, placement="spread").validate()
    assert GRPOConfig(gpus=8, placement="separate").validate().gpu_share == 1.0
    with pytest.raises(ConfigError, match="gpus with async_rollout=True is not supported"):
        GRPOConfig(gpus=1, async_rollout=True).validate()
    assert GRPOConfig(gpus=0.5).validate().gpus == 0.5
    if not torch.cuda.is_available():  # the message a CPU-only torch gives a GPU-placed role
        with pytest.raises(
            ConfigError,
            match="role 'rollout' was placed with a GPU, but torch in its actor sees "
            "no CUDA device .*install a CUDA build of torch",
        ):
            role_device("cuda", "rollout")
    assert role_device("cpu", "rollout").type == "cpu"


def test_compile_rollout_is_refused_with_an_engine_it_does_not_compile():
    from raypai.alignment.config import DPOConfig, GRPOConfig, PPOConfig

    for cls in (GRPOConfig, PPOConfig, DPOConfig):
        with pytest.raises(
            ConfigError,
            match=rf"{cls.__name__}.compile_rollout compiles raypai's own decoding step; "
            r"it does not apply to rollout_engine 'hf' \(set rollout_engine='raypai'",
        ):
            cls(compile_rollout=True, rollout_engine="hf").validate()
        assert cls(compile_rollout=True).validate().compile_rollout


def test_the_vllm_engine_without_vllm_names_the_install(tmp_path, monkeypatch):
    import sys

    from raypai.alignment.config import GRPOConfig
    from raypai.alignment.roles.rollout import Rollout
    from raypai.alignment.tasks.tiny import build_tiny_model

    assert GRPOConfig(rollout_engine="vllm").validate().rollout_engine == "vllm"
    path = build_tiny_model(tmp_path / "m", family="qwen2")
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` fails here, whether or not it is installed
    with pytest.raises(
        ConfigError,
        match=r"rollout_engine='vllm' needs vLLM in the rollout's environment: "
        r"pip install 'raypai\[vllm\]'",
    ):
        Rollout(path, engine="vllm")


def test_the_configs_import_without_torch_and_check_the_losses_names():
    """Building a config (every pipeline definition does) imports no torch; validating one checks the
    names the losses implement."""
    import subprocess
    import sys

    from raypai.alignment import config, losses

    for name in losses.DPO_LOSSES:
        config.DPOConfig(loss_type=name).validate()
    for name in losses.AGGREGATIONS:
        config.GRPOConfig(aggregation=name).validate()
    with pytest.raises(ConfigError, match="loss_type 'kto' is unknown; choose one of sigmoid, ipo, hinge"):
        config.DPOConfig(loss_type="kto").validate()
    code = "import sys, raypai.alignment.config; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


def test_a_config_is_checked_once_where_it_is_built_and_validate_does_not_check_again():
    """The checks of every part run in __post_init__, once per config built: reading a mapping
    (`from_dict`'s path) builds it once, `validate()` and the steps hand it on as it is; only
    building a config (here `dataclasses.replace`) checks it."""
    import dataclasses

    from raypai.alignment.steps import _cfg
    from raypai.config import parse_config

    calls = []

    class Counted(GRPOConfig):
        def _problems(self):
            calls.append(self)
            return []

    cfg = parse_config(Counted, {"steps": "3", "group_size": 4}, what="t")
    assert len(calls) == 1 and cfg.steps == 3 and cfg.group_size == 4
    assert cfg.validate() is cfg and _cfg("grpo", cfg) is cfg and len(calls) == 1
    object.__setattr__(cfg, "group_size", 1)  # changed behind its back: validate() does not look again
    assert cfg.validate() is cfg
    with pytest.raises(ConfigError, match="group_size must be > 1"):
        dataclasses.replace(cfg)
    assert len(calls) == 2


def test_the_parts_check_their_fields_in_every_config_and_keep_the_flat_api():
    """Each shared field is checked by its part, whichever config it is in, and all problems come
    together; users still write flat fields, and each algorithm keeps its own defaults."""
    with pytest.raises(ConfigError) as err:
        C.SFTConfig(steps=0, lr=0, truncation="cut", gpus=1.5, log_every=0)
    assert [p.split(" ")[0] for p in err.value.problems] == [
        "SFTConfig.steps",
        "SFTConfig.lr",
        "SFTConfig.truncation",
        "SFTConfig.gpus",
        "SFTConfig.log_every",
    ]
    for cls in (C.DPOConfig, C.GRPOConfig, C.PPOConfig):
        with pytest.raises(ConfigError) as err:
            cls(max_new_tokens=0, temperature=-1, top_p=0, zero_stage=4)
        assert len(err.value.problems) == 4, err.value.problems
        assert f"{cls.__name__}.max_new_tokens must be > 0 (got 0)" in str(err.value)
        assert cls().max_new_tokens == C.MAX_NEW_TOKENS  # the one default of the setting
    cfg = GRPOConfig(steps=3, lr=1e-3, max_new_tokens=4)
    assert (cfg.steps, cfg.lr, cfg.max_new_tokens, cfg.group_size) == (3, 1e-3, 4, 8)
    defaults = {
        C.SFTConfig: {"steps": 200, "batch_size": 16, "lr": 1e-3},
        C.RewardModelConfig: {"steps": 300, "batch_size": 32, "lr": 5e-4},
        C.DPOConfig: {"steps": 100, "batch_size": 8, "lr": 5e-4},
        C.GRPOConfig: {"steps": 30, "prompts_per_step": 8, "reward_model_weight": 0.0},
        C.PPOConfig: {"steps": 30, "prompts_per_step": 16, "reward_model_weight": 1.0},
    }
    for cls, values in defaults.items():
        assert {k: getattr(cls(), k) for k in values} == values, cls.__name__


def test_from_dict_and_the_steps_read_the_algorithm_registry():
    """One table of algorithms: an unknown name lists exactly its names; each row's config is what
    from_dict and the step build; online DPO's row sets online=True on whatever it is given."""
    import inspect

    from raypai.alignment import steps
    from raypai.alignment.algorithms import ALGORITHMS, get
    from raypai.alignment.roles.rollout import Rollout

    names = ", ".join(ALGORITHMS)
    assert names == "sft, reward_model, grpo, ppo, dpo, online_dpo"
    for call in (lambda: C.from_dict("rlhf", {}), lambda: steps._cfg("rlhf", None), lambda: get("rlhf")):
        with pytest.raises(ConfigError) as err:
            call()
        assert err.value.problems == [f"unknown algorithm 'rlhf'; choose one of {names}"]
    for name, row in ALGORITHMS.items():
        assert type(C.from_dict(name, {})) is row.config and type(steps._cfg(name, None)) is row.config
        step = row.load_step()
        assert step.name == name and step is getattr(steps, name)
    assert steps._cfg("online_dpo", DPOConfig()).online and C.from_dict("online_dpo", {}).online
    with pytest.raises(ConfigError, match="the grpo step takes a GRPOConfig or a dict of its fields"):
        steps._cfg("grpo", DPOConfig())
    # max_new_tokens has one default, the config's: the evaluate step reads it, the rollout has none
    assert inspect.signature(steps.evaluate.fn).parameters["max_new_tokens"].default == C.MAX_NEW_TOKENS
    assert inspect.signature(Rollout.generate).parameters["max_new_tokens"].default is inspect.Parameter.empty
