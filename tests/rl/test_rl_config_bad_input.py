"""Bad config input of every kind fails before anything starts, as one line naming the key: never a
traceback, never a hang (issue 36's probe), and an accepted config survives config.yaml's round trip."""
from __future__ import annotations

import threading
import time
import typing
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel
from typer.testing import CliRunner

from policy.config import ModelConfig
from rl.cli import app
from rl.config import ConfigError, RunConfig, dump_config, load_config

BASE = {"envs": [{"name": "math"}], "eval": {"efforts": ["low", "max"]},
        "logging": {"wandb_mode": "disabled", "progress": False}}


def write(tmp_path: Path, tree: dict | None = None, text: str | None = None, data: bytes | None = None) -> Path:
    path = tmp_path / "c.yaml"
    if data is None:
        data = (text if text is not None else yaml.safe_dump(tree if tree is not None else BASE)).encode()
    path.write_bytes(data)
    return path


def refused(path: Path, overrides: list[str] | None = None) -> str:
    """The one line load_config refuses the config with."""
    with pytest.raises(ConfigError) as err:
        load_config(path, overrides or [])
    message = str(err.value)
    assert message.startswith("config error: ") and len(message.splitlines()) == 1, message
    return message


@pytest.mark.parametrize(("overrides", "expected"), [
    # booleans are not numbers
    (["train.lr=true"], "'train.lr': Input should be a number, not a boolean, got True"),
    (["rollout.num_workers=false"], "'rollout.num_workers': Input should be a number, not a boolean"),
    (["effort.budgets.low=true"], "'effort.budgets': Input should be a number, not a boolean"),
    (["train.betas=[true, 0.99]"], "'train.betas': Input should be a number, not a boolean"),
    # inf and nan are not settings
    (["train.lr=.nan"], "'train.lr': Input should be a finite number"),
    (["rollout.temperature=.inf"], "'rollout.temperature': Input should be a finite number"),
    (["train.grad_clip=.inf"], "'train.grad_clip': Input should be a finite number"),
    (["rollout.cache_gib=.inf"], "'rollout.cache_gib': Input should be a finite number"),
    (["train.off_policy.is_band=[0.5, .inf]"], "'train.off_policy.is_band.1': Input should be a finite number"),
    # counts have an upper bound
    (["rollout.groups_per_step=1000000000000000000000000000000"], "'rollout.groups_per_step': Input should be "
                                                                  "less than or equal to 1048576"),
    (["train.steps=1000000000000000000000000000000"], "'train.steps': Input should be less than or equal to"),
    (["seed=1000000000000000000000000000000"], "'seed': Input should be less than 4294967296"),
    (["rollout.max_context=100000000000"], "'rollout.max_context': Input should be less than or equal to 16777216"),
    # probabilities and fractions stay in range
    (["train.betas=[0.9, 1.5]"], "'train.betas.1': Input should be less than 1, got 1.5"),
    (["train.betas=[-0.1, 0.99]"], "'train.betas.0': Input should be greater than or equal to 0"),
    (["train.eps_low=1.5"], "'train.eps_low': Input should be less than 1"),
    # effort budgets and weights
    (["effort.budgets.low=0"], "'effort.budgets.low': Input should be greater than 0, got 0"),
    (["effort.budgets.high=-3"], "'effort.budgets.high': Input should be greater than 0, got -3"),
    (["effort.weights={low: 0, medium: 0, high: 0, max: 0}"], "at least one level needs a weight > 0"),
    (["effort.weights.low=-1"], "'effort.weights.low': Input should be greater than or equal to 0"),
    (["eval.efforts=[]"], "'eval.efforts': List should have at least 1 item"),
    (["eval.efforts=[low, low]"], "'eval.efforts': an effort level is listed twice"),
    # the model: a preset that exists, overrides of fields it has, of their types, making a valid model
    (["model.preset=nonexistent"], "'model.preset': unknown preset 'nonexistent'; known: toy, small,"),
    (["model.overrides.hiden_size=64"], "'model.overrides': unknown model field 'hiden_size'; did you mean "
                                        "'hidden_size'?"),
    (["model.overrides.hidden_size=true"], "'model.overrides': 'hidden_size': Input should be a valid integer"),
    (["model.overrides.rms_norm_eps=.nan"], "'model.overrides': 'rms_norm_eps': Input should be a finite number"),
    (["model.overrides.num_hidden_layers=1000000000000"], "'num_hidden_layers': should be at most 1,048,576"),
    (["model.overrides.num_experts_per_token=99"], "model.overrides make no valid model: ModelConfig: "
                                                   "num_experts_per_token must be in [1, num_experts=8], got 99"),
    (["model.overrides.vocab_size=1000"], "'vocab_size' is the tokenizer's: set model.vocab_size"),
    # the run name is one folder inside output_dir, of a length a file system takes
    (["name=../../escaped"], "'name': a run name is 1 to 64 letters"),
    (["name=a/b"], "'name': a run name is 1 to 64 letters"),
    (["name=" + "x" * 300], "'name': a run name is 1 to 64 letters"),
    # environment kwargs are plain data
    (["envs.0.kwargs.n_train=.inf"], "'envs.0.kwargs': 'n_train' should be a finite number, got inf"),
    (["envs.0.kwargs.when=2024-01-01"], "'envs.0.kwargs': 'when' holds a date, not a config value"),
    # overrides that index into a value
    (["eval.efforts.0.x=1"], "config error: 'eval.efforts.0' is a value, not a section"),
    (["envs.²=1"], "config error: 'envs.²' is not an index of the list"),
    (["envs.0." + ".".join(["a"] * 40) + "=1"], "is nested deeper than 32 levels"),
])
def test_bad_values_are_one_line_naming_the_key(tmp_path, overrides, expected):
    assert expected in refused(write(tmp_path), overrides)


