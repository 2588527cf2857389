"""Errors a user can act on, not bugs: UserError, whose message is the one
line the user sees. Library modules raise it or a subclass; a script's
entry point catches it once and calls end_with (run_script does both;
train.py, at module level, uses end_on_user_error).

Design notes: docs/runs.md
"""

import argparse
import math
from dataclasses import field, fields
import os
import sys

from tqdm import tqdm


class UserError(Exception):
    """str(error): the line the user sees; status: the exit status.
    agreed=True: raised alike on every rank, so rank 0 alone says it."""
    status = 1
    agreed = False

    def __init__(self, message, agreed=None):
        super().__init__(message)
        if agreed is not None:
            self.agreed = agreed


class UsageError(UserError):
    """A bad argument or config value: the usage error's status, 2."""
    status = 2


class CheckpointError(UserError):
    """A checkpoint that cannot be read, written or used here."""


def report(error, master=True):
    """Show a UserError's line, after closing any open progress bar:
    `error: ...` on stderr, or with status 0 the plain line on stdout."""
    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()
    if master or not error.agreed:
        if error.status:
            print(f"error: {error}", file=sys.stderr)
        else:
            print(error)
    sys.stdout.flush()
    sys.stderr.flush()


def end_with(error, master=True):
    """A script's one catch of a UserError: its line and its status;
    under torchrun without the interpreter's teardown (os._exit)."""
    report(error, master)
    if several_processes():
        os._exit(error.status)
    sys.exit(error.status)


def run_script(main):
    """Calls a script's main: a UserError ends it with its line and
    its status, anything else with the usual traceback."""
    try:
        main()
    except UserError as error:
        end_with(error)


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, but a bad argument is one `error: ...` line
    and the usage error's status (argparse's own prints the usage)."""

    def error(self, message):
        end_with(UsageError(message))


def several_processes():
    """Whether torchrun started this process as one of several
    (WORLD_SIZE > 1; a non-number counts as one: utils.launched says
    what is wrong with it)."""
    size = os.environ.get("WORLD_SIZE", "1")
    return size.isdigit() and int(size) > 1


def end_on_user_error():
    """end_with for a script that runs at module level, as an exception
    hook: a UserError is its line and its status, anything else the
    usual traceback."""
    previous = sys.excepthook

    def hook(kind, error, traceback):
        if not isinstance(error, UserError):
            return previous(kind, error, traceback)
        # torch.distributed's hook redirects sys.stderr into a buffer
        sys.stdout = sys.__stdout__
        sys.stderr = sys.__stderr__
        report(error, os.environ.get("RANK", "0") == "0")
        if error.status != 1 or several_processes():
            os._exit(error.status)
    sys.excepthook = hook


# What a setting's value must be, as its error says it: (expected, test),
# for configurator.TRAIN_RULES and the keys declared by setting().
def is_number(v):
    return (isinstance(v, (int, float)) and not isinstance(v, bool)
            and math.isfinite(v))


def one_of(*options):
    return "one of " + ", ".join(options), lambda v: v in options


POSITIVE = ("a positive integer", lambda v: v > 0)
NON_NEGATIVE = ("an integer >= 0", lambda v: v >= 0)
POSITIVE_NUMBER = ("a finite number > 0", lambda v: is_number(v) and v > 0)
NON_NEGATIVE_NUMBER = ("a finite number >= 0",
                       lambda v: is_number(v) and v >= 0)
FRACTION = ("a number in [0, 1)", lambda v: is_number(v) and 0 <= v < 1)
NON_EMPTY = ("a non-empty string", lambda v: v != "")


def broken_rule(config, rules):
    """The message of the first key whose value breaks its rule, or None."""
    for key, (expected, ok) in rules.items():
        if key in config and not ok(config[key]):
            return f"key '{key}' must be {expected}, got {config[key]!r}"
    return None


def setting(default, rule=None):
    """A key's default and rule: (what is expected, test) as above, or
    None (its type, which the config checks). A default of None is
    allowed besides what the rule allows."""
    if rule and default is None:
        expected, ok = rule
        rule = (f"None or {expected}", lambda v: v is None or ok(v))
    return field(default=default, metadata={"rule": rule})


class Settings:
    """A dataclass's keys declared by setting(): their rules, checked
    when one is made (ValueError, as the config words it)."""

    @classmethod
    def rules(cls):
        return {f.name: f.metadata["rule"] for f in fields(cls)
                if f.metadata["rule"]}

    def __post_init__(self):
        if problem := broken_rule(vars(self), self.rules()):
            raise ValueError(problem)
