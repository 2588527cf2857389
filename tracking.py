"""
Optional experiment tracking with Weights & Biases (train.py's
wandb_log=True): a copy of each log.jsonl record and the run's config.
wandb is imported only here and only when a run asks for it.
Design notes: docs/tracking.md
"""

import json
import os
import secrets

from errors import UserError
from utils import save_text, write_failure

ID_FILE = "wandb_id.txt"


def run_id(out_dir, resuming):
    """The W&B id stored in out_dir when resuming, else a new one."""
    path = os.path.join(out_dir, ID_FILE)
    if resuming and os.path.exists(path):
        with open(path) as f:
            stored = f.read().strip()
        if stored:
            return stored
    return secrets.token_hex(8)  # W&B ids: lower-case letters and digits


def start_wandb(config, out_dir, resuming, master=True):
    """wandb.init for a run whose out_dir is ready; returns the run, or
    None without wandb_log or off rank 0. A resume continues the same
    W&B run. W&B's files go to out_dir/wandb/ unless WANDB_DIR is set.
    A failing init (no login) is one line that says what to do."""
    if not (config["wandb_log"] and master):
        return None
    import wandb

    wandb_id = run_id(out_dir, resuming)
    name = config["wandb_run_name"] or os.path.normpath(out_dir)
    try:
        run = wandb.init(
            project=config["wandb_project"], name=name, id=wandb_id,
            resume="allow", config=config, allow_val_change=True,
            dir=None if os.environ.get("WANDB_DIR") else out_dir)
    except wandb.errors.Error as e:
        first_line = str(e).splitlines()[0] if str(e) else ""
        raise UserError(
            f"wandb.init failed ({type(e).__name__}: {first_line}); "
            f"log in with `wandb login`, or record locally with "
            f"WANDB_MODE=offline") from None
    save_text(wandb_id + "\n", os.path.join(out_dir, ID_FILE))
    return run


def append_record(log_path, record, wandb_run=None):
    """Append one record to log.jsonl (and send it to W&B if tracked).
    A failed append is returned as one line, None otherwise: ckpt.pt
    stays whole, so the run can resume once the log can be written."""
    try:
        with open(log_path, "a") as f:
            f.write(json.dumps(record) + "\n")
    except OSError as e:
        return (f"{write_failure(log_path, e)}; resume with "
                f"--init_from=resume once it can be written")
    if wandb_run is not None:
        wandb_run.log(record, step=record["iter"])
    return None
