"""
The paper's two tables for one pipeline run, with its figures.

`python report.py --run out --data data/synthetic` evaluates every checkpoint of the run (sft, ar-rl, naive,
cft, opd, rl) on the same test examples and writes into the run's folder:

    results.md / results.json   Table 1, the stage ladder at tau = 1.0 (AR greedy), 95% bootstrap intervals,
                                paired differences to the row above, the reasoning proxy and invalid causes;
                                Table 1b, the diffusion stages at tau = 0.9, paired on the same examples, with the
                                final model also decoded left to right (beyond the paper) beside the paper's rule;
                                Table 2, decoding speed of AR against the final model at tau = 0.9, 0.6, 0.4, both
                                commit rules, and draft-verify (the final model drafts, the AR model verifies: its
                                exact greedy answers), every decoder in float32 (harness.bench_checkpoints), with
                                --also's models beside the final one and each decoder's speed at parity
    frontier.png, curves.png, masks.png   speed/accuracy frontier, training curves, the attention masks
    report/                     predictions of every decode the report had to make itself

A stage's own predictions*.jsonl are reused when they cover the test examples (a stage deletes them when
it starts training, so they always belong to its checkpoint). `python report.py --paired A.jsonl B.jsonl
--data DIR` compares any two predictions files of the same test examples (B - A, paired bootstrap).
Scoring is eval.py's, decoding decode.py's (through harness.py); nothing here re-implements them.
"""
import argparse
import json
from pathlib import Path

import numpy as np
from transformers import AutoTokenizer

import data
from decode import COMMIT_RULES
from eval import (INVALID_CAUSES, METRIC_KEYS, SID_RE, bootstrap_ci, floor_rows, invalid_cause, paired_bootstrap,
                  score_responses, sid_str, summarize)
from figures import plot_curves, plot_frontier, plot_masks
from harness import SPEED_TAUS, bench_checkpoints, evaluate, write_predictions
from plumbing import DTYPE_HELP, DTYPES, HelpFormatter, check_tokenizer, load_checkpoint, read_jsonl, resolve_dtype, write_atomic

# The AR rows: sft.py's model, and GR2's RL stage on it (rl.py --init sft) where the run has one. The last of them
# is the run's AR reference (the paper's GR2 row): the diffusion stages start from it and are measured against it.
AR_STAGES = ("sft", "ar-rl")
STAGES = [("sft", "AR re-ranker (SFT)"), ("ar-rl", "AR re-ranker (SFT + RL)"), ("naive", "naive conversion"), ("cft", "+ CFT"),
          ("opd", "+ CFT + OPD"), ("rl", "+ CFT + OPD -> RL")]
PAPER = {"retriever floor": (0.2811, 0.5591, 0.4401), "AR re-ranker (SFT)": (0.2960, 0.5651, 0.4497),
         "AR re-ranker (SFT + RL)": (0.2960, 0.5651, 0.4497),  # the paper's one AR row, GR2 (SFT + RL)
         "naive conversion": (0.2811, 0.5591, 0.4401), "+ CFT": (0.2930, 0.5651, 0.4497),
         "+ CFT + OPD": (0.2944, 0.5658, 0.4497), "+ CFT + OPD -> RL": (0.2951, 0.5671, 0.4517)}


def reasoning_quality(preds, examples, sid_of):
    """Share of SIDs cited in the reasoning that are in the history or the candidates (a hallucination proxy)."""
    real, cited = 0, 0
    for p, ex in zip(preds, examples):
        known = {sid_of[i] for i in list(ex["history"]) + list(ex["candidates"])}
        reasoning = p["response"].split("</think>")[0]
        for m in SID_RE.finditer(reasoning):
            cited += 1
            real += sid_str(*m.groups()) in known
    return real / cited if cited else float("nan")


