"""Installs the pinned Python reference dependencies into the running venv.

Tests run references in parallel, so an install holds a lock on a file in
the venv: a second process waits for the first and then finds the package
installed, instead of running pip into the same site-packages at once.
"""
import contextlib
import fcntl
import importlib
import os
import subprocess
import sys

TRANSFORMERS = "transformers==5.23.0"  # works with torch 2.13.0


@contextlib.contextmanager
def install_lock():
    path = os.path.join(sys.prefix, ".accrue-pip.lock")
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _importable(module):
    try:
        importlib.import_module(module)
        return True
    except ImportError:
        return False


def pip_install(module, *specs):
    """Installs `specs` unless `module` imports (under the install lock)."""
    if _importable(module):
        return
    with install_lock():
        importlib.invalidate_caches()
        if not _importable(module):
            subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", *specs])
            importlib.invalidate_caches()


def ensure_transformers():
    pip_install("transformers", TRANSFORMERS)


DATASETS = "datasets==5.2.0"


def ensure_datasets():
    """Hugging Face `datasets` (and transformers' tokenizer) for the data
    benchmark's reference."""
    ensure_transformers()
    pip_install("datasets", DATASETS)


PEFT = "peft==0.21.2"  # LoRA reference (issue 35); works with transformers 5.23


def ensure_peft():
    """PEFT, pinned: the LoRA parity tests and export checks load it."""
    ensure_transformers()
    pip_install("peft", PEFT)


OPENAI = "openai==3.57.0"  # the client an agent harness drives the endpoint with (issue 36)


def ensure_openai():
    """The `openai` Python client, pinned: the served-episodes test drives
    the job's endpoint with it."""
    pip_install("openai", OPENAI)
