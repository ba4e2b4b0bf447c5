"""
Stage 1: conversion fine-tuning (CFT). The AR re-ranker becomes a block-diffusion re-ranker.

Conversion copies every weight of the AR model unchanged and only gives the (never trained) mask
token a sensible embedding, the mean of the real tokens' rows. Decoded in parallel, such a *naive*
conversion writes almost only invalid answers (the paper: valid rate 0.001) -- the structural gap:
positions denoised side by side name the same candidate twice or drop one. `--epochs 0` saves and
evaluates exactly that checkpoint, the paper's "naive" row.

CFT then trains with the masked-diffusion loss of model.py on the fixed teacher traces (reasoning and
answer, weighted lambda_r / lambda_o), in the noisy + clean layout with token shift:

    L_CFT = E_{t_b ~ U(t_min, t_max), x_t ~ q(x_t | x_0, t)} [ sum_{masked i} w_i c_i (-log p(x0_i | x_t, x0_<block)) / sum w_i ]

No constrained decoder anywhere: the valid permutations must come from the model. Validation uses the
real block-diffusion decoder at tau = 1.0 and tau = 0.9, with the commit rule saved in the checkpoint:
by default `prefix-joint` (left to right from the leftmost mask while the product of the committed
confidences stays >= tau, decode.py), which every later stage inherits; `--commit any` is the paper's
rule. The prefix rules only ever decode from a block whose committed tokens are a prefix and whose masks
are the rest, a canvas random masks rarely draw: `--noise-shape suffix` masks every block that way (its
last t * B positions), `--noise-shape mixed` half of them (`--suffix-frac`); measured, neither clearly beat
random masks (README, Stage 1). By default finished tokens stay causal, as the AR parent computed them
(`--context causal`, NBDiff; model.py), and CFT adds the AR loss on the clean copy x_0, read from the same
forward: L = L_CFT + w_AR L_AR (`--ar-weight`, 2.0); `--context block` is METHOD.md's BD3-LM layout,
without the AR loss. Validation is sparse (it decodes); OUT/last is refreshed every `--save-every` steps.

    python cft.py --data data/synthetic --init out/sft --out out/naive --epochs 0    # the naive row
    python cft.py --data data/synthetic --init out/sft --out out/cft                  # CPU: 3200 steps of 5, 35 min
                                                                                      # of training + 2 of test (2 cores)
    python cft.py --data data/synthetic --init out/sft --out out/cft7 --epochs 7 --batch-size 16 --commit prefix \\
        --context block [--device cuda]  # longer, the first recipe to meet the targets: 2.7 h on 2 CPU cores, ~4 min on an H200
    python cft.py --data data/synthetic-qwen3 --init out/sft-qwen --out out/cft-qwen \\
        --dtype bf16-mixed --device cuda --batch-size 16 --lr 1e-5 --epochs 3           # one GPU
"""
import argparse
import math
import time

import torch
from tqdm import tqdm

