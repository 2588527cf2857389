"""
Optional experiment tracking with Weights & Biases (train.py's wandb_log=True; docs/tracking.md).

log.jsonl stays the run's record; W&B gets a copy of each of its lines (the iteration as the step)
and the run's config, so that runs can be browsed and compared in W&B's interface. wandb is an
optional extra (`pip install wandb`), imported only here and only when a run asks for it: the
core trains without it. WANDB_MODE=offline records everything locally, without an account or a
network (`wandb sync` uploads it later).

A resumed run continues the same W&B run: the fresh run draws a random id and keeps it in
out_dir/wandb_id.txt (one of the run's files, so --overwrite=True removes it and the new run gets a
new id); --init_from=resume reads it back and passes it to wandb.init with resume="allow".
"""

import json
import os
import secrets

from errors import UserError
from utils import save_text, write_failure

ID_FILE = "wandb_id.txt"


def run_id(out_dir, resuming):
    """The W&B id of this run: the one stored in out_dir when resuming (a run that had tracking off
    so far gets a new one), else a new random one. Random rather than derived from out_dir: a run
    started over in the same out_dir must not append to the old run's curves."""
    path = os.path.join(out_dir, ID_FILE)
    if resuming and os.path.exists(path):
        with open(path) as f:
            stored = f.read().strip()
        if stored:
            return stored
    return secrets.token_hex(8)  # W&B ids: lower-case letters and digits


def start_wandb(config, out_dir, resuming):
    """wandb.init for a train.py run whose out_dir is ready; returns the run (its .log takes the
    records). W&B's own files go to out_dir/wandb/ unless WANDB_DIR says otherwise. A failing
    init (online without a login, say) ends the run with one line that says what to do."""
    import wandb

    wandb_id = run_id(out_dir, resuming)
    try:
        run = wandb.init(project=config["wandb_project"],
                         name=config["wandb_run_name"] or os.path.normpath(out_dir),
                         id=wandb_id, resume="allow", config=config, allow_val_change=True,
                         dir=None if os.environ.get("WANDB_DIR") else out_dir)
    except wandb.errors.Error as e:
        first_line = str(e).splitlines()[0] if str(e) else ""
        raise UserError(f"wandb.init failed ({type(e).__name__}: {first_line}); log in with "
                        f"`wandb login`, or record locally with WANDB_MODE=offline") from None
    save_text(wandb_id + "\n", os.path.join(out_dir, ID_FILE))
    return run


def append_record(log_path, record, wandb_run=None):
    """Append one record to log.jsonl (and send it to W&B when a run is tracked). A failed append
    (a full disk, no permission: utils.write_failure tells them apart) is returned as one line, None
    otherwise: ckpt.pt stays whole (its writes are atomic), so the run can be resumed once the log
    can be written."""
    try:
        with open(log_path, "a") as f:
            f.write(json.dumps(record) + "\n")
    except OSError as e:
        return f"{write_failure(log_path, e)}; resume with --init_from=resume once it can be written"
    if wandb_run is not None:
        wandb_run.log(record, step=record["iter"])
    return None
