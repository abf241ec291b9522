#!/usr/bin/env bash
# Install Debian's Chromium and ChromeDriver for the browser tests (tests/browser/) when missing.
#
#   scripts/ensure_chromium.sh
#
# Idempotent: does nothing when /usr/bin/chromium is already there. Needs root (apt-get);
# when it cannot install, it says so and exits non-zero, and tests/browser then fail with a
# message naming this script (they never skip).
set -uo pipefail

if command -v chromium >/dev/null 2>&1; then
    echo "==> Chromium is installed: $(command -v chromium)"
    exit 0
fi
echo "==> Installing Debian's chromium and chromium-driver (browser tests)"
if [ "$(id -u)" -ne 0 ] && ! command -v sudo >/dev/null 2>&1; then
    echo "error: chromium is missing and installing it needs root (apt-get install chromium chromium-driver)" >&2
    exit 1
fi
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq </dev/null && $SUDO apt-get install -y -qq chromium chromium-driver </dev/null
status=$?
if [ $status -ne 0 ] || ! command -v chromium >/dev/null 2>&1; then
    echo "error: could not install chromium (apt-get exit status $status)" >&2
    exit 1
fi
echo "==> Chromium is installed: $(command -v chromium)"
