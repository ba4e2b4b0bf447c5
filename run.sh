#!/usr/bin/env bash
# The whole Diffusion-GR2 recipe in one command: data -> AR re-ranker -> naive conversion -> CFT -> OPD -> RL -> report.
#
#   bash run.sh                                   # the synthetic task on a CPU, every stage at its script's defaults
#   bash run.sh --device cuda --out out-gpu       # the same on a GPU
#   bash run.sh --data beauty --raw ../shared/data/amazon-beauty --out out-beauty   # a real catalogue -> data/beauty
#   bash run.sh --warmup ...                      # first teach the random-init model to copy SIDs (warmup.py)
#
# Every stage is the paper's recipe (METHOD.md); each is also a script of its own, and this prints its command.
# A finished stage (its metrics.json exists) is skipped; an interrupted one resumes from OUT/<stage>/last.
set -euo pipefail
cd "$(dirname "$0")"

NAME=synthetic RAW="" OUT=out DEVICE=cpu WARMUP=""
while [ $# -gt 0 ]; do
  case "$1" in
    --data) NAME="$2"; shift 2 ;;
    --raw) RAW="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --device) DEVICE="$2"; shift 2 ;;
    --warmup) WARMUP=1; shift ;;
    -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
    *) echo "run.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
if [ "$NAME" != synthetic ] && [ -z "$RAW" ] && [ ! -f "data/$NAME/stats.json" ]; then
  echo "run.sh: --data $NAME is not built yet: give its catalogue folder with --raw DIR" >&2; exit 2
fi

DATA="data/$NAME"
TIMES=""
stage() {  # stage NAME COMMAND...: run it unless OUT/NAME/metrics.json says it finished, and note its time
  local name="$1"; shift
  if [ -f "$OUT/$name/metrics.json" ]; then echo "== $name: done ($OUT/$name/metrics.json)"; return; fi
  echo "== $name: $*"
  local t0=$SECONDS
  "$@"
  local t=$((SECONDS - t0))
  TIMES="$TIMES$(printf '%-7s %3d min %02d s' "$name" $((t / 60)) $((t % 60)))\n"
}

mkdir -p "$OUT"
T0=$SECONDS
if [ ! -f "$DATA/stats.json" ]; then
  stage data python data.py --out "$DATA" ${RAW:+--raw "$RAW"}
fi
D="--data $DATA --device $DEVICE"
if [ -n "$WARMUP" ]; then
  stage warmup python warmup.py $D --out "$OUT/warmup"
fi
stage sft    python sft.py $D --out "$OUT/sft" ${WARMUP:+--model "$OUT/warmup"}
stage naive  python cft.py $D --init "$OUT/sft" --out "$OUT/naive" --steps 0
stage cft    python cft.py $D --init "$OUT/sft" --out "$OUT/cft"
stage opd    python opd.py $D --init "$OUT/cft" --teacher "$OUT/sft" --out "$OUT/opd"
stage rl     python rl.py  $D --init "$OUT/opd" --out "$OUT/rl"
stage report python report.py --run "$OUT" --data "$DATA" --device "$DEVICE"
echo
echo "== finished in $(( (SECONDS - T0) / 60 )) min"
printf "$TIMES"
echo "results: $OUT/results.md (tables), $OUT/curves.png, $OUT/frontier.png, $OUT/masks.png (figures)"
echo "watch the final model denoise: python decode.py --show --ckpt $OUT/rl --data $DATA"