def test_a_file_that_is_not_utf8(tmp_path):
    message = refused(write(tmp_path, data=b"envs:\n  - name: m\xe4th\n"))
    assert message.endswith("is not UTF-8 text (byte 0xe4 at offset 17)")


def test_an_empty_file_and_one_without_environments(tmp_path):
    assert refused(write(tmp_path, text="")).endswith("is empty; a run config lists at least its envs")
    assert refused(write(tmp_path, text="# only a comment\n")).endswith("is empty; a run config lists at least its envs")
    assert refused(write(tmp_path, tree={"train": {"steps": 1}})) == (
        "config error: 'envs' is required: list the environments to train on")


def test_deep_yaml_is_refused_not_a_recursion_error(tmp_path):
    deep = "envs: [{name: math, kwargs: {x: " + "[" * 500 + "]" * 500 + "}}]\n"
    assert refused(write(tmp_path, text=deep)).endswith("is nested deeper than 32 levels")
    assert "nested deeper than 32" in refused(write(tmp_path), ["envs.0.kwargs.x=" + "[" * 500 + "]" * 500])


def test_an_anchor_bomb_is_refused_before_it_expands(tmp_path):
    lines = ["a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 10)]
    bomb = "envs:\n  - name: math\n    kwargs:\n" + "".join(f"      {line}\n" for line in lines)  # 10^10 values
    started = time.monotonic()
    assert refused(write(tmp_path, text=bomb)).endswith("holds more than 100,000 values once its aliases are expanded")
    assert time.monotonic() - started < 5
    loop = "envs:\n  - name: math\n    kwargs: {x: &x [1, *x]}\n"
    assert refused(write(tmp_path, text=loop)).endswith("holds an alias to a node that contains it")
    # aliases that stay small are YAML's own sharing and fine
    shared = "envs:\n  - name: math\n    kwargs: &k {n_train: 20}\n  - name: lookup\n    kwargs: *k\n"
    assert load_config(write(tmp_path, text=shared)).envs[1].kwargs == {"n_train": 20}


def test_yaml_values_python_cannot_read(tmp_path):
    assert "holds a value YAML cannot read: Exceeds the limit (4300 digits)" in refused(
        write(tmp_path, text="envs: [{name: math}]\nseed: " + "9" * 5000 + "\n"))
    assert "holds a value YAML cannot read: month must be in 1..12" in refused(
        write(tmp_path, text="envs: [{name: math}]\nname: 2024-13-45\n"))
    # as an override, such text is a string, refused by the field it names
    assert "'seed': Unable to parse input string as an integer" in refused(write(tmp_path), ["seed=" + "9" * 5000])


def test_keys_with_line_breaks_stay_one_line(tmp_path):
    assert refused(write(tmp_path, tree={**BASE, "tra\nin": 1})) == "config error: unknown key 'tra\\nin'"
    assert refused(write(tmp_path, tree={**BASE, "x\u2028y": 1})) == "config error: unknown key 'x\\u2028y'"


def test_every_count_has_an_upper_bound():
    """A new integer field without `le` would take 10^30 again."""
    def ints(model: type[BaseModel], prefix: str = ""):
        for name, field in model.model_fields.items():
            ann = field.annotation
            inner = [a for a in typing.get_args(ann) if isinstance(a, type) and issubclass(a, BaseModel)]
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                yield from ints(ann, f"{prefix}{name}.")
            elif inner:
                yield from ints(inner[0], f"{prefix}{name}.0.")
            elif ann in (int, int | None):
                bounded = any(hasattr(m, "le") or hasattr(m, "lt") for m in field.metadata)
                yield f"{prefix}{name}", bounded

    found = dict(ints(RunConfig))
    assert "train.steps" in found and "envs.0.weight" not in found
    assert [key for key, bounded in found.items() if not bounded] == []


# ---- environments: checked against their constructors, before Ray -------------------------------------

@pytest.fixture
def no_ray(monkeypatch):
    """Any start of Ray fails the test."""
    import ray

    def refuse(*args, **kwargs):
        raise AssertionError("Ray was started for a config that should have been refused")

    monkeypatch.setattr(ray, "init", refuse)


@pytest.mark.parametrize(("kwargs", "expected"), [
    ({"bogus_kw": 1}, "config error: 'envs.0.kwargs': environment 'math' takes no argument 'bogus_kw'; it takes: "
                      "kind, max_operand,"),
    ({"n_trian": 40}, "takes no argument 'n_trian'; did you mean 'n_train'?"),
    ({"kind": "nonsense"}, "config error: 'envs.0.kwargs': environment 'math' refuses these kwargs: ValueError: "
                           "math: unknown kind 'nonsense'"),
    ({"n_train": True}, "config error: 'envs.0.kwargs': environment 'math': 'n_train' must be int, got True"),
    ({"n_train": "40"}, "'n_train' must be int, got '40'"),
    ({"data_files": 3}, "'data_files' must be str | None, got 3"),
])
def test_environment_kwargs_are_checked_against_the_constructor(tmp_path, no_ray, kwargs, expected):
    from rl.trainer import train

    config = write(tmp_path, {**BASE, "output_dir": str(tmp_path / "runs"), "envs": [{"name": "math", "kwargs": kwargs}]})
    with pytest.raises(ConfigError) as err:
        train(str(config), [])
    assert expected in str(err.value) and len(str(err.value).splitlines()) == 1
    assert not (tmp_path / "runs").exists()


def test_an_output_dir_that_cannot_hold_a_run_folder(tmp_path, no_ray):
    from rl.trainer import train

    (tmp_path / "a-file").write_text("")
    config = write(tmp_path, {**BASE, "output_dir": str(tmp_path / "a-file" / "runs")})
    with pytest.raises(ConfigError, match=r"^config error: 'output_dir': cannot make a run folder in .*: Not a directory$"):
        train(str(config), [])


# ---- through the command line ----------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "args", "expected"), [
    ("", [], "is empty; a run config lists at least its envs"),
    ("envs: [{name: math}]\n", ["model.preset=nonexistent"], "'model.preset': unknown preset 'nonexistent'"),
    ("envs: [{name: math, kwargs: {bogus_kw: 1}}]\n", [], "environment 'math' takes no argument 'bogus_kw'"),
    ("envs: [{name: math}]\n'[/x]': 1\n", [], "config error: unknown key '[/x]'"),  # text, not rich markup
])
def test_rl_train_refuses_a_bad_config_in_one_line_without_ray(tmp_path, no_ray, text, args, expected):
    config = write(tmp_path, text=text)
    started = time.monotonic()
    result = CliRunner().invoke(app, ["train", str(config), *args])
    assert result.exit_code == 2, result.output
    lines = result.output.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: config error: ") and expected in lines[0], lines
    assert time.monotonic() - started < 30


