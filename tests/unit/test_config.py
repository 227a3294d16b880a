import json

import pytest

from cemtool.config import (
    SCHEMA_VERSION,
    RunConfig,
    config_from_run_dict,
    describe_fields,
    from_dict,
    parse_override,
    replace,
    resolve,
    to_dict,
)
from cemtool.errors import ConfigError


def test_defaults_round_trip():
    cfg = resolve()
    assert cfg.model.arch == "baseline"
    assert config_from_run_dict(json.loads(json.dumps(to_dict(cfg)))) == cfg


def test_overrides_nested_and_typed():
    cfg = resolve(overrides=["model.d_model=64", "train.lr=1e-3", "model.tie_embeddings=false",
                             "model.heads=[2,2,2,2]", "model.cem.steps=3"])
    assert cfg.model.d_model == 64 and cfg.train.lr == 1e-3 and cfg.model.tie_embeddings is False
    assert cfg.model.heads == (2, 2, 2, 2) and cfg.model.cem.steps == 3


def test_file_then_set_precedence(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("[model]\nd_model = 96\nn_head = 3\n[train]\nlr = 0.01\n")
    cfg = resolve(file=f, overrides=["train.lr=0.02"])
    assert cfg.model.d_model == 96 and cfg.train.lr == 0.02
    j = tmp_path / "c.json"
    j.write_text(json.dumps({"model": {"d_model": 64}}))
    assert resolve(file=j).model.d_model == 64


@pytest.mark.parametrize("item, words", [
    ("model.bogus=1", ["unknown config key model.bogus"]),
    ("model.d_model=abc", ["model.d_model='abc'", "integer"]),
    ("model.norm=batchnorm", ["model.norm='batchnorm'", "rmsnorm", "layernorm"]),
    ("train.lr=-1", ["train.lr=-1.0", ">= 0"]),
    ("model.tie_embeddings=maybe", ["model.tie_embeddings", "true/false"]),
    ("nonsense", ["section.key=value"]),
])
def test_invalid_values_name_field_value_and_allowed(item, words):
    with pytest.raises(ConfigError) as e:
        resolve(overrides=[item])
    msg = str(e.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg


def test_cross_field_checks():
    with pytest.raises(ConfigError, match="does not divide"):
        resolve(overrides=["model.n_head=3"])
    with pytest.raises(ConfigError, match="expected model.n_layer"):
        resolve(overrides=["model.heads=[1,2]"])


def test_newer_schema_refused(tmp_path):
    d = to_dict(resolve())
    d["schema_version"] = SCHEMA_VERSION + 1
    with pytest.raises(ConfigError, match="newer"):
        config_from_run_dict(d)


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        resolve(file=tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        resolve(file=bad)


def test_every_field_documented():
    rows = describe_fields()
    assert len(rows) > 40
    for path, _tp, _default, help_ in rows:
        assert help_.strip(), f"{path} has no documentation"


def test_parse_override_json_values():
    assert parse_override("a.b=[1, 2]") == {"a": {"b": [1, 2]}}
    assert parse_override("a=x") == {"a": "x"}


def test_replace_dotted_and_frozen():
    cfg = RunConfig()
    new = replace(cfg, **{"model.d_model": 256})
    assert new.model.d_model == 256 and cfg.model.d_model == 128
    with pytest.raises(Exception):
        cfg.seed = 3  # frozen
    assert from_dict(RunConfig, {}) == RunConfig()


def _leaf_fields(cls=RunConfig, prefix=""):
    """(path, type, dataclass field) of every non-section field."""
    import dataclasses
    import typing

    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from _leaf_fields(hints[f.name], prefix + f.name + ".")
        else:
            yield prefix + f.name, hints[f.name], f


FLOAT_FIELDS = [p for p, tp, _ in _leaf_fields() if tp is float]
INT_FIELDS = [(p, f) for p, tp, f in _leaf_fields() if tp is int]


@pytest.mark.parametrize("path", FLOAT_FIELDS)
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "NaN", "Infinity", "1e999"])
def test_every_float_field_rejects_non_finite(path, value):
    """issue 10 item 9: train.lr=nan reached torch; every float field of every section must refuse nan/inf."""
    with pytest.raises(ConfigError, match="finite") as e:
        resolve(overrides=[f"{path}={value}"])
    assert path in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="finite"):  # a hand-edited config.json too
        config_from_run_dict(_nested(path, float("nan")))


def _nested(path, value):
    out = node = {}
    parts = path.split(".")
    for p in parts[:-1]:
        node = node.setdefault(p, {})
    node[parts[-1]] = value
    return out


def test_float_fields_found():
    assert {"train.lr", "train.eps", "model.init_std", "model.lime.router_lr_mult", "data.val_fraction"} <= \
        set(FLOAT_FIELDS)


@pytest.mark.parametrize("path, f", INT_FIELDS, ids=[p for p, _ in INT_FIELDS])
def test_every_int_field_has_a_range(path, f):
    """Every integer field is bounded on both sides, and the bounds are enforced (one past either is refused)."""
    lo, hi = f.metadata.get("min"), f.metadata.get("max")
    assert lo is not None and hi is not None, f"{path} has no range"
    for bad in (lo - 1, hi + 1):
        with pytest.raises(ConfigError, match=path.replace(".", r"\.")):
            config_from_run_dict(_nested(path, bad))


@pytest.mark.parametrize("item", ["seed=-1", "model.d_model=1000000000", "model.vocab_size=10000000000",
                                  "data.seq_len=1000000000", "model.max_seq_len=1000000000",
                                  "model.heads=[4,4,4,100000000]", "data.seed=-5"])
def test_absurd_and_negative_values_refused(item):
    with pytest.raises(ConfigError) as e:
        resolve(overrides=[item])
    assert item.split("=")[0] in str(e.value) and "\n" not in str(e.value)


def test_config_files_compose_in_order(tmp_path):
    """issue 10 item 5: --config A --config B kept only B. Files compose in order, later keys win, key by key."""
    a = tmp_path / "a.toml"
    a.write_text("[model]\nd_model = 96\nn_head = 3\n[train]\nlr = 0.01\nmax_steps = 7\n")
    b = tmp_path / "b.json"
    b.write_text(json.dumps({"train": {"lr": 0.02}, "seed": 5}))
    cfg = resolve(file=[a, b])
    assert (cfg.model.d_model, cfg.model.n_head, cfg.train.max_steps) == (96, 3, 7)  # from A, untouched by B
    assert cfg.train.lr == 0.02 and cfg.seed == 5  # B overrides A
    assert resolve(file=[b, a]).train.lr == 0.01  # the order matters
    assert resolve(file=[a, b], overrides=["train.lr=0.5"]).train.lr == 0.5  # --set still wins


def test_cli_config_twice_composes_and_says_so(tmp_path):
    from typer.testing import CliRunner

    from cemtool.cli.main import app

    a = tmp_path / "a.toml"
    a.write_text("[model]\nd_model = 96\nn_head = 3\n")
    b = tmp_path / "b.toml"
    b.write_text("[train]\nlr = 0.02\n")
    res = CliRunner().invoke(app, ["config", "--config", str(a), "--config", str(b)])
    assert res.exit_code == 0, res.output
    cfg = json.loads(res.stdout)
    assert cfg["model"]["d_model"] == 96 and cfg["train"]["lr"] == 0.02  # before: A was dropped silently
    assert "composed" in res.stderr and str(a) in res.stderr and str(b) in res.stderr
