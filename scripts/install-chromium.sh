#!/usr/bin/env bash
# Installs Chromium from Debian's packages for the status page test
# (tests/tests/status_page.rs), when it is not installed yet. Needs root
# (CI and the dev containers run as root) or passwordless sudo.
set -euo pipefail
if [ -x /usr/bin/chromium ]; then
  exit 0
fi
if ! command -v apt-get >/dev/null; then
  echo "install-chromium: no apt-get here; install Chromium and put it at /usr/bin/chromium" >&2
  exit 1
fi
sudo=""
if [ "$(id -u)" != 0 ]; then
  sudo="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
# The package lists may be missing or stale in a fresh container.
$sudo apt-get update -qq || true
$sudo apt-get install -y -qq --no-install-recommends chromium >/dev/null
/usr/bin/chromium --version