import data
import eval as metrics
from decode import COMMIT_HELP, COMMIT_RULES, validate
from model import (CONTEXTS, HelpFormatter, Log, add_common_args, batch_indices, collate, context_of, diffusion_loss,
                   init_mask_embedding, keep_best, load_best, load_checkpoint, lr_at, resume, save_checkpoint, save_progress,
                   setup)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("--init", default="out/sft", help="the AR re-ranker checkpoint to convert")
    ap.add_argument("--out", default="out/cft", help="checkpoint folder to write")
    ap.add_argument("--epochs", type=float, default=None,
                    help="passes over the traces, instead of --steps (the paper: 3); 0 = naive conversion")
    ap.add_argument("--block", type=int, default=32, help="block size B")  # [diffusion]
    ap.add_argument("--sub-block", type=int, default=0,  # [diffusion] assumption: 0, the paper's decoder (Fast-dLLM v2: 8)
                    help="decode: commit only inside the leftmost sub-block of this size with masks (0 = anywhere in the block); "
                         "saved with the checkpoint, inherited by opd.py and rl.py")
    ap.add_argument("--t-min", type=float, default=0.02, help="lowest noise level (assumption: U(t_min, t_max))")
    ap.add_argument("--t-max", type=float, default=0.98, help="highest noise level")
    ap.add_argument("--noise-per", choices=["block", "sequence"], default="block",
                    help="one noise level per block (BD3-LM, Fast-dLLM v2) or per response (assumption: block)")
    ap.add_argument("--noise-shape", choices=["random", "suffix", "mixed"], default="random",  # [diffusion] assumption: random
                    help="which tokens of a block a noise level t masks: each with probability t (random, the paper's "
                         "masked diffusion), the last t * block (suffix: the canvases the prefix commit rules decode from), "
                         "or per block one of the two (mixed, suffix with probability --suffix-frac)")
    ap.add_argument("--suffix-frac", type=float, default=0.5,  # [diffusion] assumption: half, with --noise-shape mixed
                    help="with --noise-shape mixed: the share of blocks masked as a suffix")
    ap.add_argument("--inv-t", action="store_true", help="weight each target by 1/t (assumption: off, as Fast-dLLM v2)")
    ap.add_argument("--no-complementary", action="store_true",
                    help="do not also train each row with the inverted mask (assumption: complementary masks on)")
    ap.add_argument("--commit", choices=COMMIT_RULES, default="prefix-joint",  # [diffusion] assumption: prefix-joint; the
                    # paper's rule (any) is valid far less often at tau 0.9 (README, Stage 1)
                    help=COMMIT_HELP + "; saved with the checkpoint, inherited like --sub-block")
    ap.add_argument("--context", choices=list(CONTEXTS), default="causal",  # [diffusion] assumption: causal, measured better
                    # than METHOD.md's block (README, CFT section)
                    help="how finished response tokens attend to each other: " +
                         "; ".join(f"{k}: {v}" for k, v in CONTEXTS.items()) + "; saved with the model")
    ap.add_argument("--ar-weight", type=float, default=None,  # [diffusion] assumption: 2.0 (NBDiff adds one; 2.0 measured best, README, Stage 1)
                    help="weight of an AR loss on the clean copy x_0, read from the same forward; needs --context causal "
                         "(default: 2.0 with --context causal, 0 with block)")
    ap.add_argument("--save-every", type=int, default=50,
                    help="refresh OUT/last (what an interrupted run resumes from) every this many steps between validations")
    add_common_args(ap, steps=3200, batch_size=5, lr=7e-4, warmup=50, eval_every=800, val_n=100)  # assumption: 3200
    # steps of 5 (2.24 epochs; the paper trains 3): what fits the stage's 45 minutes on a 2-core CPU. The same traces
    # in fewer, larger steps (1000 of 16) were less valid at tau 0.9 (0.845 against 0.910: README, Stage 1).
    # A validation decodes 2 x 100 examples (about 1.5 minutes there); it never changes the training (the noise is per step)
    args = ap.parse_args(argv)
    if not 0 <= args.suffix_frac <= 1:
        ap.error(f"--suffix-frac is a share of blocks, between 0 and 1, got {args.suffix_frac}")
    if not 0 <= args.sub_block <= args.block:
        ap.error(f"--sub-block must be between 0 (off) and --block {args.block}, got {args.sub_block}")
    if args.ar_weight is None:
        args.ar_weight = 2.0 if args.context == "causal" else 0.0
    if args.ar_weight and args.context != "causal":
        ap.error("--ar-weight needs --context causal (under block context x_0 sees its whole block)")
    return args


def convert(init, attn, dtype, context="causal"):  # [diffusion]
    """The AR checkpoint as a block-diffusion model: same weights, the mask token's row initialised, the
    context rule set in its config (model.CONTEXTS; saved with it, read by every later forward)."""
    model, tok, parent = load_checkpoint(init, attn, dtype)
    if parent.get("block_size"):
        print(f"note: {init} is already a block-diffusion checkpoint (block {parent['block_size']})")
        if context_of(model) != context:
            raise ValueError(f"{init} was trained with --context {context_of(model)}, not {context}")
    else:
        init_mask_embedding(model, tok.mask_token_id, len(tok))
        model.config.diffusion_context = context
    return model, tok, parent


