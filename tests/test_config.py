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
