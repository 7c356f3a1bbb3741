#!/usr/bin/env bash
# The README's first command: install dependencies, build, and run the main job — greedy
# generation with the committed tiny MiMo-V2-Flash checkpoint.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
scripts/build.sh
model=tests/fixtures/mimo_hub_f32
prompt=$(python3 -c "import json;print(','.join(map(str,json.load(open('$model/reference.json'))['prompt_ids'])))" 2>/dev/null \
         || sed -n 's/.*"prompt_ids": *\[\([^]]*\)\].*/\1/p' $model/reference.json | tr -d ' \n')
echo "+ build/bin/xinfer generate --model $model --prompt-ids <${prompt//[^,]/}> --max-tokens 16"
build/bin/xinfer generate --model "$model" --prompt-ids "$prompt" --max-tokens 16
