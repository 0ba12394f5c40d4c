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
