#!/usr/bin/env bash
# Installs xinfer's build and test dependencies from Debian 12 packages (run as root).
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
packages=(build-essential cmake ninja-build pkg-config
          nlohmann-json3-dev libcli11-dev libfmt-dev libgtest-dev libcpp-httplib-dev libicu-dev)
missing=()
for p in "${packages[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  apt-get update -qq
  apt-get install -y -qq "${missing[@]}"
fi