def stage_predictions(run, stage, examples, sid_of, tok, tau=1.0, device="cpu", commit="threshold", dtype="float32"):
    """The stage's own predictions at `tau` when they cover `examples`, else a fresh decode (kept in run/report).
    commit="left-to-right" always decodes afresh: the stages test with the paper's rule."""
    name = "predictions.jsonl" if tau == 1.0 else f"predictions_tau{tau}.jsonl"
    fresh = Path(run) / "report" / (f"{stage}_{name}" if commit == "threshold" else f"{stage}_{commit}_{name}")
    for path in ((Path(run) / stage / name, fresh) if commit == "threshold" else (fresh,)):
        if path.exists() and path.stat().st_mtime >= (Path(run) / stage / "stage.json").stat().st_mtime:
            by_id = {p["id"]: p for p in read_jsonl(path)}
            if all(ex["id"] in by_id for ex in examples):  # it covers these examples (maybe more)
                return [by_id[ex["id"]] for ex in examples]
    model, _, st = load_checkpoint(Path(run) / stage, dtype=dtype, tok=tok)
    mode = "diffusion" if st.get("block_size") else "ar"
    print(f"decoding {len(examples)} test examples with {stage} at tau = {tau} ({commit}) ...")
    _, rows, texts, roll = evaluate(model.to(device), tok, examples, sid_of, mode, st.get("block_size") or 1, tau,
                                    st["max_new"], 64, True, commit)
    write_predictions(fresh, examples, sid_of, texts, rows, roll)
    return read_jsonl(fresh)


def ladder(entries, examples, sid_of, tok):
    """Rows of a stage ladder: metrics with 95% bootstrap intervals, the reasoning proxy, and paired
    differences to the row above (the naive row is skipped as a reference: it is the floor by fallback).

    entries: (stage, name, predictions or None for the floor) in ladder order."""
    rows, prev = [], None
    for stage, name, preds in entries:
        per = floor_rows(examples) if preds is None else score_responses([p["response"] for p in preds], examples, sid_of)
        s = summarize(per)
        row = {"name": name, "stage": stage, **{k: s[k] for k in (*METRIC_KEYS, "valid_rate", "invalid", "n")}}
        for k in ("recall@1", "recall@3", "ndcg@3"):
            row[k + "_ci"] = bootstrap_ci([r[k] for r in per])
        row["valid_rate_ci"] = bootstrap_ci([r["validity"] == "valid" for r in per])
        if preds is not None:
            row["identity_rate"] = s["identity_rate"]  # answers copying the retriever order: the reward-hacking signal
            row["reasoning_grounded"] = reasoning_quality(preds, examples, sid_of)
            causes = [invalid_cause(p["response"], p["candidates"]) for p in preds if p["validity"] != "valid"]
            row["invalid_causes"] = {c: causes.count(c) for c in INVALID_CAUSES if c in causes}
            row["reasoning_tokens"] = float(np.mean([len(tok(p["response"].split("</think>")[0] + "</think>",
                                                             add_special_tokens=False).input_ids) for p in preds]))
            if all("nfe" in p and "n_tokens" in p for p in preds):
                row["tokens_per_forward"] = sum(p["n_tokens"] for p in preds) / max(1, sum(p["nfe"] for p in preds))
        if prev is not None and stage != "naive":
            for k in ("recall@1", "ndcg@3"):
                row[f"delta_{k}_vs_prev"] = paired_bootstrap([r[k] for r in prev], [r[k] for r in per])
        if stage != "naive":
            prev = per
        row["paper"] = dict(zip(("recall@1", "recall@3", "ndcg@3"), PAPER.get(name, (None,) * 3)))
        rows.append(row)
    return rows


def table1(run, test, sid_of, tok, device="cpu", dtype="float32"):
    """The stage ladder at tau = 1.0 (AR greedy for the AR re-ranker)."""
    entries = [("floor", "retriever floor", None)]
    entries += [(stage, name, stage_predictions(run, stage, test, sid_of, tok, 1.0, device, dtype=dtype))
                for stage, name in STAGES if (Path(run) / stage / "stage.json").exists()]
    return ladder(entries, test, sid_of, tok)


