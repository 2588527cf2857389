"""Loaded by every Python process started with this folder on PYTHONPATH (see tests/torch_use.py):
the version-sensitive torch APIs record which test called them."""

import os

if os.environ.get("TORCH_USE_DIR"):
    import torch_use

    torch_use.install(os.environ["TORCH_USE_DIR"])
