"""configurator.py: config files and --key=value overrides, and the errors for bad ones."""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from configurator import ConfigError, parse_config, train_defaults  # noqa: E402

DEFAULTS = {"learning_rate": 1e-3, "max_iters": 100, "out_dir": "out", "tie_weights": True, "margin": None}


def test_file_then_overrides_in_order(tmp_path):
    cfg = tmp_path / "c.py"
    cfg.write_text("max_iters = 5\nmargin = 0.6\nout_dir = 'a'\n")
    config = parse_config([str(cfg), "--max_iters=7", "--learning_rate=3e-4", "--out_dir=123"], DEFAULTS)
    assert config == {"learning_rate": 3e-4, "max_iters": 7, "out_dir": "123", "tie_weights": True, "margin": 0.6}
    assert DEFAULTS["max_iters"] == 100  # defaults are not modified


def test_int_is_accepted_for_float_and_optional_keys_take_numbers_or_none():
    config = parse_config(["--learning_rate=1", "--margin=2", "--margin=None"], DEFAULTS)
    assert config["learning_rate"] == 1.0 and isinstance(config["learning_rate"], float)
    assert config["margin"] is None


def test_config_can_build_on_another(tmp_path):
    """include: the base's values first, the file's own win wherever the line stands; paths are
    relative to the including file; chains and lists work; a cycle or a missing base is one error."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "base.py").write_text("max_iters = 5\nout_dir = 'base'\nmargin = 1.0\n")
    (tmp_path / "sub" / "child.py").write_text("out_dir = 'child'\ninclude = '../base.py'\n")
    (tmp_path / "sub" / "grandchild.py").write_text("include = ['child.py']\nmargin = 2.0\n")
    config = parse_config([str(tmp_path / "sub" / "grandchild.py")], DEFAULTS)
    assert (config["max_iters"], config["out_dir"], config["margin"]) == (5, "child", 2.0)
    (tmp_path / "loop.py").write_text("include = 'loop.py'\n")
    with pytest.raises(ConfigError, match="includes itself"):
        parse_config([str(tmp_path / "loop.py")], DEFAULTS)
    (tmp_path / "orphan.py").write_text("include = 'nowhere.py'\n")
    with pytest.raises(ConfigError, match=r"cannot read config file '.*nowhere.py' \(included by '.*orphan.py'\)"):
        parse_config([str(tmp_path / "orphan.py")], DEFAULTS)


@pytest.mark.parametrize("args, message", [
    (["--max_itres=5"], "unknown config key 'max_itres'; did you mean 'max_iters'?"),
    (["--zzz=5"], "unknown config key 'zzz'; valid keys: learning_rate, margin, max_iters, out_dir, tie_weights"),
    (["--max_iters=0.5"], "key 'max_iters' expects int, got 0.5"),
    (["--tie_weights=1"], "key 'tie_weights' expects bool, got 1"),
    (["--learning_rate=fast"], "key 'learning_rate' expects float, got 'fast'"),
    (["--max_iters"], "must look like --key=value"),
    (["no/such/config.py"], "cannot read config file 'no/such/config.py'"),
])
def test_bad_input_names_the_key(args, message):
    with pytest.raises(ConfigError) as info:
        parse_config(args, DEFAULTS)
    assert message in str(info.value)


def test_bad_key_in_file_names_the_file(tmp_path):
    cfg = tmp_path / "bad.py"
    cfg.write_text("learning_rat = 1e-3\n")
    with pytest.raises(ConfigError, match=r"config file '.*bad.py': unknown config key 'learning_rat'"):
        parse_config([str(cfg)], DEFAULTS)
    cfg.write_text("max_iters = 'many'\n")
    with pytest.raises(ConfigError, match="key 'max_iters' expects int"):
        parse_config([str(cfg)], DEFAULTS)


@pytest.mark.slow
def test_train_py_stops_with_one_clear_message():
    result = subprocess.run([sys.executable, "train.py", "config/lowres_baseline.py", "--n_layers=2"],
                            cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 2
    assert "unknown config key 'n_layers'; did you mean 'n_layer'?" in result.stderr
    assert "Traceback" not in result.stderr


def test_every_shipped_config_parses():
    import glob
    defaults = train_defaults()
    paths = sorted(glob.glob(os.path.join(REPO, "config", "**", "*.py"), recursive=True))
    assert any(os.sep + "methods" + os.sep in p for p in paths)
    for path in paths:
        parse_config([path], defaults)


@pytest.mark.parametrize("name,text", [
    ("c.json", '{"learning_rate": 0.5, "max_iters": 7}\n'),  # a dict expression: assigns nothing
    ("c.yaml", "learning_rate: 0.5\nmax_iters: 7\n"),  # annotations without a value: assigns nothing
    ("empty.py", "# nothing here yet\n")])
def test_a_config_that_sets_no_key_is_refused_naming_the_file(tmp_path, name, text):
    """Once trained train.py's defaults for 8,000 steps and exited 0: JSON and YAML are valid Python."""
    cfg = tmp_path / name
    cfg.write_text(text)
    with pytest.raises(ConfigError, match=rf"config file '.*{name}' sets no key: a config file is Python "
                                          r"assignments, one key = value per line"):
        parse_config([str(cfg)], DEFAULTS)