def table1b(run, examples, sid_of, tok, final, tau=0.9, device="cpu", dtype="float32"):
    """The diffusion stages at a parallel threshold, paired on the same examples: does each stage keep its gains?
    The AR re-ranker (greedy) is the reference row, so CFT's paired difference is its gap to AR. The last row
    decodes the final model left to right (beyond the paper), paired with the same model under the paper's rule."""
    entries = [("floor", "retriever floor", None)]
    entries += [(stage, name, stage_predictions(run, stage, examples, sid_of, tok, 1.0 if stage in AR_STAGES else tau, device,
                                                dtype=dtype))
                for stage, name in STAGES if stage != "naive" and (Path(run) / stage / "stage.json").exists()]
    if final:
        entries.append((f"{final}-ltr", f"{dict(STAGES)[final]}, left to right",
                        stage_predictions(run, final, examples, sid_of, tok, tau, device, "left-to-right", dtype)))
    rows = ladder(entries, examples, sid_of, tok)
    for r in rows:
        r["paper"] = {}
    return rows


def fmt_ci(row, k):
    lo, hi = row[k + "_ci"]
    return f"{row[k]:.4f} [{lo:.3f}, {hi:.3f}]"


def invalid_lines(rows):
    """results.md lines: the invalid answers of each row by cause (eval.invalid_cause)."""
    rows = [r for r in rows if r.get("invalid_causes")]
    if not rows:
        return []
    return ["", "Invalid answers by where the trace went wrong (`eval.invalid_cause`):", ""] + [
        f"- {r['name']}: " + ", ".join(f"{c} {n}" for c, n in r["invalid_causes"].items()) for r in rows]


def paired(path_a, path_b, data_dir):
    """Two predictions.jsonl of the same test examples, paired: each one's metrics, then B - A (95% intervals).

    Any two decodes can be compared this way (two stages, two decoders, two runs on the same data)."""
    for path in (path_a, path_b):
        if not Path(path).is_file():
            raise SystemExit(f"error: no predictions file at {path}")
    a, b = read_jsonl(path_a), read_jsonl(path_b)
    if [p["id"] for p in a] != [p["id"] for p in b]:
        raise SystemExit(f"error: {path_a} and {path_b} do not hold the same examples in the same order")
    test, sid_of = data.load_split(data_dir, "test")
    by_id = {ex["id"]: ex for ex in test}
    stray = [p["id"] for p in a if p["id"] not in by_id]
    if stray:
        raise SystemExit(f"error: {len(stray)} examples of {path_a} are not test examples of {data_dir} (first: id {stray[0]})")
    tok = AutoTokenizer.from_pretrained(Path(data_dir) / "tokenizer")
    rows = ladder([("a", f"A {path_a}", a), ("b", f"B {path_b}", b)], [by_id[p["id"]] for p in a], sid_of, tok)
    for r in rows:
        print(f"{r['name']} (n = {r['n']}): Recall@1 {fmt_ci(r, 'recall@1')}, NDCG@3 {fmt_ci(r, 'ndcg@3')}, "
              f"valid {r['valid_rate']:.3f}, copies retriever {r['identity_rate']:.3f}")
    d, e = rows[1]["delta_recall@1_vs_prev"], rows[1]["delta_ndcg@3_vs_prev"]
    print(f"B - A, paired: Recall@1 {d[0]:+.4f} [{d[1]:+.3f}, {d[2]:+.3f}], NDCG@3 {e[0]:+.4f} [{e[1]:+.3f}, {e[2]:+.3f}]")
    return rows


