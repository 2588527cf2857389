"""
nanoGPT-style configuration: a config file is plain Python assignments,
and --key=value overrides it:

    python train.py config/lowres_margin_0.6.py --seed=2 --max_iters=100

Unlike nanoGPT's exec-into-globals, every key and value is checked: a typo
(`--lerning_rate=...`) is one line naming the key, not a lost run.
"""

import ast
import difflib
import importlib
import os

from errors import (FRACTION, NON_EMPTY, NON_NEGATIVE, NON_NEGATIVE_NUMBER, POSITIVE,
                    POSITIVE_NUMBER, UsageError, broken_rule, is_number, one_of)


class ConfigError(UsageError):
    """A wrong config file, key or value: one line, exit status 2."""


AUTO_KEYS = ("batch_size",)  # integer keys that also take "auto"


def _check_type(key, value, default, source):
    """value if its type is the default's: an int passes for a float (as a
    float); a None default takes None, a number, a string or a bool."""
    if isinstance(default, float) and isinstance(value, (int, float)) \
            and not isinstance(value, bool):
        value = float(value)
    if default is None:
        ok = isinstance(value, (int, float, str, bool, type(None)))
    else:
        ok = (value == "auto" and key in AUTO_KEYS) or type(value) is type(default)
    if not ok:
        expected = type(default).__name__ if default is not None else "a number, string or None"
        raise ConfigError(f"{source}: key '{key}' expects {expected}, "
                          f"got {value!r} ({type(value).__name__})")
    return value


def _check_key(key, defaults, source):
    if key not in defaults:
        close = difflib.get_close_matches(key, defaults, n=1)
        hint = (f"did you mean '{close[0]}'?" if close
                else f"valid keys: {', '.join(sorted(defaults))}")
        raise ConfigError(f"{source}: unknown config key '{key}'; {hint}")


