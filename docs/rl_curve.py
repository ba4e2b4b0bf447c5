"""The RL reward curve of the README: held-out and rollout reward of 40-step rl.py runs.

    python docs/rl_curve.py --cpu-run out/rl-pj40 --out docs/rl-curve.png

Left: the held-out reward (greedy tau = 1.0 answers on 200 validation prompts, the number rl.py keeps its best
checkpoint by) of the CPU run and of the H200 runs in docs/gpu_h200_cft_sweep.json ("rl"). Right: the mean reward
of each step's 128 rollouts (new prompts every step, so it is noisy), CPU run only.
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from report import pyplot, save  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--cpu-run", required=True, help="an rl.py OUT folder (its log.jsonl)")
ap.add_argument("--gpu-json", default=str(Path(__file__).parent / "gpu_h200_cft_sweep.json"), help="the H200 runs")
ap.add_argument("--out", default="docs/rl-curve.png", help="PNG to write")
args = ap.parse_args()

log = [json.loads(line) for line in open(Path(args.cpu_run) / "log.jsonl")]
gpu = json.loads(Path(args.gpu_json).read_text()).get("rl", {})
plt = pyplot()
fig, (held, roll) = plt.subplots(1, 2, figsize=(11, 3.8))
held.plot(*zip(*[(r["step"], r["val_reward"]) for r in log if "val_reward" in r]), "k-o", lw=2,
          label="CPU, prefix-joint rollouts (kept: step 30)")
for i, (name, run) in enumerate(gpu.items()):  # rl-any: the paper's rollout rule; the rest prefix-joint
    style = dict(color="tab:gray", ls=":") if "any" in name else dict(color=f"C{i}", ls="--")
    held.plot(*zip(*[(r["step"], r["val_reward"]) for r in run["held_out"]]), marker=".", alpha=0.7,
              label=f"H200 {name}" + (" (the paper's rule)" if "any" in name else ""), **style)
held.set_title("held-out reward (200 validation prompts, tau = 1.0)")
held.legend(fontsize=7, loc="lower right", framealpha=0.6)
roll.plot(*zip(*[(r["step"], r["reward"]) for r in log if "reward" in r]), "k.-", label="mean of 128 rollouts")
roll.set_title("rollout reward (CPU run)")
roll.legend(fontsize=7)
for ax in (held, roll):
    ax.set_xlabel("RL step")
    ax.grid(alpha=0.3)
save(plt, fig, args.out)
print(f"wrote {args.out}")
