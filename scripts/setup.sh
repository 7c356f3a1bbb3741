#!/usr/bin/env bash
# The README's first command: install dependencies, build, and run the main job — greedy
# generation with the committed tiny MiMo-V2-Flash checkpoint.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
scripts/build.sh
model=tests/fixtures/mimo_hub_f32
set -x
build/bin/xinfer generate --model "$model" --prompt-ids 11,42,7,301,5,99,250,3,64,18,77,120 --max-tokens 16
