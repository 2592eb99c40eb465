#!/usr/bin/env bash
# Install Prometheus and promtool (Debian's `prometheus` package) for the live
# metrics test (tests/test_prometheus_live.py). Idempotent: does nothing when
# both binaries are already on PATH. Needs root (or sudo) for apt-get.
set -euo pipefail
if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then
  echo "prometheus and promtool already installed: $(prometheus --version 2>&1 | head -n1)"
  exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  SUDO="sudo"
fi
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends prometheus
# The package's service is not wanted here (and there is no init in CI
# containers): the test starts its own instance on loopback with temp storage.
if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
  $SUDO systemctl disable --now prometheus >/dev/null 2>&1 || true
fi
command -v prometheus >/dev/null && command -v promtool >/dev/null
echo "installed: $(prometheus --version 2>&1 | head -n1)"
