"""
Stage 1: conversion fine-tuning (CFT). The AR re-ranker becomes a block-diffusion re-ranker.

Conversion copies every weight of the AR model unchanged and only gives the (never trained) mask
token a sensible embedding, the mean of the real tokens' rows. Decoded in parallel, such a *naive*
conversion writes almost only invalid answers (the paper: valid rate 0.001) -- the structural gap:
positions denoised side by side name the same candidate twice or drop one. `--steps 0` saves and
tests exactly that checkpoint, the paper's "naive" row.

CFT then trains with the masked-diffusion loss of model.py on the fixed teacher traces (reasoning and
answer, weighted lambda_r / lambda_o), in the noisy + clean layout with token shift (METHOD.md section 4):

    L_CFT = E_{t_b ~ U(t_min, t_max), x_t ~ q(x_t | x_0, t)} [ sum_{masked i} w_i c_i (-log p(x0_i | x_t, x0_<block)) / sum w_i ]

No constrained decoder anywhere: the valid permutations must come from the model. Validation decodes
with the paper's threshold rule at tau = 1.0 and tau = 0.9; the test adds tau = 0.6 and 0.4.

    python cft.py --data data/synthetic --init out/sft --out out/naive --steps 0      # the naive row
    python cft.py --data data/synthetic --init out/sft --out out/cft                  # CPU: 1000 steps of 5
    python cft.py --data data/synthetic-qwen3 --init out/sft-qwen --out out/cft-qwen \\
        --device cuda --batch-size 16 --lr 1e-5 --steps 3000                          # one GPU, a hub Qwen3
"""
import argparse
import math
import time

import torch
from tqdm import tqdm

import data
from harness import test_stage, validate
from model import diffusion_loss, init_mask_embedding, sample_noise
from plumbing import (HelpFormatter, Log, add_training_args, all_mean, batch_indices, check_positive, collate, ddp_setup,
                      is_main, load_checkpoint, lr_at, my_share, resume, save_checkpoint, save_progress, setup, sync_grads)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("--init", default="out/sft", help="the AR re-ranker checkpoint to convert")
    ap.add_argument("--out", default="out/cft", help="checkpoint folder to write")
    ap.add_argument("--block", type=int, default=32, help="block size B (the paper: 32)")  # [diffusion]
    ap.add_argument("--t-min", type=float, default=0.02,  # [diffusion] assumption: t ~ U(0.02, 0.98)
                    help="lowest noise level of a block")
    ap.add_argument("--t-max", type=float, default=0.98, help="highest noise level of a block")  # [diffusion]
    ap.add_argument("--inv-t", action="store_true",  # [diffusion] assumption: off, as Fast-dLLM v2
                    help="weight each target by 1/t (MDLM's ELBO weight)")
    ap.add_argument("--no-complementary", action="store_true",  # [diffusion] assumption: complementary masks on
                    help="do not also train each response with the inverted mask")
    # assumption: 1000 steps of 5 (0.76 epochs of the paper-sized task's 6,548 traces; the paper trains 3): a CPU budget
    add_training_args(ap, steps=1000, batch_size=5, lr=7e-4, warmup=50, eval_every=500)
    args = ap.parse_args(argv)
    check_positive(ap, args, "block", "batch_size", "eval_every")
    if not 0 < args.t_min <= args.t_max <= 1:
        ap.error(f"need 0 < --t-min <= --t-max <= 1, got {args.t_min}, {args.t_max}")
    return args


def convert(init, attn, dtype, data_dir=None):  # [diffusion]
    """The AR checkpoint as a block-diffusion model: the same weights, the mask token's row initialised."""
    model, tok, parent = load_checkpoint(init, attn, dtype, diffusion=False, data=data_dir)
    init_mask_embedding(model, tok.mask_token_id, len(tok))
    return model, tok, parent


