#!/bin/bash
# CFT recipes side by side on one H200, to find one that meets the CFT issue's tau = 0.9 valid-rate target in
# about the default's 45 CPU minutes: each sees the traces as often as the default (1000 steps of 16, 2.24
# epochs), cut into more, smaller steps or trained with one noisy copy instead of two. The GPU computes in
# bf16-mixed too, but with other kernels, so its numbers are a guide: a recipe must be confirmed on the CPU.
#
# As it ran (torch 2.11 + CUDA 13 there; transformers 5.24.0, datasets 5.2.0, dill, multiprocess carried as
# wheels in .whl/; gpu/sft and gpu/data/synthetic are copies of the default run's out/sft and data/synthetic):
#
#   LIMIT=465 bash docs/gpu_cft_sweep.sh             # round 1: six recipes, 355 s
#   ROUND=2 LIMIT=290 bash docs/gpu_cft_sweep.sh     # round 2: four around round 1's best, stopped at 290 s
#   ROUND=3 LIMIT=470 bash docs/gpu_cft_sweep.sh     # round 3 (gpu/opd too: the same run's out/opd): six CFT
#                                                    # recipes and two 40-step rl.py runs, 472 s
#
# Round 4 was three more 40-step rl.py runs with prefix-joint rollouts at once (`--seed 1`, `--seed 2`,
# `--lr 1e-4`; 245 s), the rlrun lines below run by hand with `timeout 270`.
#
# Each writes out-sweep/<recipe>/ and out-sweep/logs/<recipe>.log, and into $OUT summary.json (every recipe in
# out-sweep), logs.tgz and the checkpoints (without last/), two to a tar. The recipes share the GPU (2 CPU
# threads each); LIMIT stops any that has not finished, and the summary still reads the validations it logged.
# Numbers: docs/gpu_h200_cft_sweep.json and docs/stage-notes.md.
set -u
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
OUT=${OUT:-out-sweep-results}; LOGS=out-sweep/logs; LIMIT=${LIMIT:-480}; mkdir -p "$OUT" "$LOGS"
if [ -d "${WHEELS:-.whl}" ]; then  # WHEELS=none where the packages are installed already
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "${WHEELS:-.whl}"/*.whl &&
    export PYTHONPATH=/tmp/site || exit 1
fi
DATA=${DATA:-gpu/data/synthetic}; INIT=${INIT:-gpu/sft}; DEVICE=${DEVICE:-cuda}
recipe() {  # recipe NAME [cft.py flags...]
  local name=$1; shift
  # "default" is the one these rounds ran against, 1000 x 16 (cft.py's is now 3200 x 5, the batch5 recipe);
  # a recipe's own flags come after it and win
  timeout "$LIMIT" python3 cft.py --data "$DATA" --init "$INIT" --out "out-sweep/$name" --device "$DEVICE" \
    --threads 2 --val-n 200 --batch-size 16 --steps "${STEPS:-1000}" "$@" > "$LOGS/$name.log" 2>&1
  echo "$name: exit $? after $SECONDS s"
}
if [ "${ROUND:-1}" = 1 ]; then
recipe default ${EXTRA:-} &
recipe lr1.4e-3 --lr 1.4e-3 ${EXTRA:-} &
recipe batch8 --batch-size 8 --steps $((2 * ${STEPS:-1000})) ${EXTRA:-} &
recipe one-copy --no-complementary --steps $((2 * ${STEPS:-1000})) ${EXTRA:-} &
recipe lambda-o2 --lambda-o 2.0 ${EXTRA:-} &
recipe batch8-lambda-o2 --batch-size 8 --steps $((2 * ${STEPS:-1000})) --lambda-o 2.0 ${EXTRA:-} &
elif [ "${ROUND:-1}" = 3 ]; then  # round 3: seeds of 2000 x 8, smaller steps, one copy at the default's CPU cost; RL longer
recipe batch8-seed1 --batch-size 8 --steps $((2 * ${STEPS:-1000})) --seed 1 ${EXTRA:-} &
recipe batch8-seed2 --batch-size 8 --steps $((2 * ${STEPS:-1000})) --seed 2 ${EXTRA:-} &
recipe batch8-lr5e-4 --batch-size 8 --steps $((2 * ${STEPS:-1000})) --lr 5e-4 ${EXTRA:-} &
recipe batch5 --batch-size 5 --steps $((16 * ${STEPS:-1000} / 5)) ${EXTRA:-} &
recipe one-copy-batch8 --no-complementary --batch-size 8 --steps $((3 * ${STEPS:-1000})) ${EXTRA:-} &
recipe one-copy-1400 --no-complementary --steps $((14 * ${STEPS:-1000} / 10)) ${EXTRA:-} &
# RL from the default chain's OPD (gpu/opd), eight times the default's five steps: does the held-out reward move?
rlrun() {  # rlrun NAME [rl.py flags...]
  local name=$1; shift
  timeout "$LIMIT" python3 rl.py --data "$DATA" --init "${RL_INIT:-gpu/opd}" --out "out-sweep/$name" --device "$DEVICE" \
    --threads 2 --steps ${RL_STEPS:-40} --eval-every $((${RL_STEPS:-40} / 4)) "$@" > "$LOGS/$name.log" 2>&1
  echo "$name: exit $? after $SECONDS s"
}
rlrun rl-any ${RL_EXTRA:-} &
rlrun rl-prefix-joint --rollout-commit prefix-joint ${RL_EXTRA:-} &
else  # round 2: around the best of round 1 (one noisy copy, twice the steps)
recipe one-copy-seed1 --no-complementary --steps $((2 * ${STEPS:-1000})) --seed 1 ${EXTRA:-} &
recipe one-copy-lambda-o2 --no-complementary --steps $((2 * ${STEPS:-1000})) --lambda-o 2.0 ${EXTRA:-} &
recipe one-copy-mixed --no-complementary --steps $((2 * ${STEPS:-1000})) --noise-shape mixed ${EXTRA:-} &
recipe one-copy-lr1e-3 --no-complementary --steps $((2 * ${STEPS:-1000})) --lr 1e-3 ${EXTRA:-} &
fi
wait
python3 - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
rows = {}
for run in sorted(p for p in Path("out-sweep").iterdir() if p.name != "logs"):
    log = [json.loads(line) for line in open(run / "log.jsonl")] if (run / "log.jsonl").exists() else []
    test = json.loads((run / "metrics.json").read_text()) if (run / "metrics.json").exists() else None
    rows[run.name] = {"val": [r for r in log if "val_valid_rate" in r], "test": test}
    print(f"{run.name:18s}", " | ".join(f"step {r['step']}: {r['minutes']:.1f} min "
          + (f"reward {r['val_reward']:.4f} " if "val_reward" in r else "") + f"valid {r['val_valid_rate']:.3f} "
          f"R@1 {r['val_recall1']:.3f} / 0.9: {r['val_valid_rate_0.9']:.3f} tok {r['val_tokens_per_forward_0.9']:.2f}"
          for r in rows[run.name]["val"] if r["step"] or "val_reward" in r))
    if test:
        t9 = test["by_tau"]["0.9"]
        print(f"{'':18s} test: tau=1.0 R@1 {test['recall@1']:.3f} valid {test['valid_rate']:.3f} | tau=0.9 R@1 "
              f"{t9['recall@1']:.3f} valid {t9['valid_rate']:.3f} tok/fwd {t9['tokens_per_forward']:.2f} (n {t9['n']})")
Path(sys.argv[1], "summary.json").write_text(json.dumps(rows, indent=1))
EOF
# What comes back from the device (at most 8 files of 16 MB each): the logs, and the checkpoints two to a tar.
tar -czf "$OUT/logs.tgz" -C out-sweep logs
runs=($(cd out-sweep && ls -d */ | tr -d / | grep -vx logs)); n=0
for ((i = 0; i < ${#runs[@]}; i += 2)); do
  n=$((n + 1)); tar -cf "$OUT/models$n.tar" -C out-sweep --exclude=last --exclude='predictions*' "${runs[@]:i:2}"
done
ls -la "$OUT"