# ---- fuzzing the loader -------------------------------------------------------------------------------------

def _schema_keys(model: type[BaseModel] = RunConfig, prefix: str = "") -> list[str]:
    keys = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        inner = [a for a in typing.get_args(ann) if isinstance(a, type) and issubclass(a, BaseModel)]
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            keys += _schema_keys(ann, f"{prefix}{name}.")
        elif inner:
            keys += _schema_keys(inner[0], f"{prefix}{name}.0.")
        keys.append(prefix + name)
    return keys


KEYS = _schema_keys() + [f"effort.{part}.{lvl}" for part in ("budgets", "weights") for lvl in ("low", "max", "x")] + [
    f"model.overrides.{name}" for name in list(ModelConfig.__dataclass_fields__)[:12]] + [
    f"envs.0.kwargs.{name}" for name in ("kind", "n_train", "max_operand", "bogus")] + ["envs.1.name", "eval.efforts.0"]
WORDS = ["toy", "math", "lookup", "low", "max", "native", "vllm", "token", "learner", "auto", "process", "run", "..",
         "a/b", "", "nonexistent", "&a", "*a", "!!binary", "{", "[", "]", "\x85", "\u2028", "[/x]", "1e400", "0x1F"]
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-10**40, 10**40), st.integers(-3, 70),
                    st.floats(allow_nan=True, allow_infinity=True), st.floats(0, 1), st.sampled_from(WORDS),
                    st.text(max_size=12))
