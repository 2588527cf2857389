"""Errors a user can act on, not bugs: one base class, UserError, whose message is the one line the
user sees, printed once where the script started. Library modules raise it (or a subclass:
utils.PathError, data.DataError, checkpoint.CheckpointError, configurator.ConfigError, ...); only a
script's entry point ends the process: its main catches it once and calls end_with, and train.py,
which runs at module level, installs end_on_user_error at its top."""

import math
import os
import sys

from tqdm import tqdm


class UserError(Exception):
    """str(error): the one line the user sees, `error: ...`; status: the process's exit status. Under
    torchrun every rank prints its own, unless it was raised alike on every rank (agreed=True: an
    outcome the ranks agreed on), which rank 0 alone says."""
    status = 1
    agreed = False

    def __init__(self, message, agreed=None):
        super().__init__(message)
        if agreed is not None:
            self.agreed = agreed


class UsageError(UserError):
    """A bad argument or config value: the usage error's status, 2."""
    status = 2


def report(error, master=True):
    """Show a UserError's one line (where not master, only if the ranks did not agree on it; a
    progress bar still open is closed first, so the line is its own): `error: ...` on stderr, or
    with status 0 the plain line on stdout."""
    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()
    if master or not error.agreed:
        print(f"error: {error}" if error.status else error, file=sys.stderr if error.status else sys.stdout)
    sys.stdout.flush()
    sys.stderr.flush()


def end_with(error, master=True):
    """A script's one catch of a UserError: its line (report) and its status. Under torchrun every
    rank leaves at once, without the interpreter's teardown (os._exit after flushing): torchrun
    stops the ranks still running as soon as one has exited, and a rank still tearing down would
    be reported killed by SIGTERM."""
    report(error, master)
    if several_processes():
        os._exit(error.status)
    sys.exit(error.status)


def several_processes():
    """Whether torchrun started this process as one of several (WORLD_SIZE > 1; a WORLD_SIZE that
    is not a number counts as one process here: utils.launched says what is wrong with it)."""
    size = os.environ.get("WORLD_SIZE", "1")
    return size.isdigit() and int(size) > 1


def end_on_user_error():
    """end_with for a script that runs at module level (train.py), installed once at its top: a
    UserError that reaches the top is its one line (report) and its status, anything else the
    usual traceback. (An exception hook cannot raise SystemExit: a status other than the
    interpreter's 1 for an uncaught exception, or any under torchrun, is os._exit after flushing.)"""
    previous = sys.excepthook

    def hook(kind, error, traceback):
        if not isinstance(error, UserError):
            return previous(kind, error, traceback)
        # torch.distributed's own hook calls this one with sys.stderr redirected into a buffer that it
        # prints afterwards (each line prefixed [rankN]): os._exit comes first, so write to the streams
        sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
        report(error, os.environ.get("RANK", "0") == "0")
        if error.status != 1 or several_processes():
            os._exit(error.status)
    sys.excepthook = hook


# What a setting's value must be, as its one-line error says it: (what is expected, test). The
# config's rules (configurator.TRAIN_RULES) and the objective's (objective.ObjectiveConfig) use them.
def is_number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def one_of(*options):
    return "one of " + ", ".join(options), lambda v: v in options


POSITIVE = ("a positive integer", lambda v: v > 0)
NON_NEGATIVE = ("an integer >= 0", lambda v: v >= 0)
POSITIVE_NUMBER = ("a finite number > 0", lambda v: is_number(v) and v > 0)
NON_NEGATIVE_NUMBER = ("a finite number >= 0", lambda v: is_number(v) and v >= 0)
FRACTION = ("a number in [0, 1)", lambda v: is_number(v) and 0 <= v < 1)
NON_EMPTY = ("a non-empty string", lambda v: v != "")


def broken_rule(config, rules):
    """The message for the first key of config whose value breaks its rule, None if none does."""
    for key, (expected, ok) in rules.items():
        if key in config and not ok(config[key]):
            return f"key '{key}' must be {expected}, got {config[key]!r}"
    return None
