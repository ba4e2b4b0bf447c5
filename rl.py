"""
Stage 3: RL against the re-ranking reward -- trajectory-replay GRPO on the block-diffusion policy
(and, given an AR checkpoint, GR2's own RL stage for the AR re-ranker: its block-size-1 case).

For each training prompt the policy decodes G rollouts with the real block-diffusion decoder (the rule it
is tested with). Each gets GR2's reward (eval.rerank_reward): the target's rank promotion over the
retriever, (r_before - r_after) / N, plus 0.2 only if that is positive or the target stays first, and -1
for an invalid answer. Advantages are z-scores inside each prompt's group; a group whose rewards are all
equal teaches nothing and is dropped. The loss is PPO's clipped ratio with token-level normalisation and
no KL term (METHOD.md section 7):

    rho_i = exp(log pi(y_i | canvas_i) - log pi_old(y_i | canvas_i))
    L = - sum_{kept rollouts g, tokens i} min(rho_i A_g, clip(rho_i, 1 - eps, 1 + eps) A_g) / (number of tokens)

A diffusion policy has no left-to-right factorisation, so log pi(y_i) is read at the canvas token i was
committed from: the decoder's step map, replayed by decode.replay_chunks (the same function as OPD), with
the mask token left out of the distribution as it is when sampling. Watch the identity rate (answers that
copy the retriever order): the reward-hacking signal.

Given an AR checkpoint (sft.py's), the same loop is GR2's RL stage (METHOD.md section 2): with blocks of
one token the decoder is AR decoding and every token is committed at step 0 of its block, so the replayed
canvas holds exactly the tokens before it and log pi(y_i) is the AR model's causal log-probability (a test
checks it). The result stays an AR checkpoint: the AR row and OPD's teacher of `run.sh --full`. Of DAPO's
changes to GRPO (GR2 names DAPO) both policies get token-level normalisation, no KL term, and dropping
zero-variance groups (without DAPO's re-sampling to refill the batch); not its asymmetric clip-higher or its
overlong-response penalty (one symmetric eps; the decoding budget caps every response).

    python rl.py --data data/synthetic --init out/opd --out out/rl                 # CPU: 8 steps of 8 x 8 rollouts
    python rl.py --data data/synthetic --init out/sft --out out/ar-rl              # the AR re-ranker's RL (GR2)
    python rl.py --data data/synthetic-qwen3 --init out/opd-qwen --out out/rl-qwen \\
        --device cuda --rows 16 --lr 5e-7 --steps 100 --eval-every 25                # one GPU
"""
import argparse
import time

import torch
from tqdm import tqdm

import data
import eval as metrics
from decode import diffusion_generate, replay_chunks
from harness import test_stage, validate
from plumbing import (HelpFormatter, Log, add_training_args, all_mean, all_sum, batch_indices, check_positive, ddp_setup,
                      is_main, load_checkpoint, lr_at, my_share, resume, save_checkpoint, save_progress, setup, sync_grads)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("--init", default="out/opd",
                    help="the policy to start from: a block-diffusion checkpoint, or an AR one (GR2's RL stage)")
    ap.add_argument("--out", default="out/rl", help="checkpoint folder to write")
    ap.add_argument("--group", type=int, default=8, help="G: rollouts per prompt (the paper: 8)")
    ap.add_argument("--prompts-per-step", type=int, default=8,  # assumption: 8, sized for a CPU
                    help="prompts per step (G rollouts each)")
    ap.add_argument("--tau", type=float, default=0.9,  # [diffusion] assumption: 0.9, the paper's first speed setting
                    help="commit threshold of the rollouts (a block-diffusion policy; an AR one writes a token per step)")
    ap.add_argument("--temperature", type=float, default=1.0,  # assumption: 1.0, the paper does not say
                    help="sampling temperature of the rollouts")
    ap.add_argument("--clip", type=float, default=0.2, help="epsilon of the clipped ratio")
    ap.add_argument("--updates", type=int, default=1,  # assumption: 1 (on-policy; the ratio starts at exactly 1)
                    help="optimizer steps per batch of rollouts")
    ap.add_argument("--rows", type=int, default=64, help="replayed canvases per backward pass (memory, not maths)")
    # assumption: lr 5e-5 for 8 steps on the tiny model (the paper: 5e-7 for 600 steps at 8B scale; pass --lr 5e-7
    # for a hub Qwen3)
    add_training_args(ap, steps=8, lr=5e-5, warmup=1, eval_every=4, token_weights=False)
    args = ap.parse_args(argv)
    check_positive(ap, args, "prompts_per_step", "updates", "rows", "eval_every")
    if args.group < 2:  # one rollout has no group to be compared with
        ap.error(f"--group must be at least 2, got {args.group}")
    return args


