#!/bin/bash
# The two GPU training runs of the README's "Trained longer on a GPU" section, as they ran on one H200
# (torch 2.11 + CUDA 13 there; transformers 5.24.0, datasets 5.2.0, dill, multiprocess carried as wheels
# in .whl/, since that machine reaches no package index). gpu/sft and gpu/cft2 are copies of build 2's
# out/sft and out/cft (weights, config, tokenizer: no optimizer state), carried there with data/synthetic.
# They computed in float32, the default then; `--dtype float32` says so now that the default (auto) is bf16-mixed
# on a GPU.
#
#   bash docs/gpu_train.sh train    # CFT for 8 epochs (stopped by the 270 s limit at step 3,571 of 3,573;
#                                   # the checkpoint kept is step 3,129's), then OPD, 16 prompts a step
#   bash docs/gpu_train.sh opd2     # the ablation: the same OPD from the CPU's 2-epoch CFT (out/cft)
#
# Without the `timeout`s (they fitted the runs into a 15-minute loan) CFT runs its full 8 epochs: the
# stage resumes from out-gpu/cft/last if it is stopped. Afterwards, on the CPU: out-gpu/sft and
# out-gpu/naive link to ../out/sft and ../out/naive, and
#   python rl.py --data data/synthetic --init out-gpu/opd --out out-gpu/rl
#   python eval.py --report --run out-gpu --data data/synthetic
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-out-gpu-logs}; mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl &&
    export PYTHONPATH=/tmp/site || exit 1
fi
case "${1:-train}" in
  train)
    timeout 270 python3 cft.py --data data/synthetic --init gpu/sft --out out-gpu/cft --device cuda --dtype float32 \
      --epochs 8 --batch-size 16 --eval-every 447 > "$OUT/cft.log" 2>&1
    timeout 225 python3 opd.py --data data/synthetic --init out-gpu/cft --teacher gpu/sft --out out-gpu/opd \
      --device cuda --dtype float32 --commit prefix --prompts-per-step 16 --steps 80 > "$OUT/opd.log" 2>&1 ;;
  opd2)
    timeout 195 python3 opd.py --data data/synthetic --init gpu/cft2 --teacher gpu/sft --out out-gpu2/opd \
      --device cuda --dtype float32 --commit prefix --prompts-per-step 16 --steps 80 > "$OUT/opd2.log" 2>&1 ;;
  *) echo "usage: bash docs/gpu_train.sh [train|opd2]" >&2; exit 2 ;;
esac