def speed_lines(t2, ar, final, ratio, n):
    """results.md's Table 2."""
    lines = ["", f"## Table 2: decoding speed, AR (`{ar}`) against `{final}` (first {n} test prompts, this machine, float32)", "",
             f"Block {t2[1]['block']}; one block forward costs {ratio:.2f}x a 1-token AR step here (batch 1). *threshold* is "
             "the paper's commit rule; *left-to-right* commits from the leftmost mask while the product of the "
             "confidences is >= tau (beyond the paper). *draft-verify* (beyond the paper): the final model drafts each "
             "block at tau, the AR model checks the draft in one forward and keeps what it would have written itself, so "
             "the answers are AR's; *same as AR*: share of answers identical to the AR row's, token for token; tokens per "
             "forward counts the forwards of both models.", "",
             "| decoder | batch | Recall@1 | valid rate | tokens/s | tokens per forward | speed-up | same as AR "
             "| tokens per verify |", "|---|---|---|---|---|---|---|---|---|"]
    for r in t2:
        name = "AR" if r["decoder"] == "ar" else f"`{r['model']}` {r['decoder']} {r['commit']} tau = {r['tau']}"
        exact = f"{r['same_as_ar']:.3f} | {r['tokens_per_verify']:.2f}" if r["decoder"] == "draft-verify" else " | "
        lines.append(f"| {name} | {r['batch']} | {r['recall@1']:.3f} | {r['valid_rate']:.3f} | {r['tokens_per_s']:.1f} | "
                     f"{r['tokens_per_forward']:.2f} | {r['speedup']:.2f}x | {exact} |")
    return lines + parity_lines(t2) + ["", "![speed/accuracy frontier](frontier.png)"]


def at_parity(t2, margin=0.02):
    """Per batch and decoder (model, decoder, rule): its row at the lowest tau whose valid rate and Recall@1 are
    both no more than `margin` below AR's, or None where no tau measured is."""
    found = []
    for bs in sorted({r["batch"] for r in t2}):
        sel = [r for r in t2 if r["batch"] == bs]
        ar = next(r for r in sel if r["decoder"] == "ar")
        for fam in dict.fromkeys((r["model"], r["decoder"], r["commit"]) for r in sel if r["decoder"] != "ar"):
            ok = [r for r in sel if (r["model"], r["decoder"], r["commit"]) == fam
                  and r["valid_rate"] >= ar["valid_rate"] - margin and r["recall@1"] >= ar["recall@1"] - margin]
            found.append((bs, fam, min(ok, key=lambda r: r["tau"]) if ok else None))
    return found


def parity_lines(t2):
    lines = ["", "At parity: each decoder at the lowest tau whose valid rate and Recall@1 are both no more than 0.02 "
             "below AR's (the taus above).", "", "| decoder | batch | tau | tokens per forward | speed-up |", "|---|---|---|---|---|"]
    for bs, (model, decoder, commit), r in at_parity(t2):
        lines.append(f"| `{model}` {decoder} {commit} | {bs} | " + (f"{r['tau']} | {r['tokens_per_forward']:.2f} | "
                     f"{r['speedup']:.2f}x |" if r else "not at parity at any tau measured | | |"))
    return lines


