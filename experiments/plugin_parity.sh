#!/bin/bash
# Does a code tree train what another trains, to the digit? Runs make demo's recipe, each online-RL testbed config's
# first two epochs, flow DPO's first 20 steps and the testbed reward model on the code tree $1, writing into $2; the
# configs are those of the tree $3 (the older one, so both trees run the same recipes). Compare two output folders with
# experiments/plugin_parity_compare.py. Issue 56's check (experiments/notes/plugins.md):
#   git worktree add /tmp/old 25f6eaf
#   experiments/plugin_parity.sh /tmp/old runs/parity-old /tmp/old; experiments/plugin_parity.sh . runs/parity-new /tmp/old
#   python experiments/plugin_parity_compare.py runs/parity-old runs/parity-new
set -e
SRC=$(cd "$1" && pwd); OUT=$(mkdir -p "$2" && cd "$2" && pwd); CONFIGS=$(cd "$3" && pwd)/configs
PY=${PYTHON:-.venv/bin/python}; PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")
export PYTHONPATH=$SRC OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1
cd "$SRC"
$PY align/dpo.py --config "$CONFIGS/testbed_dpo.yaml" --output-dir "$OUT/demo" --overwrite true > "$OUT/demo.log" 2>&1
for c in ddpo nft awm flow_grpo flow_nft flow_awm; do
  $PY align/ddpo.py --config "$CONFIGS/testbed_$c.yaml" --num_epochs 2 --output_dir "$OUT/$c" --overwrite true \
      --report_to none > "$OUT/$c.log" 2>&1
done
$PY align/dpo.py --config "$CONFIGS/testbed_flow_dpo.yaml" --max_steps 20 --eval_prompts testbed:50:4242 \
    --eval_images_per_prompt 1 --output-dir "$OUT/flow_dpo_small" --overwrite true > "$OUT/flow_dpo_small.log" 2>&1
$PY -m align.train_reward --config "$CONFIGS/testbed_reward.yaml" --output_dir "$OUT/reward" --overwrite true \
    > "$OUT/reward.log" 2>&1
