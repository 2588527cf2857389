"""
nanoGPT-style configuration: a config file is plain Python assignments, and --key=value
overrides it, e.g.

    python train.py config/lowres_margin_0.6.py --seed=2 --max_iters=100

Unlike nanoGPT's exec-into-globals, every key is checked: a name that is not a known key, or a
value whose type does not match the default's, stops the run with a message naming the key and
what was expected. A silent typo (`--lerning_rate=...`) would otherwise cost a whole run.
"""

import ast
import sys


class ConfigError(Exception):
    pass


def _check_type(key, value, default, source):
    """int is accepted where a float is expected; None is accepted for keys whose default is None
    (optional), and those keys take int/float/str/bool."""
    if default is None:
        ok = value is None or isinstance(value, (int, float, str, bool))
    elif isinstance(default, bool):
        ok = isinstance(value, bool)
    elif isinstance(default, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    else:
        ok = type(value) is type(default)
    if not ok:
        expected = type(default).__name__ if default is not None else "a number, string or None"
        raise ConfigError(f"{source}: key '{key}' expects {expected}, got {value!r} ({type(value).__name__})")
    return value


def _check_key(key, defaults, source):
    if key not in defaults:
        valid = ", ".join(sorted(defaults))
        raise ConfigError(f"{source}: unknown config key '{key}'. Valid keys: {valid}")


def parse_config(argv, defaults):
    """Apply config files (positional) and --key=value overrides, in order, to a copy of defaults.
    Returns the new dict; raises ConfigError on the first bad file, key or value."""
    config = dict(defaults)
    for arg in argv:
        if not arg.startswith("--"):
            try:
                with open(arg) as f:
                    source_code = f.read()
            except OSError as e:
                raise ConfigError(f"cannot read config file '{arg}': {e.strerror}") from None
            namespace = {"__file__": arg}  # lets a config build on another: see config/lowres_margin_2.py
            try:
                exec(compile(source_code, arg, "exec"), namespace)
            except Exception as e:
                raise ConfigError(f"config file '{arg}' failed to run: {type(e).__name__}: {e}") from None
            for key, value in namespace.items():
                if key.startswith("_") or callable(value) or type(value).__name__ == "module":
                    continue
                _check_key(key, defaults, f"config file '{arg}'")
                config[key] = _check_type(key, value, defaults[key], f"config file '{arg}'")
        else:
            if "=" not in arg:
                raise ConfigError(f"override '{arg}' must look like --key=value")
            key, text = arg[2:].split("=", 1)
            _check_key(key, defaults, "command line")
            try:
                value = ast.literal_eval(text)
            except (SyntaxError, ValueError):
                value = text  # a bare string such as --init_from=resume
            if isinstance(defaults[key], str) and not isinstance(value, str):
                value = text  # --out_dir=123 means the string "123"
            config[key] = _check_type(key, value, defaults[key], "command line")
    return config


def parse_config_or_exit(argv, defaults):
    try:
        return parse_config(argv, defaults)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
