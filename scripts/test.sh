#!/usr/bin/env bash
# The README's second command: build and run the whole test suite (CPU only).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build.sh
ctest --test-dir build --output-on-failure -j"$(nproc)"