def report(run, data_dir, bench_n=100, batch_sizes=(1, 16), taus=SPEED_TAUS, tau_n=200, device="cpu", dtype="float32",
           also=()):
    """Evaluate every checkpoint of `run` on the same test examples; write results.md / results.json and figures.
    dtype: what the report's own decoding and the speed table run in (both decoders alike). also: more
    block-diffusion checkpoints in `run` (such as a latency-OPD model) for the speed table beside the final one."""
    run, dtype = Path(run), resolve_dtype(dtype, device)
    (run / "report").mkdir(parents=True, exist_ok=True)
    test, sid_of = data.load_split(data_dir, "test")
    tok = AutoTokenizer.from_pretrained(Path(data_dir) / "tokenizer")
    final = next((s for s in ("rl", "opd", "cft") if (run / s / "stage.json").exists()), None)
    ar = next((s for s in reversed(AR_STAGES) if (run / s / "stage.json").exists()), None)  # the AR reference
    for stage, _ in STAGES:  # before any decoding: every checkpoint must read this data's token ids
        if (run / stage / "stage.json").exists():
            check_tokenizer(run / stage, AutoTokenizer.from_pretrained(run / stage), data_dir)
    t1 = table1(run, test, sid_of, tok, device, dtype)
    t1b = table1b(run, test[:tau_n] if tau_n else test, sid_of, tok, final, 0.9, device, dtype)
    t2, ratio = [], None
    for name in also:
        if not (run / name / "stage.json").exists():
            raise SystemExit(f"error: --also {name}: {run / name} is not a finished checkpoint")
    if final and ar:
        t2, ratio = bench_checkpoints(run / ar, run / final, test[:bench_n], sid_of, taus, batch_sizes, device,
                                      COMMIT_RULES, dtype=dtype, data_dir=data_dir)
        t2 = [{**r, "model": ar if r["decoder"] == "ar" else final} for r in t2]
        for name in also:  # the paper's rule and draft-verify with this model; speed-ups against the AR row timed beside it
            rows, _ = bench_checkpoints(run / ar, run / name, test[:bench_n], sid_of, taus, batch_sizes, device,
                                        ("threshold",), dtype=dtype, data_dir=data_dir)
            t2 += [{**r, "model": name} for r in rows if r["decoder"] != "ar"]
        plot_frontier(t2, run / "frontier.png")
    plot_curves(run, run / "curves.png")
    plot_masks(run / "masks.png")
    stats = json.loads((Path(data_dir) / "stats.json").read_text())
    result = {"data": str(data_dir), "n_test": len(test), "table1": t1, "table1b_tau0.9": t1b, "table2": t2,
              "forward_cost_ratio": ratio, "dtype": dtype, "ar_reference": ar, "final_diffusion": final, "data_stats": stats}
    write_atomic(run / "results.json", json.dumps(result, indent=2))
    lines = [f"# Diffusion-GR2 results: {data_dir} (test n = {len(test)})", "",
             "## Table 1: the stage ladder (tau = 1.0; AR greedy), 95% bootstrap intervals", "",
             "| method | Recall@1 | Recall@3 | NDCG@3 | valid rate | copies retriever | grounded ids | reasoning tokens "
             "| paper (Beauty, Qwen3-8B) R@1 / R@3 / NDCG@3 |", "|---|---|---|---|---|---|---|---|---|"]
    for r in t1:
        p = r["paper"]
        paper = " / ".join(f"{p[k]:.4f}" for k in ("recall@1", "recall@3", "ndcg@3")) if p["recall@1"] else ""
        extra = (f"{r['identity_rate']:.3f} | {r['reasoning_grounded']:.3f} | {r['reasoning_tokens']:.0f}"
                 if "reasoning_tokens" in r else " | | ")
        lines.append(f"| {r['name']} | {fmt_ci(r, 'recall@1')} | {fmt_ci(r, 'recall@3')} | {fmt_ci(r, 'ndcg@3')} | "
                     f"{r['valid_rate']:.3f} | {extra} | {paper} |")
    lines += ["", "An invalid answer is scored as the retriever order. *copies retriever*: share of answers that are valid "
              "copies of the retriever order; *grounded ids*: share of the SIDs cited in the reasoning that are in the history or the "
              "candidates (a proxy for the paper's judge study); *reasoning tokens*: mean length up to `</think>`."]
    lines += delta_lines(t1, "Paired differences to the row above (mean [95% interval]):") + invalid_lines(t1)
    if len(t1b) > 1:
        lines += ["", f"## Table 1b: the diffusion stages at tau = 0.9 (first {t1b[0]['n']} test examples), paired", "",
                  "The AR re-ranker (greedy) is the reference row: the first paired difference is CFT's gap to it. The "
                  "last row decodes the final model left to right (beyond the paper), paired with the row above it.", "",
                  "| method | Recall@1 | Recall@3 | NDCG@3 | valid rate | tokens per forward |", "|---|---|---|---|---|---|"]
        for r in t1b:
            tpf = f"{r['tokens_per_forward']:.2f}" if "tokens_per_forward" in r else ""
            lines.append(f"| {r['name']} | {fmt_ci(r, 'recall@1')} | {fmt_ci(r, 'recall@3')} | {fmt_ci(r, 'ndcg@3')} | "
                         f"{r['valid_rate']:.3f} | {tpf} |")
        lines += delta_lines(t1b[2:], "Paired differences to the row above at tau = 0.9:") + invalid_lines(t1b)
    if t2:
        lines += speed_lines(t2, ar, final, ratio, bench_n)
    lines += ["", "![training curves](curves.png)", "", "![attention masks](masks.png)", ""]
    write_atomic(run / "results.md", "\n".join(lines))
    print("\n".join(lines))
    return result