def read_config_file(path, _chain=()):
    """The values a config file assigns, its includes first: `include =
    "base.py"` (relative to the including file, or a list of such) makes
    it build on another, and its own assignments win."""
    if path in _chain:
        raise ConfigError(f"config file '{path}' includes itself: {' -> '.join(_chain + (path,))}")
    where = f" (included by '{_chain[-1]}')" if _chain else ""
    try:
        with open(path, encoding="utf-8") as f:  # whatever the locale
            source_code = f.read()
    except OSError as e:
        raise ConfigError(f"cannot read config file '{path}'{where}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        byte = f"byte 0x{e.object[e.start]:02x} at position {e.start}"
        raise ConfigError(f"config file '{path}'{where} is not UTF-8 text ({byte}); "
                          "save it as UTF-8") from None
    namespace = {}
    try:
        exec(compile(source_code, path, "exec"), namespace)
    except SystemExit as e:  # or a run that trained nothing exits 0
        raise ConfigError(f"config file '{path}' called sys.exit({e.code!r}); "
                          "a config file only assigns keys") from None
    except (Exception, KeyboardInterrupt) as e:  # a raise is the file's, not a Ctrl-C's
        raise ConfigError(f"config file '{path}' failed to run: {type(e).__name__}: {e}") from None
    own = {key: value for key, value in namespace.items()
           if not key.startswith("_") and not callable(value) and type(value).__name__ != "module"}
    include = own.pop("include", [])
    includes = [include] if isinstance(include, str) else include
    if not isinstance(includes, list) or not all(isinstance(name, str) for name in includes):
        raise ConfigError(f"config file '{path}': include must be a file name or a list of them, "
                          f"got {include!r}")
    if not own and not includes:  # JSON and YAML are Python too
        raise ConfigError(f"config file '{path}'{where} sets no key: a config file is Python "
                          "assignments, one key = value per line (e.g. learning_rate = 3e-4)")
    values = {}
    for name in includes:
        base = os.path.join(os.path.dirname(path), name)
        values.update(read_config_file(base, _chain + (path,)))
    values.update(own)
    return values


TRAIN_PY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train.py")


def train_defaults():
    """train.py's default config, read from its source without running it:
    the constants it assigns between its "# default config" and
    "config_keys" lines, and the model's and objective's keys where it
    takes them."""
    with open(TRAIN_PY) as f:
        source = f.read()
    first, last = (source[:source.index(marker)].count("\n") + 1
                   for marker in ("# default config", "config_keys ="))
    defaults = {}
    for node in ast.parse(source).body:
        if not first < node.lineno < last:
            continue
        if isinstance(node, ast.Assign) and len(node.targets) == 1 \
                and isinstance(node.targets[0], ast.Name):
            defaults[node.targets[0].id] = ast.literal_eval(node.value)
        elif isinstance(node, ast.Expr):  # globals().update(vars(...))
            from model import GPTConfig
            from objective import ObjectiveConfig
            names = {**defaults, "GPTConfig": GPTConfig,
                     "ObjectiveConfig": ObjectiveConfig}
            defaults.update(eval(ast.unparse(node.value.args[0]), names))
    return defaults


def parse_config(argv, defaults, rules=None):
    """A copy of defaults with config files (positional) and --key=value
    overrides applied in order, then checked against rules (e.g.
    train_rules()); the first bad file, key or value is a ConfigError."""
    config = dict(defaults)
    for arg in argv:
        if not arg.startswith("--"):
            source = f"config file '{arg}'"
            for key, value in read_config_file(arg).items():
                _check_key(key, defaults, source)
                config[key] = _check_type(key, value, defaults[key], source)
            continue
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
    check_values(config, rules or {})
    return config


# What each of train.py's keys must be, checked before a run touches
# anything: `--eval_interval=0` costs one line, not a run.
TRAIN_RULES = {
    **dict.fromkeys(("eval_interval", "eval_iters", "log_interval",
                     "gradient_accumulation_steps", "lr_decay_iters"), POSITIVE),
    **dict.fromkeys(("max_iters", "warmup_iters", "checkpoint_interval", "global_batch_size",
                     "num_threads", "adagc_warmup", "fsdp_shard_size"), NON_NEGATIVE),
    **dict.fromkeys(("min_lr", "weight_decay", "grad_clip", "hang_factor"),
                    NON_NEGATIVE_NUMBER),
    **dict.fromkeys(("learning_rate", "adagc_rel", "collective_timeout"), POSITIVE_NUMBER),
    **dict.fromkeys(("beta1", "beta2", "adagc_beta"), FRACTION),
    "batch_size": ("a positive integer or 'auto'", lambda v: v == "auto" or v > 0),
    "low_resource_prob": ("a number in [0, 1]", lambda v: is_number(v) and 0 <= v <= 1),
    "embedding_weight_decay": ("a finite number (< 0: weight_decay)", is_number),
    **dict.fromkeys(("data_seed", "init_embeddings_from_seed"), (
        "None or an integer",
        lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool)))),
    **dict.fromkeys(("out_dir", "data_dir", "init_from", "wandb_project"), NON_EMPTY),
    "lr_schedule": one_of("cosine", "constant"),
    "data_order": one_of("random", "epoch"),
    "grad_clip_mode": one_of("norm", "adagc"),
    "parallel": one_of("none", "ddp", "fsdp"),
    "compile": one_of("auto", "True", "False"),
    "dtype": one_of("auto", "float32", "bfloat16", "float16"),
}


def train_rules():
    """TRAIN_RULES and the rules of the model's and the objective's keys
    (model.GPTConfig, objective.ObjectiveConfig)."""
    from model import GPTConfig  # imports torch: only if needed
    from objective import ObjectiveConfig
    return {**TRAIN_RULES, **GPTConfig.rules(), **ObjectiveConfig.rules()}


def _importable(module):
    try:
        importlib.import_module(module)
        return True
    except ImportError:
        return False