def main(argv=None):
    args = parse_args(argv)
    out = setup(args)
    train, valid, test, sid = data.load_splits(args.data, args.val_n, args.test_n)
    model, tok, parent = convert(args.init, args.attn, args.dtype, args.context)
    model.to(args.device)
    max_new = args.block * math.ceil(parent["max_new"] / args.block)  # [diffusion] whole blocks
    dec = {"sub_block": args.sub_block, "commit": args.commit}  # [diffusion] the decoder every later stage inherits
    naive = args.epochs == 0  # [diffusion] no training at all
    stage = {"stage": "naive" if naive else "cft", "parent": str(args.init), "block_size": args.block, **dec,
             "context": args.context,
             "mask_token_id": tok.mask_token_id, "data": str(args.data), "max_new": max_new, "args": vars(args)}
    if naive:
        save_checkpoint(out, model, tok, {**stage, "step": 0})
        return metrics.run_test(out, model, tok, test, sid, "diffusion", args.block, max_new, args.eval_batch,
                                metrics.SPEED_TAUS, args.tau_n, **dec)

    steps = args.steps if args.epochs is None else max(1, round(args.epochs * len(train) / args.batch_size))
    copies = "one noisy copy" if args.no_complementary else "two noisy copies (complementary masks)"
    print(f"CFT: {steps} steps of {args.batch_size} = {steps * args.batch_size / len(train):.2f} epochs of {len(train)} "
          f"traces, {copies} per row, block {args.block}, {args.context} context"
          + (f", AR loss on x_0 x {args.ar_weight}" if args.ar_weight else ""))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.98))
    start, state = (0, {}) if args.fresh else resume(out, model, opt)
    best, log = state.get("best", -1.0), Log(out, start)
    t0, losses = time.time() - state.get("elapsed", 0.0), []
    if start == 0:  # the curve starts at the naive conversion
        log(step=0, minutes=0.0, **validate(model, tok, valid, sid, "diffusion", args.block, max_new, args.eval_batch, **dec)[0])
    bar = tqdm(range(start, steps), initial=start, total=steps, desc="cft", dynamic_ncols=True)
    for step in bar:
        model.train()
        batch = collate([train[i] for i in batch_indices(step, len(train), args.batch_size, args.seed)])
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, args.lr, args.warmup)
        noise = torch.Generator().manual_seed(args.seed * 100003 + step)  # resumable: the noise depends on the step
        loss, n_scored = diffusion_loss(model, batch, args.block, tok.mask_token_id, tok.eos_token_id,  # [diffusion]
                                        args.lambda_r, args.lambda_o, (args.t_min, args.t_max), args.noise_per,
                                        args.inv_t, not args.no_complementary, pad_id=tok.pad_token_id, generator=noise,
                                        noise_shape=args.noise_shape, ar_weight=args.ar_weight,
                                        suffix_frac=args.suffix_frac)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        bar.set_postfix(loss=f"{loss.item():.3f}", lr=f"{opt.param_groups[0]['lr']:.1e}")
        if (step + 1) % args.eval_every == 0 or step + 1 == steps:
            val, _ = validate(model, tok, valid, sid, "diffusion", args.block, max_new, args.eval_batch, **dec)
            rec = log(step=step + 1, minutes=(time.time() - t0) / 60, loss=sum(losses) / len(losses), **val)
            losses = []
            tqdm.write(f"step {rec['step']:5d} | {rec['minutes']:5.1f} min | loss {rec['loss']:.4f} | tau=1.0 valid "
                       f"{val['val_valid_rate']:.3f} R@1 {val['val_recall1']:.3f} | tau=0.9 valid "
                       f"{val['val_valid_rate_0.9']:.3f} R@1 {val['val_recall1_0.9']:.3f} "
                       f"tok/fwd {val['val_tokens_per_forward_0.9']:.2f}")
            score = val["val_valid_rate"] + val["val_valid_rate_0.9"] + val["val_recall1"]
            best = keep_best(out, model, tok, stage, opt, step + 1, val, score, best, t0)
        elif (step + 1) % args.save_every == 0:  # validation is sparse (it decodes): stay resumable in between
            save_progress(out, model, tok, stage, opt, step + 1, {"best": best, "elapsed": time.time() - t0})

    model, tok, stage = load_best(out, args, "CFT", t0, tok)
    return metrics.run_test(out, model, tok, test, sid, "diffusion", args.block, max_new, args.eval_batch, metrics.SPEED_TAUS,
                            args.tau_n, **dec)


if __name__ == "__main__":
    main()