def delta_lines(rows, title):
    rows = [r for r in rows if "delta_recall@1_vs_prev" in r]
    lines = ["", title, ""] if rows else []
    for r in rows:
        d, e = r["delta_recall@1_vs_prev"], r["delta_ndcg@3_vs_prev"]
        lines.append(f"- {r['name']}: Recall@1 {d[0]:+.4f} [{d[1]:+.3f}, {d[2]:+.3f}], NDCG@3 {e[0]:+.4f} [{e[1]:+.3f}, {e[2]:+.3f}]")
    return lines


def time_lines(run, walls):
    """The run's minutes per stage: wall time (this invocation of run.sh) split into training, validation and test
    from each stage's metrics.json; `walls`: {stage: seconds}. The report and data.py only evaluate / build."""
    keys = ("train", "validation", "test")
    lines, total = ["stage     wall   train   validation   test"], dict.fromkeys(("wall", *keys), 0.0)
    for name, seconds in walls.items():
        m = Path(run) / name / "metrics.json"
        parts = json.loads(m.read_text()).get("minutes") if m.exists() else None
        if name == "report":
            parts = {"test": seconds / 60}
        elif not isinstance(parts, dict):  # data.py writes no metrics.json, the warm-up only its total
            parts = {}
        cells = [f"{parts[k]:5.1f}" if k in parts else "    -" for k in keys]
        lines.append(f"{name:<8} {seconds / 60:5.1f}   {cells[0]}   {cells[1]}        {cells[2]}")
        total["wall"] += seconds / 60
        for k, v in parts.items():
            total[k] += v
    lines.append(f"{'total':<8} {total['wall']:5.1f}   {total['train']:5.1f}   {total['validation']:5.1f}        "
                 f"{total['test']:5.1f}   (minutes; the report's decoding counts as test)")
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("--run", default="out", help="the run's output folder (holds sft/, ar-rl/, naive/, cft/, opd/, rl/)")
    ap.add_argument("--data", default="data/synthetic", help="folder written by data.py")
    ap.add_argument("--bench-n", type=int, default=100, help="test prompts for the speed table (the first N)")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16], help="decoding batch sizes for the speed table")
    ap.add_argument("--taus", type=float, nargs="+", default=list(SPEED_TAUS),
                    help="commit thresholds for the speed table's diffusion rows")
    ap.add_argument("--tau-n", type=int, default=200, help="test examples for the tau = 0.9 ladder (0 = all)")
    ap.add_argument("--also", nargs="*", default=[], metavar="STAGE",
                    help="more block-diffusion checkpoints of the run (folders in --run, such as opd-latency) for the "
                         "speed table and the frontier, beside the final model")
    ap.add_argument("--paired", nargs=2, default=None, metavar=("A", "B"),
                    help="only compare two predictions.jsonl of the same test examples of --data: B - A with 95%% intervals")
    ap.add_argument("--masks-figure", default=None, help="only draw the attention-mask figure to this PNG")
    ap.add_argument("--times", nargs="*", default=None, metavar="STAGE:SECONDS",
                    help="only print the run's minutes per stage (train / validation / test), given each stage's wall "
                         "seconds (run.sh's closing lines)")
    ap.add_argument("--device", default="cpu", help="torch device for the decoding the report does")
    ap.add_argument("--dtype", default="float32", choices=["auto", *DTYPES],  # one dtype for both decoders: a fair table
                    help="dtype of the report's own decoding and of both decoders in the speed table: " + DTYPE_HELP)
    args = ap.parse_args(argv)
    if args.times is not None:
        try:
            walls = {name: float(sec) for name, sec in (t.rsplit(":", 1) for t in args.times)}
        except ValueError:
            ap.error(f"--times takes STAGE:SECONDS pairs, got {' '.join(args.times)}")
        print("\n".join(time_lines(args.run, walls)))
    elif args.masks_figure:
        plot_masks(args.masks_figure)
    elif args.paired:
        paired(*args.paired, args.data)
    else:
        report(args.run, args.data, args.bench_n, tuple(args.batch_sizes), tuple(args.taus), args.tau_n, args.device,
               args.dtype, tuple(args.also))


if __name__ == "__main__":
    main()