def rollout_logprobs(model, prompts, roll, block, mask_id, pad_id, temperature, max_rows=64):
    """Yield (log pi(y_i) of kept tokens, their rollout index) in parts: every kept token (up to and including
    the end token) exactly once, read at its replayed canvas. A caller that trains backwards each part as it comes."""
    keep = [len(t) for t in roll.tokens]
    for logits, order in replay_chunks(model, prompts, roll.canvas, roll.steps, block, mask_id, keep, pad_id, max_rows):
        logp = torch.log_softmax(logits / max(temperature, 1e-6), -1)  # the distribution the rollout sampled from
        chosen = torch.tensor([roll.tokens[i][r] for i, r in order], device=logp.device)
        yield logp.gather(1, chosen[:, None])[:, 0], torch.tensor([i for i, _ in order])


def group_advantages(rewards, group):
    """z-scored rewards inside each group of G; groups with zero variance get None (dropped)."""
    r = torch.tensor(rewards, dtype=torch.float).view(-1, group)
    std = r.std(1, keepdim=True)
    adv = (r - r.mean(1, keepdim=True)) / std.clamp_min(1e-6)
    keep = (std > 1e-6).expand_as(r)
    return [a.item() if k else None for a, k in zip(adv.flatten(), keep.flatten())]


def clipped_loss(logp, logp_old, adv, eps):
    """Token-level PPO clip; returns (summed loss, number of clipped tokens)."""
    ratio = torch.exp(logp - logp_old)
    loss = -torch.minimum(ratio * adv, ratio.clamp(1 - eps, 1 + eps) * adv)
    return loss.sum(), ((ratio - 1).abs() > eps).sum().item()


def policy_update(model, opt, prompts, roll, adv, kept, block, tok, args):
    """`args.updates` optimizer steps of the clipped loss over the kept rollouts; returns the clipped fraction.

    pi_old is the policy that made the rollouts: its log-probabilities are taken in the first pass, so with
    one update the ratio is exactly 1. Gradients accumulate over groups of rollouts (memory, not maths).
    Under torchrun each rank divides by the ranks' mean token count, and the ranks' gradients are averaged:
    together, the token-level mean over the whole batch."""
    n_tokens = all_mean([sum(len(roll.tokens[i]) for i in kept)])[0]
    chunks = [kept[c:c + args.group] for c in range(0, len(kept), args.group)]
    old, clipped = {}, 0
    for update in range(args.updates):
        for c, idx in enumerate(chunks):
            parts = rollout_logprobs(model, [prompts[i] for i in idx], roll.select(idx), block, tok.mask_token_id,
                                     tok.pad_token_id, args.temperature, args.rows)
            for k, (logp, owner) in enumerate(parts):
                if update == 0:
                    old[c, k] = logp.detach()
                a = torch.tensor([adv[idx[o]] for o in owner.tolist()], device=logp.device)
                loss, n_clip = clipped_loss(logp, old[c, k], a, args.clip)
                (loss / n_tokens).backward()  # token-level normalisation over the whole batch
                clipped += n_clip
        sync_grads(model)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return clipped / (n_tokens * args.updates)