def check_train_config(config, world_size):
    """The first rule between train.py's keys that config breaks, as a
    message (None if none): what one key's range cannot express."""
    c = config
    fsdp = c["parallel"] == "fsdp"
    fsdp_problem = None
    if fsdp:
        import parallelism  # imports torch: only when it matters
        fsdp_problem = parallelism.fsdp_unavailable(c["device"])
    from_file = c["init_from"] not in ("scratch", "resume", "auto")
    batch = c["batch_size"]
    global_batch = c["global_batch_size"]
    shard_size = c["fsdp_shard_size"]
    for problem, message in (
        (c["log_marginalization"] and (c["dropout"] > 0 or not c["tie_weights"]
                                       or c["ce_weight"] == 0 or c["cwt_weight"] > 0
                                       or c["ce_chunk_size"]),
         "log_marginalization needs dropout=0, tie_weights=True, ce_weight > 0, cwt_weight=0 "
         "and ce_chunk_size=0 (it splits the tied embedding's cross-entropy gradient, read "
         "from the logits)"),
        (from_file and not os.path.isfile(c["init_from"]),
         f"key 'init_from' must be 'scratch', 'resume', 'auto' or an existing checkpoint file, "
         f"got {c['init_from']!r}"),
        (c["head_from_embedding"] and from_file and c["tie_weights"],
         "head_from_embedding=True needs tie_weights=False (a tied head is the embedding)"),
        (c["init_embeddings_from_seed"] is not None and from_file,
         "init_embeddings_from_seed starts a fresh run; it cannot be combined with "
         "init_from=<checkpoint>"),
        (c["lr_schedule"] == "cosine" and c["lr_decay_iters"] <= c["warmup_iters"],
         f"key 'lr_decay_iters' ({c['lr_decay_iters']}) must be above warmup_iters "
         f"({c['warmup_iters']}) with the cosine schedule"),
        (world_size > 1 and c["parallel"] == "none",
         f"launched on {world_size} processes but key 'parallel' is 'none' (use ddp or fsdp)"),
        (c["parallel"] != "none" and c["log_marginalization"],
         "log_marginalization needs parallel='none' (it reads one process's gradients)"),
        (fsdp_problem is not None, fsdp_problem),
        (c["fsdp_keep_gathered"] and not fsdp,
         "fsdp_keep_gathered=True needs parallel='fsdp' (it changes when FSDP reshards the "
         "weights)"),
        (shard_size and (not fsdp or world_size % shard_size),
         f"key 'fsdp_shard_size' ({shard_size}) needs parallel='fsdp' and must divide the "
         f"number of processes ({world_size}): it shards over groups of that many processes "
         f"and replicates across the groups"),
        (fsdp and c["separate_embeddings"],
         "separate_embeddings=True does not work with parallel='fsdp' (SeparatedRowsAdamW "
         "keeps per-row state as plain tensors, not as sharded DTensors); use parallel='ddp' "
         "or 'none'"),
        (batch == "auto" and (not global_batch or global_batch % world_size),
         f"batch_size='auto' needs a global_batch_size that is a multiple of the processes "
         f"({world_size}), got {global_batch}: auto chooses how the recipe's global batch is "
         f"split, not the batch itself"),
        (global_batch and batch != "auto" and global_batch % (batch * world_size),
         f"key 'global_batch_size' ({global_batch}) must be a multiple of batch_size ({batch}) "
         f"x processes ({world_size})"),
        (any(name.strip() not in c for name in c["resume_changes"].split(",") if name.strip()),
         f"key 'resume_changes' must name keys of train.py, comma-separated, got "
         f"{c['resume_changes']!r}"),
        (c["wandb_log"] and not _importable("wandb"),
         "wandb_log=True needs `pip install wandb` (an optional extra; WANDB_MODE=offline "
         "needs no account)"),
    ):
        if problem:
            return message
    return model_problem(c)


def model_problem(config):
    """What GPTConfig's and the Objective's own rules say of config (None:
    nothing), asked before any later step builds them."""
    import torch  # only where a config is checked for training

    from model import GPTConfig
    from objective import Objective
    try:
        GPTConfig.from_config(config, config["vocab_size"])
        with torch.device("meta"):  # nothing allocated (NITP's head)
            Objective.from_config(config)
    except ValueError as e:
        return str(e)
    return None


def check_values(config, rules):
    """Raise ConfigError naming the first key whose value breaks its rule."""
    if problem := broken_rule(config, rules):
        raise ConfigError(problem)
