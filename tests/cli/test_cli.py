"""The CLI through CliRunner: help of every command, a tiny real run, bad input -> one line and an exit code."""

import json
import pickle
import shutil

import pytest
from typer.testing import CliRunner

from cemtool.cli.main import app

from kit import TINY, set_args

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, list(args))


def tiny_sets(*extra):
    return set_args(*TINY, *extra)


def command_names():
    import typer.main

    return sorted(typer.main.get_command(app).commands)


def test_help_of_every_command():
    res = invoke("--help")
    assert res.exit_code == 0
    names = command_names()
    assert {"train", "runs", "archs", "config"} <= set(names)
    for name in names:
        r = invoke(name, "--help")
        assert r.exit_code == 0 and "Usage" in r.output, name


def test_tiny_real_run_then_runs_listing(tmp_path, text_file):
    out = tmp_path / "r"
    res = invoke("train", "--data", text_file, "--out", str(out), "--quiet", "--json",
                 *tiny_sets("data.tokenizer=byte"))
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    assert summary["status"] == "completed" and summary["step"] == 30
    for f in ("config.json", "meta.json", "metrics.jsonl", "tokenizer.json", "checkpoints/final.safetensors"):
        assert (out / f).exists(), f
    listing = invoke("runs", str(tmp_path), "--json")
    rows = json.loads(listing.stdout)
    assert rows[0]["status"] == "completed" and rows[0]["step"] == 30


def test_archs_lists_every_architecture_without_building_one(monkeypatch):
    from cemtool.models.lm import LM
    from cemtool.models.registry import archs

    def no_build(*a, **k):
        raise AssertionError("`cemtool archs` built a model")

    monkeypatch.setattr(LM, "__init__", no_build)  # every family's model is an LM
    res = invoke("archs", "--json")
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout)
    assert {r["arch"]: r["family"] for r in rows} == {n: a.family for n, a in archs().items()}
    assert all(r["description"] for r in rows)
    table = invoke("archs")
    assert table.exit_code == 0 and all(n in table.stdout for n in archs())
    assert invoke("archs", "--sizes", "--arch", "baseline").exit_code == 1  # --sizes builds (here: refused)


def test_archs_and_config_commands():
    res = invoke("archs", "--sizes", "--json", "--arch", "baseline")
    assert res.exit_code == 0
    row = json.loads(res.stdout)[0]
    assert row["params"] > 0 and row["flops_train"] > row["flops_forward"] > 0
    res = invoke("archs", "--set", "model.d_model=32", "--json", "--arch", "baseline")  # --set implies --sizes
    assert json.loads(res.stdout)[0]["d_model"] == 32
    cfg = json.loads(invoke("config", "--set", "model.d_model=64").stdout)
    assert cfg["model"]["d_model"] == 64
    assert "model.cem.steps" in invoke("config", "--fields").stdout


def test_archs_sizes_lists_the_architectures_an_allocation_makes_impossible():
    """Per-layer head sizes rule out LIMe's static router: the table still lists every other architecture."""
    sets = ["--set", "model.d_model=32", "--set", "model.n_layer=2", "--set", "model.alloc_strategy=late-lowrank"]
    res = invoke("archs", "--sizes", "--json", *sets)
    assert res.exit_code == 0, res.output
    rows = {r["arch"]: r for r in json.loads(res.stdout)}
    assert "needs one head size" in rows["lime"]["error"] and "params" not in rows["lime"]
    assert rows["baseline"]["params"] > 0 and rows["baseline"]["layer_shapes"] != ["2x16", "2x16"]
    res = invoke("archs", "--sizes", *sets, "--arch", "lime")  # asked for by name: the error itself
    assert res.exit_code == 1 and "needs one head size" in res.output


def one_line_error(res, code, *words):
    assert res.exit_code == code, res.output
    lines = [line for line in res.output.strip().splitlines() if line.strip()]
    assert lines[0].startswith("Error: "), res.output
    assert "Traceback" not in res.output
    for w in words:
        assert w in res.output, (w, res.output)


def bad_file(tmp_path, name, content: bytes):
    p = tmp_path / name
    p.write_bytes(content)
    return str(p)


@pytest.mark.parametrize("case", ["missing", "empty", "binary", "latin1", "arch", "key", "type", "seq_len",
                                  "newer_schema"])
def test_bad_input_one_line_exit_1(tmp_path, text_file, case):
    out = tmp_path / "out"
    args = {
        "missing": ["--data", str(tmp_path / "nope.txt")],
        "empty": ["--data", bad_file(tmp_path, "e.txt", b"")],
        "binary": ["--data", bad_file(tmp_path, "b.txt", b"\x00\x01\x02" * 100)],
        "latin1": ["--data", bad_file(tmp_path, "l.txt", "café crème ".encode("latin-1") * 50)],
        "arch": ["--arch", "transformerxl"],
        "key": ["--set", "model.widht=3"],
        "type": ["--set", "model.d_model=wide"],
        "seq_len": ["--data", text_file, "--set", "data.seq_len=100000", "--set", "data.tokenizer=byte"],
        "newer_schema": ["--config", bad_file(tmp_path, "c.json", json.dumps({"schema_version": 99}).encode())],
    }[case]
    words = {"missing": ["nope.txt"], "empty": ["empty"], "binary": ["binary"], "latin1": ["UTF-8"],
             "arch": ["unknown architecture", "baseline"], "key": ["model.widht"], "type": ["model.d_model"],
             "seq_len": ["data.seq_len=100000"], "newer_schema": ["schema_version"]}[case]
    res = invoke("train", *args, "--out", str(out), "--quiet")
    one_line_error(res, 1, *words)
    assert not out.exists()