def main(argv=None):
    args = parse_args(argv)
    rank, world = ddp_setup(args)
    out = setup(args)
    train, valid, test, sid = data.load_splits(args.data, args.val_n, args.test_n)
    model, tok, parent = load_checkpoint(args.init, args.attn, args.dtype, data=args.data)
    model.to(args.device)
    mode = "diffusion" if parent["block_size"] else "ar"
    block, max_new = parent["block_size"] or 1, parent["max_new"]  # an AR policy is the block-size-1 case
    stage = {"stage": "rl" if mode == "diffusion" else "ar-rl", "parent": str(args.init), "block_size": parent["block_size"],
             "mask_token_id": tok.mask_token_id, "data": str(args.data), "max_new": max_new, "args": vars(args)}
    print(f"{mode} policy, rollouts: G={args.group} x {args.prompts_per_step} prompts, "
          + (f"tau={args.tau}, " if mode == "diffusion" else "") + f"temperature={args.temperature}")

    def held_out():
        """Mean reward of greedy (tau = 1.0) answers on validation prompts, and the validation metrics."""
        val, texts = validate(model, tok, valid, sid, mode, block, max_new, args.eval_batch)
        rew = [metrics.rerank_reward(t, [sid[c] for c in ex["candidates"]], sid[ex["target"]]) for t, ex in zip(texts, valid)]
        return {"val_reward": sum(rew) / len(rew), **val}

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.98))
    start, elapsed = (0, 0.0) if args.fresh else resume(out, model, opt)
    log, t0 = Log(out, start) if is_main() else None, time.time() - elapsed
    if start == 0 and is_main():
        rec = log(step=0, minutes=0.0, **held_out())
        print(f"before RL: held-out reward {rec['val_reward']:.4f}, valid {rec['val_valid_rate']:.3f}, R@1 {rec['val_recall1']:.3f}")
    bar = tqdm(range(start, args.steps), initial=start, total=args.steps, desc="rl", dynamic_ncols=True, disable=not is_main())
    for step in bar:
        examples = [train[i] for i in my_share(batch_indices(step, len(train), args.prompts_per_step, args.seed))
                    for _ in range(args.group)]  # each rank its share of the prompts (it must split evenly)
        prompts = [ex["prompt_ids"] for ex in examples]
        model.eval()
        gen = torch.Generator(device=args.device).manual_seed((args.seed * 100003 + step) * world + rank)
        roll = diffusion_generate(model, prompts, block, args.tau, max_new, tok.mask_token_id, tok.eos_token_id,
                                  tok.pad_token_id, args.temperature, gen)  # B = 1: AR decoding
        texts = [tok.decode(t) for t in roll.tokens]
        rewards = [metrics.rerank_reward(t, [sid[c] for c in ex["candidates"]], sid[ex["target"]])
                   for t, ex in zip(texts, examples)]
        adv = group_advantages(rewards, args.group)
        kept = [i for i, a in enumerate(adv) if a is not None]
        rollout = metrics.summarize(metrics.score_responses(texts, examples, sid))
        reward, valid_rate, identity, n_kept = all_mean([sum(rewards) / len(rewards), rollout["valid_rate"],
                                                    rollout["identity_rate"], len(kept) / len(adv)])  # equal shares
        n_tok, n_fwd = all_sum([sum(map(len, roll.tokens)), sum(roll.nfe)])
        rec = {"step": step + 1, "reward": reward, "valid_rate": valid_rate,
               "identity_rate": identity,  # answers that copy the retriever order: reward hacking
               "dropped_groups": 1 - n_kept, "clip_frac": 0.0, "tokens_per_forward": n_tok / n_fwd}
        if n_kept > 0:  # every rank updates if any kept a group (one with none contributes zero gradients)
            model.train()
            for g in opt.param_groups:
                g["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
            rec["clip_frac"] = all_mean([policy_update(model, opt, prompts, roll, adv, kept, block, tok, args)])[0]
        bar.set_postfix(reward=f"{rec['reward']:.3f}", valid=f"{rec['valid_rate']:.2f}", ident=f"{rec['identity_rate']:.2f}")
        if not is_main():  # validation, saving and the log are rank 0's
            continue
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            rec.update(minutes=(time.time() - t0) / 60, **held_out())
            tqdm.write(f"step {step + 1:4d} | {rec['minutes']:5.1f} min | held-out reward {rec['val_reward']:.4f} | "
                       f"valid {rec['val_valid_rate']:.3f} R@1 {rec['val_recall1']:.3f} | identity {rec['identity_rate']:.2f}")
            log(**rec)  # before the save: a resumed run keeps the log up to its checkpoint, this record included
            save_progress(out, model, tok, stage, opt, step + 1, time.time() - t0)
        else:
            log(**rec)

    if not is_main():  # rank 0 saves and tests alone
        return None
    save_checkpoint(out, model, tok, {**stage, "step": args.steps})
    print(f"RL took {(time.time() - t0) / 60:.1f} min; testing ...")
    return test_stage(out, model.eval(), tok, test, sid, mode, block, max_new, args.eval_batch, args.tau_n,
                      taus=args.taus, train_minutes=(time.time() - t0) / 60)


if __name__ == "__main__":
    main()
