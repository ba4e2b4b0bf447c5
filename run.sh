#!/usr/bin/env bash
# The whole Diffusion-GR2 recipe in one command: data -> AR re-ranker (SFT; with --full also its RL, GR2's own) ->
# naive conversion -> CFT -> OPD -> RL -> report.
#
#   bash run.sh                                   # the workshop task on a CPU (5 candidates; about 30 minutes on 2 cores)
#   bash run.sh --full                            # the paper-sized task (10 candidates), 3 epochs of CFT: hours
#   bash run.sh --device cuda --out out-gpu       # either on a GPU
#   bash run.sh --full --data beauty --raw ../shared/data/amazon-beauty --out out-beauty   # a real catalogue
#   bash run.sh --warmup ...                      # first teach the random-init model to copy SIDs (warmup.py)
#
# Every stage is the paper's recipe (METHOD.md); the two sizes differ only in the task and the budgets. Each stage
# is also a script of its own, and this prints its command. A finished stage (its metrics.json exists) is skipped;
# an interrupted one resumes from OUT/<stage>/last. The closing lines split each stage's minutes into training,
# validation and test.
set -euo pipefail
cd "$(dirname "$0")"

NAME="" RAW="" OUT="" DEVICE=cpu WARMUP="" FULL=""
while [ $# -gt 0 ]; do
  case "$1" in
    --data) NAME="$2"; shift 2 ;;
    --raw) RAW="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --device) DEVICE="$2"; shift 2 ;;
    --full) FULL=1; shift ;;
    --warmup) WARMUP=1; shift ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) echo "run.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done

if [ -n "$FULL" ]; then
  # The paper-sized task: 10 candidates, 5 history items, responses of about 231 tokens. CFT runs 3 epochs (the
  # paper's) of the ~6,500 traces at the workshop's lr; assumption: the SFT, OPD and RL budgets (the paper's do not
  # fit a CPU).
  NAME=${NAME:-synthetic} OUT=${OUT:-out-full}
  TASK=""
  SFT="--steps 3000 --batch-size 16 --eval-every 500"
  CFT="--steps 4000 --batch-size 5 --lr 1.5e-3 --eval-every 1000"
  OPD="--steps 32 --eval-every 16"
  RL="--steps 16 --eval-every 8"
  AR_RL="--steps 16 --eval-every 8"  # GR2's own RL stage: its result is the AR row, CFT's start and OPD's teacher
  REPORT=""
else
  # assumption: the workshop task (data.py flags; README "Two sizes of one task"): 5 candidates and 3 history items
  # halve the prompt and the response; 300 validation and test examples keep every evaluation a small share of the
  # run; small SFT batches at lr 6e-3 give more updates a minute; CFT's 1.3 epochs at lr 3e-3 (1.5e-3 converts less).
  NAME=${NAME:-workshop} OUT=${OUT:-out}
  TASK="--candidates 5 --history 3 --max-eval 300"
  SFT="--steps 2400 --batch-size 8 --lr 6e-3 --eval-every 600"
  CFT="--steps 1600 --batch-size 5 --lr 3e-3 --eval-every 400 --val-n 50"
  OPD="--steps 8 --eval-every 4 --val-n 50 --kl-n 32"
  RL="--steps 8 --eval-every 4 --val-n 50"
  AR_RL=""  # assumption: no RL for the AR re-ranker here (it does not fit 30 minutes): SFT's model is the AR row
  REPORT="--bench-n 50"
fi
if [ -n "$RAW" ] && { [ "$NAME" = workshop ] || [ "$NAME" = synthetic ]; }; then
  echo "run.sh: a real catalogue (--raw) needs a name of its own: --data NAME (its data goes to data/NAME)" >&2; exit 2
fi
if [ "$NAME" != synthetic ] && [ "$NAME" != workshop ] && [ -z "$RAW" ] && [ ! -f "data/$NAME/stats.json" ]; then
  echo "run.sh: --data $NAME is not built yet: give its catalogue folder with --raw DIR" >&2; exit 2
fi

DATA="data/$NAME"
STAGES=""
stage() {  # stage NAME COMMAND...: run it unless OUT/NAME/metrics.json says it finished, and note its time
  local name="$1"; shift
  if [ -f "$OUT/$name/metrics.json" ]; then echo "== $name: done ($OUT/$name/metrics.json)"; return; fi
  echo "== $name: $*"
  local t0=$SECONDS
  "$@"
  STAGES="$STAGES $name:$((SECONDS - t0))"
}

mkdir -p "$OUT"
T0=$SECONDS
if [ ! -f "$DATA/stats.json" ]; then
  stage data python data.py --out "$DATA" ${RAW:+--raw "$RAW"} $TASK
fi
D="--data $DATA --device $DEVICE"
if [ -n "$WARMUP" ]; then
  stage warmup python warmup.py $D --out "$OUT/warmup"
fi
stage sft    python sft.py $D --out "$OUT/sft" ${WARMUP:+--model "$OUT/warmup"} $SFT
AR="$OUT/sft"
if [ -n "$AR_RL" ]; then
  stage ar-rl python rl.py $D --init "$OUT/sft" --out "$OUT/ar-rl" $AR_RL
  AR="$OUT/ar-rl"
fi
stage naive  python cft.py $D --init "$AR" --out "$OUT/naive" --steps 0 --taus
stage cft    python cft.py $D --init "$AR" --out "$OUT/cft" $CFT
stage opd    python opd.py $D --init "$OUT/cft" --teacher "$AR" --out "$OUT/opd" $OPD
stage rl     python rl.py  $D --init "$OUT/opd" --out "$OUT/rl" $RL
stage report python report.py --run "$OUT" --data "$DATA" --device "$DEVICE" $REPORT
echo
echo "== finished in $(( (SECONDS - T0) / 60 )) min $(( (SECONDS - T0) % 60 )) s (this invocation)"
python report.py --run "$OUT" --times $STAGES
echo "results: $OUT/results.md (tables), $OUT/curves.png, $OUT/frontier.png, $OUT/masks.png (figures)"
echo "watch the final model denoise: python harness.py --show --ckpt $OUT/rl --data $DATA"
