"""Installs the pinned Python reference dependencies into the running venv."""
import importlib
import subprocess
import sys

TRANSFORMERS = "transformers==5.23.0"  # works with torch 2.13.0


def ensure_transformers():
    try:
        importlib.import_module("transformers")
    except ImportError:
        subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", TRANSFORMERS])


DATASETS = "datasets==5.2.0"


def ensure_datasets():
    """Hugging Face `datasets` (and transformers' tokenizer) for the data
    benchmark's reference."""
    ensure_transformers()
    try:
        importlib.import_module("datasets")
    except ImportError:
        subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", DATASETS])


PEFT = "peft==0.21.2"  # LoRA reference (issue 35); works with transformers 5.23


def ensure_peft():
    """PEFT, pinned: the LoRA parity tests and export checks load it."""
    ensure_transformers()
    try:
        importlib.import_module("peft")
    except ImportError:
        subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", PEFT])