def test_existing_run_refused_then_force(tmp_path, tiny_run):
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    before = sorted(p.name for p in run.rglob("*"))
    res = invoke("train", "--out", str(run), "--quiet")
    one_line_error(res, 1, "already holds a run", "--resume")
    assert sorted(p.name for p in run.rglob("*")) == before


def test_corrupt_checkpoint_and_pickle_on_resume(tmp_path, tiny_run):
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    meta = json.loads((run / "meta.json").read_text())
    meta["status"] = "interrupted"
    (run / "meta.json").write_text(json.dumps(meta))
    for ck in (run / "checkpoints").glob("step_*.safetensors"):
        ck.write_bytes(pickle.dumps({"evil": True}))
    res = invoke("train", "--resume", str(run), "--quiet")
    one_line_error(res, 1, "never unpickles")
    for ck in (run / "checkpoints").glob("step_*.safetensors"):
        ck.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\":")
    res = invoke("train", "--resume", str(run), "--quiet")
    one_line_error(res, 1, "corrupted")
    assert (run / "checkpoints" / "final.safetensors").exists()


def test_resume_not_a_run_and_usage_errors(tmp_path):
    one_line_error(invoke("train", "--resume", str(tmp_path)), 1, "not a cemtool run")
    res = invoke("train", "--resume", str(tmp_path), "--arch", "baseline")
    assert res.exit_code == 2
    assert invoke("train", "--no-such-flag").exit_code == 2
    assert invoke("train", "--seed", "abc").exit_code == 2


def test_unknown_device_and_unavailable_cuda(tmp_path):
    res = invoke("train", "--device", "tpu9", "--out", str(tmp_path / "o"))  # a bad option value: exit 2
    one_line_error(res, 2, "unknown device 'tpu9'")
    import torch

    if not torch.cuda.is_available():
        one_line_error(invoke("train", "--device", "cuda", "--out", str(tmp_path / "o")), 1, "CUDA")


def test_out_of_memory_is_one_line(tmp_path, text_file, monkeypatch):
    import torch

    import cemtool.train as tr

    def boom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(tr, "lm_loss", boom)
    res = invoke("train", "--data", text_file, "--out", str(tmp_path / "o"), "--quiet",
                 *tiny_sets("data.tokenizer=byte"))
    one_line_error(res, 1, "out of memory", "batch_size")
    assert json.loads((tmp_path / "o" / "meta.json").read_text())["status"] == "failed"


def test_resume_run_with_newer_config_schema(tmp_path, tiny_run):
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    cfg = json.loads((run / "config.json").read_text())
    cfg["schema_version"] = 99
    (run / "config.json").write_text(json.dumps(cfg))
    meta = json.loads((run / "meta.json").read_text())
    meta["status"] = "interrupted"
    (run / "meta.json").write_text(json.dumps(meta))
    one_line_error(invoke("train", "--resume", str(run), "--quiet"), 1, "schema_version 99", "newer")
    assert json.loads((run / "config.json").read_text())["schema_version"] == 99


def test_one_spelling_of_no_plots_in_every_command():
    import typer.main

    group = typer.main.get_command(app)
    visible = {name: [o for p in cmd.params if not getattr(p, "hidden", False) for o in p.opts + p.secondary_opts]
               for name, cmd in group.commands.items()}
    assert not [n for n, opts in visible.items() if "--no-plot" in opts]
    assert {"sharpness", "collapse-report"} <= {n for n, opts in visible.items() if "--no-plots" in opts}
    sharp = group.commands["sharpness"]
    hidden = [o for p in sharp.params if getattr(p, "hidden", False) for o in p.opts]
    assert "--no-plot" in hidden  # the old spelling still works


def test_train_help_lists_every_data_source():
    from cemtool.data.corpus import sources

    res = runner.invoke(app, ["train", "--help"], env={"COLUMNS": "250"})
    assert res.exit_code == 0
    for s in sources():
        assert f"'{s}'" in res.output, s


def test_archs_sizes_leaves_out_foreign_architectures_registered_in_the_process(monkeypatch):
    """Loading a Hugging Face model registers its architecture (family "foreign", its own context): the table of
    cemtool's families at one size lists without it (it once failed the whole table), and it can still be named."""
    from cemtool import architectures

    def build(cfg):
        raise AssertionError("a foreign architecture was built for the table")

    monkeypatch.setitem(architectures._ARCHS, "hf-toy-000000", architectures.ArchSpec(
        "hf-toy-000000", "foreign", build, {}, "a stand-in"))
    res = invoke("archs", "--sizes", "--json", "--set", "model.d_model=32", "--set", "model.n_layer=2")
    assert res.exit_code == 0, res.output
    names = {r["arch"] for r in json.loads(res.stdout)}
    assert "hf-toy-000000" not in names and "baseline" in names
    assert "hf-toy-000000" in invoke("archs", "--json").stdout  # the plain listing still names it