def main(argv=None):
    args = parse_args(argv)
    rank, world = ddp_setup(args)
    if world > 1 and args.inv_t:  # the shared noise below is passed as fixed masks, which carry no noise levels
        raise SystemExit("error: --inv-t is not supported under torchrun")
    out = setup(args)
    train, valid, test, sid = data.load_splits(args.data, args.val_n, args.test_n)
    model, tok, parent = convert(args.init, args.attn, args.dtype, args.data)
    model.to(args.device)
    max_new = args.block * math.ceil(parent["max_new"] / args.block)  # [diffusion] whole blocks
    stage = {"stage": "naive" if args.steps == 0 else "cft", "parent": str(args.init), "block_size": args.block,
             "mask_token_id": tok.mask_token_id, "data": str(args.data), "max_new": max_new, "args": vars(args)}
    print(f"CFT: {args.steps} steps of {args.batch_size * world} = {args.steps * args.batch_size * world / len(train):.2f} epochs of "
          f"{len(train)} traces, block {args.block}, " + ("one noisy copy" if args.no_complementary else
                                                          "two noisy copies (complementary masks)") + " per row")

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.98))
    start, elapsed = (0, 0.0) if args.fresh else resume(out, model, opt)
    log, t0, losses = Log(out, start) if is_main() else None, time.time() - elapsed, []
    if start == 0 and args.steps > 0 and is_main():  # the curve starts at the naive conversion
        print("validating the naive conversion ...")
        log(step=0, minutes=0.0, **validate(model, tok, valid, sid, "diffusion", args.block, max_new, args.eval_batch)[0])
    bar = tqdm(range(start, args.steps), initial=start, total=args.steps, desc="cft", dynamic_ncols=True, disable=not is_main())
    for step in bar:
        model.train()
        whole = [train[i] for i in batch_indices(step, len(train), args.batch_size * world, args.seed)]
        batch = collate(my_share(whole))  # each rank its slice of the global batch
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        noise = torch.Generator().manual_seed(args.seed * 100003 + step)  # resumable: the noise depends on the step
        masked = None  # every rank draws the global batch's noise and keeps its rows: the targets of one process
        if world > 1:
            masked = sample_noise([len(ex["response_ids"]) for ex in whole], args.block, (args.t_min, args.t_max), noise)[0]
            masked = my_share(masked)
        loss, _ = diffusion_loss(model, batch, args.block, tok.mask_token_id, args.lambda_r, args.lambda_o,  # [diffusion]
                                 (args.t_min, args.t_max), args.inv_t, not args.no_complementary,
                                 masked=masked, pad_id=tok.pad_token_id, generator=noise)
        loss.backward()
        sync_grads(model)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(all_mean([loss.item()])[0])
        bar.set_postfix(loss=f"{losses[-1]:.3f}", lr=f"{opt.param_groups[0]['lr']:.1e}")
        if not is_main():  # validation and saving are rank 0's
            continue
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            val, _ = validate(model, tok, valid, sid, "diffusion", args.block, max_new, args.eval_batch)
            rec = log(step=step + 1, minutes=(time.time() - t0) / 60, loss=sum(losses) / len(losses), **val)
            losses = []
            tqdm.write(f"step {rec['step']:5d} | {rec['minutes']:5.1f} min | loss {rec['loss']:.4f} | tau=1.0 valid "
                       f"{val['val_valid_rate']:.3f} R@1 {val['val_recall1']:.3f} | tau=0.9 valid "
                       f"{val['val_valid_rate_0.9']:.3f} R@1 {val['val_recall1_0.9']:.3f} "
                       f"tok/fwd {val['val_tokens_per_forward_0.9']:.2f}")
            save_progress(out, model, tok, stage, opt, step + 1, time.time() - t0)
        elif (step + 1) % 50 == 0:  # validation is sparse (it decodes): stay resumable in between
            save_progress(out, model, tok, stage, opt, step + 1, time.time() - t0)

    if not is_main():  # rank 0 saves and tests alone
        return None
    save_checkpoint(out, model, tok, {**stage, "step": args.steps})
    print(f"CFT took {(time.time() - t0) / 60:.1f} min; testing ...")
    return test_stage(out, model.eval(), tok, test, sid, "diffusion", args.block, max_new, args.eval_batch, args.tau_n,
                      taus=args.taus, train_minutes=(time.time() - t0) / 60)


if __name__ == "__main__":
    main()
