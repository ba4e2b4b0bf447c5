"""
The report's figures: every stage's validation curves, the speed/accuracy frontier of the decoders, and the
attention masks drawn by model.py's own mask function. matplotlib is imported only when a figure is drawn.
"""
from pathlib import Path

from model import NOISY, attention_mask, build_rows
from plumbing import read_jsonl


def pyplot():
    """matplotlib's pyplot without a display (imported only when a figure is drawn)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save(plt, fig, path):
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_curves(run, path):
    """Training curves of every stage, read from OUT/<stage>/log.jsonl."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 4, figsize=(18, 3.8))
    panels = [("sft", [("val_valid_rate", "valid rate"), ("val_recall1", "Recall@1")], "AR re-ranker (validation)"),
              ("cft", [("val_valid_rate", "valid, tau=1.0"), ("val_valid_rate_0.9", "valid, tau=0.9"),
                       ("val_recall1", "R@1, tau=1.0")], "CFT (validation)"),
              ("opd", [("kl", "rollout KL to teacher"), ("rollout_valid_rate", "rollout valid rate")], "OPD"),
              ("rl", [("reward", "rollout reward"), ("val_reward", "held-out reward")], "RL")]
    for ax, (stage, keys, title) in zip(axes, panels):
        log = Path(run) / stage / "log.jsonl"
        if log.exists():
            recs = read_jsonl(log)
            for k, label in keys:
                pts = [(r["step"], r[k]) for r in recs if k in r]
                if pts:
                    ax.plot(*zip(*pts), marker="." if len(pts) < 30 else None, label=label)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    save(plt, fig, path)


def plot_frontier(rows, path):
    """Valid rate and Recall@1 (rows) against tokens per forward (hardware-independent) and against the measured
    speed-up (columns), every decoder at batch 1: each line is one model and rule across tau."""
    plt = pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), sharey="row")
    sel = [r for r in rows if r["batch"] == min(r["batch"] for r in rows)]
    ar = next(r for r in sel if r["decoder"] == "ar")
    families = list(dict.fromkeys((r["model"], r["decoder"], r["commit"]) for r in sel if r["decoder"] != "ar"))
    styles = {"threshold": "o-", "left-to-right": "^--"}
    for row, metric in enumerate(("valid_rate", "recall@1")):
        for col, key in enumerate(("tokens_per_forward", "speedup")):
            ax = axes[row, col]
            for model, decoder, commit in families:
                line = sorted((r for r in sel if (r["model"], r["decoder"], r["commit"]) == (model, decoder, commit)),
                              key=lambda r: r["tau"])
                style = "s:" if decoder == "draft-verify" else styles[commit]
                ax.plot([r[key] for r in line], [r[metric] for r in line], style, label=f"{model} {decoder} {commit}")
                for r in line:
                    ax.annotate(f"{r['tau']}", (r[key], r[metric]), fontsize=7)
            ax.scatter([ar[key]], [ar[metric]], marker="*", s=140, color="k", label="AR", zorder=3)
            ax.axhline(ar[metric] - 0.02, color="k", lw=0.6, ls=":")  # parity: no more than 0.02 below AR
            ax.set_xlabel("tokens per forward (labels: tau)" if key == "tokens_per_forward" else
                          "wall-clock speed-up over AR (this machine)")
            ax.set_ylabel(metric.replace("_", " "))
            ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=7)
    save(plt, fig, path)


def plot_masks(path, prompt=3, response=8, block=4):
    """The two attention patterns, drawn from model.py's own mask function (rows attend to columns)."""
    plt = pyplot()
    x_t = [[3] * response]  # a noisy copy of the one row; CFT's row holds two (complementary masks)
    train = build_rows([[1] * prompt], [[2] * response], block, noisy=[x_t, x_t])
    dec = build_rows([[1] * prompt], [[2] * response], block)
    active = 1  # decoding: block 1 is being denoised; the prompt and block 0 sit in the KV cache
    dec["seg"][0, prompt + active * block:prompt + (active + 1) * block] = NOISY
    masks = [attention_mask(*[(r["seg"], r["blk"], r["pos"])] * 2)[0, 0].float() for r in (train, dec)]
    rows = slice(prompt + active * block, prompt + (active + 1) * block)
    masks[1][rows] *= 2  # the rows computed at each denoising step
    names = [["prompt"] * prompt + [f"{x} b{j // block}" for x in ("x_t", "x_t'", "x_0") for j in range(response)],
             ["prompt"] * prompt + [f"b{j // block}" + (" (active)" if j // block == active else "") for j in range(response)]]
    titles = [f"CFT's training row [prompt | noisy x_t | its complement x_t' | clean x_0], B = {block}",
              f"decoding: block {active} denoised against the cache"]
    fig, axes = plt.subplots(1, 2, figsize=(15, 7.5), gridspec_kw={"width_ratios": [27, 11]})
    for ax, m, n, title in zip(axes, masks, names, titles):
        ax.imshow(m.numpy(), cmap="YlGnBu", vmin=0, vmax=2.3)  # numpy: matplotlib warns on tensors
        ax.set_xticks(range(len(n)), n, rotation=90, fontsize=7)
        ax.set_yticks(range(len(n)), n, fontsize=7)
        ax.set_title(title, fontsize=10)
        for x in range(prompt, len(n), block):
            ax.axvline(x - 0.5, color="grey", lw=0.5)
            ax.axhline(x - 0.5, color="grey", lw=0.5)
    save(plt, fig, path)