VALUES = st.recursive(SCALARS, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(
    st.sampled_from(WORDS) | st.text(max_size=6), kids, max_size=4), max_leaves=16)
KEY = st.sampled_from(KEYS) | st.text(max_size=20) | st.lists(st.sampled_from(KEYS + WORDS), min_size=1,
                                                                 max_size=4).map(".".join)


def _put(tree: dict, dotted: str, value) -> None:
    """Set a dotted key in a nested tree where the path allows it (junk paths are dropped)."""
    node, parts = tree, dotted.split(".")
    for part in parts[:-1]:
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        elif isinstance(node, dict):
            node = node.setdefault(part, {})
        if not isinstance(node, (dict, list)):
            return
    if isinstance(node, dict):
        node[parts[-1]] = value


@st.composite
def config_files(draw) -> bytes:
    tree = {} if draw(st.integers(0, 5)) == 0 else {"envs": [{"name": draw(st.sampled_from(["math", "lookup", "mth"]))}]}
    for key, value in draw(st.lists(st.tuples(KEY, VALUES), max_size=4)):
        _put(tree, key, value)
    text = yaml.safe_dump(tree, allow_unicode=draw(st.booleans()))
    how = draw(st.sampled_from(["yaml", "yaml", "yaml", "spliced", "text", "bytes"]))
    if how == "spliced":  # junk at a random place of valid YAML
        at = draw(st.integers(0, len(text)))
        text = text[:at] + draw(st.sampled_from(WORDS) | st.text(max_size=8)) + text[at:]
    elif how == "text":
        text = draw(st.text(alphabet=st.sampled_from(list("abc: -[]{}&*!#'\"\n\t0123456789.,|>%@`?")), max_size=80))
    return draw(st.binary(max_size=60)) if how == "bytes" else text.encode()


def _override(key: str, value, raw: str | None) -> str:
    if raw is None:
        raw = yaml.safe_dump(value, default_flow_style=True, width=10**6).removesuffix("\n...\n").strip()
    return f"{key}={raw}"


OVERRIDES = st.lists(st.builds(_override, KEY, VALUES, st.none() | st.sampled_from(WORDS) | st.text(max_size=10)),
                     max_size=4)


# the deadline bounds a slow example (they take milliseconds; a loaded machine must not make it flaky),
# the thread's join a hung one
@settings(max_examples=300, deadline=5000, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=config_files(), overrides=OVERRIDES)
def test_fuzz_load_config_returns_a_config_or_one_line(tmp_path, data, overrides):
    path, outcome = tmp_path / "fuzz.yaml", {}
    path.write_bytes(data)

    def load() -> None:
        try:
            outcome["config"] = load_config(path, overrides)
        except Exception as exc:  # noqa: BLE001 - the property: only ConfigError comes out
            outcome["error"] = exc

    worker = threading.Thread(target=load, daemon=True)  # a hang fails the example instead of the run
    worker.start()
    worker.join(timeout=20)
    assert not worker.is_alive(), f"load_config hung on {data!r} {overrides!r}"
    error = outcome.get("error")
    if error is not None:
        assert type(error) is ConfigError, repr(error)
        assert str(error).startswith("config error: ") and len(str(error).splitlines()) == 1, str(error)
        return
    config = outcome["config"]
    assert isinstance(config, RunConfig)
    dump_config(config, tmp_path / "saved.yaml")  # what --resume reads back
    assert load_config(tmp_path / "saved.yaml") == config
