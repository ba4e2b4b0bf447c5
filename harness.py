"""
The harness: decode a whole split and score it, with the decoders of decode.py and draft_verify.py and
the metrics of eval.py. Every stage validates and tests through `validate` and `test_stage`; report.py
builds its tables from `evaluate` and `bench_checkpoints`. From the command line it times the decoders
against each other or shows one example being denoised step by step:

    python harness.py --show --ckpt out/rl --data data/workshop              # watch one example denoise
    python harness.py --bench --ar out/sft --diffusion out/rl --data data/workshop --json out/bench.json
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch

import eval as metrics
from decode import COMMIT_RULES, CachedModel, Rollout, ar_generate, diffusion_generate
from draft_verify import draft_verify_generate
from plumbing import HelpFormatter, add_runtime_args, load_checkpoint, read_jsonl, resolve_dtype, write_atomic

SPEED_TAUS = (0.9, 0.6, 0.4)  # the paper's speed settings (the speed table; a stage's test adds --taus to tau = 1.0)


def generate(model, tok, prompts, mode, block=32, tau=1.0, max_new=256, batch_size=32, progress=False,
             commit="threshold", teacher=None):
    """Decode `prompts` greedily in length-sorted batches; returns a Rollout in the input order and the seconds
    taken. mode: "ar", "diffusion", or "draft-verify" (`model` drafts, the AR `teacher` verifies)."""
    from tqdm import tqdm
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    synchronize(model.device)
    parts, t0 = {}, time.perf_counter()
    batches = [order[s:s + batch_size] for s in range(0, len(order), batch_size)]
    for idx in tqdm(batches, desc=f"decode {mode}" + (f" tau={tau}" if mode != "ar" else ""),
                    disable=not progress, leave=False):
        batch = [prompts[i] for i in idx]
        if mode == "ar":
            out = ar_generate(model, batch, max_new, tok.eos_token_id, tok.pad_token_id)
        elif mode == "draft-verify":
            out = draft_verify_generate(model, teacher, batch, block, tau, max_new, tok.mask_token_id, tok.eos_token_id,
                                        tok.pad_token_id, commit)
        else:
            out = diffusion_generate(model, batch, block, tau, max_new, tok.mask_token_id, tok.eos_token_id,
                                     tok.pad_token_id, commit=commit)
        for k, i in enumerate(idx):
            parts[i] = (out.tokens[k], out.canvas[k] if out.canvas else None, out.steps[k] if out.steps else None, out.nfe[k],
                        out.counts[k] if out.counts else None)
    synchronize(model.device)
    seconds = time.perf_counter() - t0
    return Rollout(*map(list, zip(*[parts[i] for i in range(len(prompts))]))), seconds  # fields in Rollout's order


@torch.no_grad()
def evaluate(model, tok, examples, sid, mode, block=32, tau=1.0, max_new=256, batch_size=32, progress=False,
             commit="threshold", teacher=None):
    """Decode `examples` greedily and score them: (summary dict, per-example rows, texts, rollout)."""
    model.eval()
    out, seconds = generate(model, tok, [ex["prompt_ids"] for ex in examples], mode, block, tau, max_new,
                            batch_size, progress=progress, commit=commit, teacher=teacher)
    texts = [tok.decode(t, skip_special_tokens=False) for t in out.tokens]
    rows = metrics.score_responses(texts, examples, sid)
    summary = metrics.summarize(rows)
    n_tok = sum(len(t) for t in out.tokens)
    summary.update(tokens_per_forward=n_tok / max(1, sum(out.nfe)), tokens_per_s=n_tok / max(seconds, 1e-9),
                   seconds=seconds, mean_length=n_tok / max(1, len(examples)))
    return summary, rows, texts, out


def validate(model, tok, valid, sid, mode, block, max_new, batch):
    """The training-time check: valid rate and Recall@1 of greedy decoding (and, for diffusion, at tau = 0.9).
    Returns the numbers (with the seconds they took: test_stage splits a stage's time by them) and the
    tau = 1.0 / AR responses (rl.py scores its held-out reward on them)."""
    t0 = time.perf_counter()
    q, _, texts, _ = evaluate(model, tok, valid, sid, mode, block, 1.0, max_new, batch, progress=True)
    res = {"val_valid_rate": q["valid_rate"], "val_recall1": q["recall@1"]}
    if mode == "diffusion":
        f, *_ = evaluate(model, tok, valid, sid, mode, block, 0.9, max_new, batch, progress=True)
        res.update({"val_valid_rate_0.9": f["valid_rate"], "val_recall1_0.9": f["recall@1"],
                    "val_tokens_per_forward_0.9": f["tokens_per_forward"]})
    res["val_seconds"] = time.perf_counter() - t0
    return res, texts


def write_predictions(path, examples, sid_of, texts, rows, roll):
    """OUT/predictions*.jsonl: everything needed to recompute the metrics and study the errors."""
    lines = []
    for k, (ex, text, row) in enumerate(zip(examples, texts, rows)):
        lines.append(json.dumps({"id": ex["id"], "candidates": [sid_of[i] for i in ex["candidates"]],
                                 "target": sid_of[ex["target"]], "response": text, "parsed": row["parsed"],
                                 "validity": row["validity"], "n_tokens": len(roll.tokens[k]), "nfe": roll.nfe[k]}) + "\n")
    write_atomic(path, "".join(lines))


def test_stage(out, model, tok, examples, sid_of, mode, block=32, max_new=256, batch_size=64, tau_n=0, extra=None,
               taus=(0.9,), train_minutes=None, test_since=None):
    """A stage's final test: greedy (AR) or tau = 1.0, plus (diffusion) each of `taus` on the first tau_n examples
    (0 = all). Writes OUT/predictions*.jsonl and then OUT/metrics.json (with `extra` merged in), which marks the
    stage finished, and prints the table. train_minutes: the stage's wall time before the test, which metrics.json
    splits into training and validation (the `val_seconds` of OUT/log.jsonl) beside the test's own minutes, counted
    from now or from `test_since` (a time.time() taken where the stage's test began before this call)."""
    t0 = test_since or time.time()
    quality, rows, texts, roll = evaluate(model, tok, examples, sid_of, mode, block, 1.0, max_new, batch_size, True)
    write_predictions(Path(out) / "predictions.jsonl", examples, sid_of, texts, rows, roll)
    sub, by_tau = examples[:tau_n] if tau_n else examples, {}
    for t in (taus if mode == "diffusion" else ()):  # each threshold keeps its predictions: the report pairs them
        by_tau[t], rows, texts, roll = evaluate(model, tok, sub, sid_of, mode, block, t, max_new, batch_size, True)
        write_predictions(Path(out) / f"predictions_tau{t}.jsonl", sub, sid_of, texts, rows, roll)
    result = {**metrics.stage_metrics(quality, examples, by_tau), **(extra or {})}
    if train_minutes is not None:
        log = Path(out) / "log.jsonl"
        val = sum(r.get("val_seconds", 0.0) for r in read_jsonl(log)) / 60 if log.exists() else 0.0
        result["minutes"] = {"train": max(0.0, train_minutes - val), "validation": val,
                             "test": (time.time() - t0) / 60}
    write_atomic(Path(out) / "metrics.json", json.dumps(result, indent=2))
    print(f"test (n={result['n']})   R@1     R@3     NDCG@3  valid   tok/fwd")
    print(f"  retriever floor   {result['floor']['recall@1']:.4f}  {result['floor']['recall@3']:.4f}  {result['floor']['ndcg@3']:.4f}")
    for label, m in [("AR greedy" if mode == "ar" else "tau=1.0", quality)] + [(f"tau={t}", m) for t, m in by_tau.items()]:
        print(f"  {label:<16}  {m['recall@1']:.4f}  {m['recall@3']:.4f}  {m['ndcg@3']:.4f}  {m['valid_rate']:.3f}  "
              f"{m['tokens_per_forward']:.2f}")
    if "minutes" in result:
        print("minutes: " + ", ".join(f"{k} {v:.1f}" for k, v in result["minutes"].items()))
    return result


# ----------------------------------------------------------------------------- benchmark
def synchronize(device):
    """A GPU runs kernels asynchronously: wait for them before reading a clock (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def forward_seconds(model, prompts, sizes, repeats=20):
    """{n: seconds of one forward of n new tokens per row} against the same cached prompts, for n in `sizes`."""
    state, times = CachedModel(model, prompts, 0), {}
    for n in list(sizes) * 2:  # alternate, keep the second round (warm)
        desc = state.response_desc(0, n, n)
        ids = torch.zeros(len(prompts), n, dtype=torch.long, device=model.device)
        synchronize(model.device)
        t0 = time.perf_counter()
        for _ in range(repeats):
            state.forward(ids, desc, keep=False)
        synchronize(model.device)
        times[n] = (time.perf_counter() - t0) / repeats
    return times


def bench(ar_model, diff_model, tok, examples, sid, taus, batch_sizes, block, max_new, commits=("threshold",), log=print,
          draft_verify=True):
    """Decode the same prompts with AR, with block diffusion at each (commit rule, tau) and (draft_verify) with the
    diffusion model drafting for the AR model at each tau, interleaved chunk by chunk so that every decoder sees the
    same machine load. Returns the rows of the speed table."""
    configs = [("ar", None, None)] + [("diffusion", c, t) for c in commits for t in taus]
    configs += [("draft-verify", "threshold", t) for t in taus] if draft_verify else []  # exact AR answers, faster
    run = lambda c, prompts, bs: generate(ar_model if c[0] == "ar" else diff_model, tok, prompts, c[0], block,
                                          c[2] or 1.0, max_new, bs, commit=c[1] or "threshold", teacher=ar_model)
    for c in configs:  # one untimed decode each: one-off costs (CUDA start-up, kernel choice) would land on AR, run first
        run(c, [examples[0]["prompt_ids"]], 1)
    rows = []
    for bs in batch_sizes:
        acc = {c: {"tokens": 0, "nfe": 0, "seconds": 0.0, "texts": [], "ids": [], "counts": []} for c in configs}
        chunks = range(0, len(examples), bs)
        from tqdm import tqdm
        for s in tqdm(chunks, desc=f"bench batch {bs}", leave=False):
            prompts = [ex["prompt_ids"] for ex in examples[s:s + bs]]
            for c in configs:  # interleaved: AR, then every decoder, on this chunk
                (out, sec), a = run(c, prompts, bs), acc[c]
                a["tokens"] += sum(map(len, out.tokens)); a["nfe"] += sum(out.nfe); a["seconds"] += sec
                a["texts"] += [tok.decode(t) for t in out.tokens]; a["ids"] += out.tokens; a["counts"] += out.counts or []
        ar_speed = acc[configs[0]]["tokens"] / acc[configs[0]]["seconds"]
        for c in configs:
            a, q = acc[c], metrics.summarize(metrics.score_responses(acc[c]["texts"], examples, sid))
            rows.append({"decoder": c[0], "commit": c[1], "tau": c[2], "block": None if c[0] == "ar" else block,
                         "batch": bs, "n": len(examples), "tokens_per_s": a["tokens"] / a["seconds"],
                         "tokens_per_forward": a["tokens"] / a["nfe"], "speedup": a["tokens"] / a["seconds"] / ar_speed,
                         "valid_rate": q["valid_rate"], "recall@1": q["recall@1"], "ndcg@3": q["ndcg@3"],
                         "mean_length": a["tokens"] / len(examples)})
            if c[0] == "draft-verify":  # exact by construction: same_as_ar checks it (float ties aside)
                k = {key: sum(n[key] for n in a["counts"]) for key in ("student", "teacher", "verifies")}
                rows[-1].update(same_as_ar=sum(x == y for x, y in zip(a["ids"], acc[configs[0]]["ids"])) / len(examples),
                                tokens_per_verify=a["tokens"] / max(1, k["verifies"]), student_forwards=k["student"],
                                teacher_forwards=k["teacher"])
            log(format_row(rows[-1]))
    return rows


def bench_checkpoints(ar_path, diff_path, examples, sid, taus, batch_sizes, device="cpu", commits=COMMIT_RULES,
                      attn="sdpa", dtype="float32", data_dir=None):
    """Load an AR and a block-diffusion checkpoint in the same dtype and `bench` them on `examples`.
    Returns (rows, cost of one block forward over a 1-token AR step at batch 1)."""
    ar_model, tok, _ = load_checkpoint(ar_path, attn, dtype, diffusion=False, data=data_dir)
    diff_model, _, stage = load_checkpoint(diff_path, attn, dtype, tok, diffusion=True, data=data_dir)
    ar_model, diff_model = ar_model.to(device).eval(), diff_model.to(device).eval()
    block = stage["block_size"]
    seconds = forward_seconds(diff_model, [examples[0]["prompt_ids"]], (1, block))
    ratio = seconds[block] / seconds[1]
    print(f"speed ({dtype}): {diff_path} against {ar_path}; a {block}-token block forward costs {ratio:.2f}x a 1-token step")
    return bench(ar_model, diff_model, tok, examples, sid, taus, batch_sizes, block, stage["max_new"], commits), ratio


def format_row(r):
    name = "AR" if r["decoder"] == "ar" else f"{r['decoder']} B={r['block']} {r['commit']} tau={r['tau']}"
    extra = (f" | same as AR {r['same_as_ar']:.3f} | {r['tokens_per_verify']:.2f} tok/verify | forwards student "
             f"{r['student_forwards']} teacher {r['teacher_forwards']}" if r["decoder"] == "draft-verify" else "")
    return (f"{name:<40} batch {r['batch']:>3} | {r['tokens_per_s']:8.1f} tok/s | {r['tokens_per_forward']:5.2f} tok/fwd | "
            f"speed-up {r['speedup']:5.2f}x | valid {r['valid_rate']:.3f} | R@1 {r['recall@1']:.3f}" + extra)


# ----------------------------------------------------------------------------- viewer
def show(model, tok, example, block, tau, max_new, commit="threshold"):
    """Print one example being denoised: masks as '·', new commits highlighted, steps per block."""
    tty = sys.stdout.isatty()
    new = (lambda w: f"\033[1;32m{w}\033[0m") if tty else (lambda w: f"*{w}*")
    print(tok.decode(example["prompt_ids"]), "\n")
    per_block = {}

    def on_step(b, s, canvas, committed, logits):  # committed: (1, block) bool, the positions this step wrote
        lo = b * block
        ids = canvas[0, lo:].tolist()
        shown = [("·" if t == tok.mask_token_id else (new(w) if committed[0, j] else w))
                 for j, (t, w) in enumerate(zip(ids, tok.convert_ids_to_tokens(ids)))]
        print(f"block {b} step {s:2d} +{int(committed[0].sum())}: " + " ".join(shown))
        per_block[b] = s + 1

    out = diffusion_generate(model, [example["prompt_ids"]], block, tau, max_new, tok.mask_token_id, tok.eos_token_id,
                             tok.pad_token_id, on_step=on_step, commit=commit)
    n = len(out.tokens[0])
    print(f"\n{n} tokens in {out.nfe[0]} forwards ({n / out.nfe[0]:.2f} tokens per forward); "
          f"steps per block: {[per_block[b] for b in sorted(per_block)]}")
    print("\n" + tok.decode(out.tokens[0]))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("--bench", action="store_true", help="time AR against block diffusion and draft-verify on test prompts")
    ap.add_argument("--show", action="store_true", help="print one example being denoised step by step")
    ap.add_argument("--ar", default="out/sft", help="AR checkpoint (bench)")
    ap.add_argument("--diffusion", default="out/rl", help="block-diffusion checkpoint (bench)")
    ap.add_argument("--ckpt", default="out/rl", help="block-diffusion checkpoint (show)")
    ap.add_argument("--data", default="data/synthetic", help="folder written by data.py")
    ap.add_argument("--n", type=int, default=64, help="test examples to decode (bench)")
    ap.add_argument("--index", type=int, default=0, help="which test example to show")
    ap.add_argument("--taus", type=float, nargs="+", default=[1.0, *SPEED_TAUS], help="commit thresholds (bench)")
    ap.add_argument("--tau", type=float, default=0.9, help="commit threshold (show)")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16], help="decoding batch sizes (bench)")
    ap.add_argument("--commit", choices=COMMIT_RULES, default=None,
                    help="commit rule: threshold (the paper's) or left-to-right (beyond the paper); bench: both by default, "
                         "show: threshold")
    ap.add_argument("--json", default=None, help="write the benchmark rows here")
    add_runtime_args(ap)
    args = ap.parse_args(argv)
    dtype = "float32" if args.dtype == "auto" and args.bench else resolve_dtype(args.dtype, args.device)  # fair timing
    import data
    if args.show:
        model, tok, stage = load_checkpoint(args.ckpt, args.attn, dtype, diffusion=True, data=args.data)
        test, _ = data.load_split(args.data, "test", args.index + 1)
        show(model.to(args.device).eval(), tok, test[args.index], stage["block_size"], args.tau, stage["max_new"],
             args.commit or "threshold")
    elif args.bench:
        test, sid = data.load_split(args.data, "test", args.n)
        rows, ratio = bench_checkpoints(args.ar, args.diffusion, test, sid, args.taus, args.batch_sizes, args.device,
                                        [args.commit] if args.commit else COMMIT_RULES, args.attn, dtype, args.data)
        if args.json:
            write_atomic(args.json, json.dumps({"rows": rows, "forward_cost_ratio": ratio, "device": args.device,
                                                "dtype": dtype, "threads": torch.get_num_threads()}, indent=2))
    else:
        ap.error("choose --bench or --show")


if __name__ == "__main__":
    main()