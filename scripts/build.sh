#!/usr/bin/env bash
# Configures and builds xinfer into build/ (the binary is build/bin/xinfer).
# CI=true turns warnings into errors.
set -euo pipefail
cd "$(dirname "$0")/.."
werror=OFF
[ "${CI:-}" = "true" ] && werror=ON
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DXINFER_WERROR=$werror "$@" >/dev/null
cmake --build build -j"$(nproc)"
