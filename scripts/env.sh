# Sourced by the scripts: point tch's build at the venv's PyTorch (libtorch).
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export LIBTORCH_USE_PYTORCH=1
export VIRTUAL_ENV="$root/.venv"
export PATH="$root/.venv/bin:$PATH"
