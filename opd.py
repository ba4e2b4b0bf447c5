"""
Stage 2: on-policy distillation (OPD) from the AR teacher closes the distributional gap.

CFT trained on the teacher's fixed traces (off-policy). Here the CFT student decodes its *own*
trajectories with the real block-diffusion decoder (G' per prompt, the rule it is tested with), and
the frozen AR re-ranker of sft.py says, at every generated position, what it would have predicted there
(METHOD.md section 6):

    L_OPD = mean_trajectories  mean_{i <= end}  KL( p_teacher(. | prompt, y_<i)  ||  p_student(. | canvas_i) )

The teacher needs one causal forward over prompt + completion (no gradient, once per trajectory).
canvas_i is the state token i was committed from, rebuilt from the decoder's step map by
decode.replay_chunks -- the same function rl.py uses. Token shift lines the two up position for
position: both logits for token i sit at position i-1. Both distributions leave out the mask token
(the student never emits it) and are compared in float32.

Latency OPD (beyond the paper; the README measures it beside the paper's): the student rolls out at a low
tau, and the teacher is a block-diffusion checkpoint -- the student's own starting point -- reading each
token with every earlier token of its block clean and the rest masked, the context of slow decoding. The
fast decoder is taught to write what the slow one would have.

    python opd.py --data data/synthetic --init out/cft --teacher out/sft --out out/opd      # CPU: 16 steps
    python opd.py --data data/workshop --init out/cft --teacher out/cft --tau 0.4 --out out/opd-latency
    python opd.py --data data/synthetic-qwen3 --init out/cft-qwen --teacher out/sft-qwen --out out/opd-qwen \\
        --device cuda --prompts-per-step 32 --rows 16 --lr 1e-6 --steps 200               # one GPU
"""
import argparse
import time

import torch
from tqdm import tqdm

import data
import eval as metrics
from decode import diffusion_generate, replay_chunks
from harness import test_stage, validate
from model import ar_logits, token_kl
from plumbing import (HelpFormatter, Log, add_training_args, all_mean, all_sum, batch_indices, check_positive, ddp_setup,
                      is_main, load_checkpoint, lr_at, my_share, read_jsonl, resume, save_checkpoint, save_progress, setup,
                      sync_grads)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("--init", default="out/cft", help="the CFT student checkpoint")
    ap.add_argument("--teacher", default="out/sft",
                    help="the frozen teacher: the AR re-ranker (the paper's), or a block-diffusion checkpoint such as "
                         "--init itself with a low --tau (latency OPD, beyond the paper)")
    ap.add_argument("--out", default="out/opd", help="checkpoint folder to write")
    ap.add_argument("--group", type=int, default=4, help="G': trajectories the student decodes per prompt (the paper: 4)")
    ap.add_argument("--prompts-per-step", type=int, default=4,  # assumption: 4 (the paper: 128), sized for a CPU
                    help="training prompts per step")
    ap.add_argument("--tau", type=float, default=0.9,  # [diffusion] assumption: 0.9, the paper's first speed setting
                    help="commit threshold of the student's rollouts")
    ap.add_argument("--temperature", type=float, default=1.0,  # assumption: 1.0, sampling from the student as it is
                    help="sampling temperature of the rollouts")
    ap.add_argument("--clean-prefix", action="store_true",  # [diffusion] assumption: off, the replayed canvas
                    help="score each token with everything before it clean and the rest of its block masked")
    ap.add_argument("--rows", type=int, default=64, help="replayed canvases per backward pass (memory, not maths)")
    ap.add_argument("--kl-n", type=int, default=100,
                    help="test examples for the KL to the teacher before and after OPD (each decodes them once more)")
    # assumption: lr 1e-4 with warm-up and cosine for 16 steps of 4 prompts on the tiny model (the paper: 1e-6
    # constant for ~1.5k steps of 128 prompts at 8B scale; pass --lr 1e-6 for a hub Qwen3)
    add_training_args(ap, steps=16, lr=1e-4, warmup=2, eval_every=8, token_weights=False)
    args = ap.parse_args(argv)
    check_positive(ap, args, "group", "prompts_per_step", "rows", "eval_every", "kl_n")
    return args


def clean_prefix(steps, block):  # [diffusion]
    """A step map under which replay gives each token its clean prefix: every earlier token of its block clean,
    the rest masked (what a left-to-right, one-token-per-forward decode of the same tokens would have seen)."""
    return [[r % block if s >= 0 else -1 for r, s in enumerate(st)] for st in steps]


def teacher_logits(teacher, teacher_block, prompts, roll, mask_id, pad_id, max_rows=64):
    """The teacher's logits (N, V) for every kept token and {(trajectory, position): row of them}.

    An AR teacher (teacher_block None, the paper's) reads the completion causally, one forward per trajectory.
    A block-diffusion teacher (latency OPD, beyond the paper: the diffusion model itself, decoded slowly)
    reads each token from its clean prefix, the best-informed context it has."""
    keep = [len(t) for t in roll.tokens]
    if teacher_block is None:
        order = [(i, r) for i, k in enumerate(keep) for r in range(k)]
        return ar_logits(teacher, prompts, roll.tokens, pad_id), {key: n for n, key in enumerate(order)}
    parts = list(replay_chunks(teacher, prompts, roll.canvas, clean_prefix(roll.steps, teacher_block), teacher_block,  # [diffusion]
                               mask_id, keep, pad_id, max_rows))
    order = [key for _, o in parts for key in o]
    return torch.cat([logits for logits, _ in parts]), {key: n for n, key in enumerate(order)}


def opd_losses(student, teacher, prompts, roll, block, mask_id, pad_id, clean=False, max_rows=64, teacher_block=None):
    """The loss in parts, one per chunk of replayed canvases: each token's KL divided by its trajectory's
    length. The parts sum to the sum over trajectories of the mean KL per generated token (divide by
    the number of trajectories); a caller that trains backwards each part as it comes (memory)."""
    keep = [len(t) for t in roll.tokens]
    with torch.no_grad():  # the teacher's full next-token distributions, once per trajectory
        logits_t, row_of = teacher_logits(teacher, teacher_block, prompts, roll, mask_id, pad_id, max_rows)
    steps = clean_prefix(roll.steps, block) if clean else roll.steps  # [diffusion] --clean-prefix
    for logits, order in replay_chunks(student, prompts, roll.canvas, steps, block, mask_id, keep, pad_id, max_rows):
        kl = token_kl(logits_t[[row_of[key] for key in order]], logits, mask_id)
        length = torch.tensor([keep[i] for i, _ in order], device=kl.device, dtype=kl.dtype)
        yield (kl / length).sum()


@torch.no_grad()
def test_kl(student, teacher, tok, examples, block, max_new, batch=16, teacher_block=None):
    """Mean KL(teacher || student) along the student's own greedy tau = 1.0 trajectories."""
    total = 0.0
    for s in tqdm(range(0, len(examples), batch), desc="test KL", leave=False):
        prompts = [ex["prompt_ids"] for ex in examples[s:s + batch]]
        roll = diffusion_generate(student, prompts, block, 1.0, max_new, tok.mask_token_id, tok.eos_token_id, tok.pad_token_id)
        total += sum(opd_losses(student, teacher, prompts, roll, block, tok.mask_token_id, tok.pad_token_id,
                                teacher_block=teacher_block)).item()
    return total / max(len(examples), 1)


def main(argv=None):
    args = parse_args(argv)
    rank, world = ddp_setup(args)
    out = setup(args)
    train, valid, test, sid = data.load_splits(args.data, args.val_n, args.test_n)
    # both read the data's tokenizer, so they share one vocabulary: the KL compares distributions token by token
    student, tok, parent = load_checkpoint(args.init, args.attn, args.dtype, diffusion=True, data=args.data)
    teacher, _, t_stage = load_checkpoint(args.teacher, args.attn, args.dtype, data=args.data)
    teacher_block = t_stage["block_size"]  # [diffusion] None: the paper's AR teacher; else latency OPD
    student.to(args.device), teacher.to(args.device).eval().requires_grad_(False)
    block, max_new = parent["block_size"], parent["max_new"]
    stage = {"stage": "opd", "parent": str(args.init), "teacher": str(args.teacher), "block_size": block,
             "mask_token_id": tok.mask_token_id, "data": str(args.data), "max_new": max_new, "args": vars(args)}
    kl_examples = test[:args.kl_n]
    print(f"rollouts: G'={args.group} x {args.prompts_per_step} prompts, tau={args.tau}, temperature={args.temperature}")

    opt = torch.optim.AdamW(student.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.98))
    start, elapsed = (0, 0.0) if args.fresh else resume(out, student, opt)
    log, t0 = Log(out, start) if is_main() else None, time.time() - elapsed
    if start == 0 and is_main():  # the curve starts at the CFT student
        t_kl = time.time()
        kl_init = test_kl(student, teacher, tok, kl_examples, block, max_new, teacher_block=teacher_block)
        print(f"before OPD: test KL to the teacher {kl_init:.4f}")
        val, _ = validate(student, tok, valid, sid, "diffusion", block, max_new, args.eval_batch)
        log(step=0, minutes=0.0, kl_test=kl_init, **{**val, "val_seconds": time.time() - t_kl})
    bar = tqdm(range(start, args.steps), initial=start, total=args.steps, desc="opd", dynamic_ncols=True, disable=not is_main())
    for step in bar:
        examples = [train[i] for i in my_share(batch_indices(step, len(train), args.prompts_per_step, args.seed))
                    for _ in range(args.group)]  # each rank its share of the prompts (it must split evenly)
        prompts = [ex["prompt_ids"] for ex in examples]
        student.eval()  # [diffusion] the student's own trajectories, from the real decoder
        gen = torch.Generator(device=args.device).manual_seed((args.seed * 100003 + step) * world + rank)
        roll = diffusion_generate(student, prompts, block, args.tau, max_new, tok.mask_token_id, tok.eos_token_id,
                                  tok.pad_token_id, args.temperature, gen)
        student.train()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        kl_sum = 0.0
        for c in range(0, len(prompts), args.group):  # the teacher's distributions, one prompt's group at a time
            part = roll.select(range(c, c + args.group))
            for loss in opd_losses(student, teacher, prompts[c:c + args.group], part, block, tok.mask_token_id,
                                   tok.pad_token_id, args.clean_prefix, args.rows, teacher_block):
                (loss / len(prompts)).backward()  # gradient accumulation: one chunk of replayed canvases at a time
                kl_sum += loss.item() / len(prompts)
        sync_grads(student)
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        rows = metrics.score_responses([tok.decode(t) for t in roll.tokens], examples, sid)
        kl_sum, valid_rate = all_mean([kl_sum, metrics.summarize(rows)["valid_rate"]])  # ranks have equal shares
        n_tok, n_fwd = all_sum([sum(map(len, roll.tokens)), sum(roll.nfe)])
        rec = {"step": step + 1, "kl": kl_sum, "rollout_valid_rate": valid_rate, "rollout_tokens_per_forward": n_tok / n_fwd}
        bar.set_postfix(kl=f"{kl_sum:.4f}", valid=f"{rec['rollout_valid_rate']:.2f}",
                        tpf=f"{rec['rollout_tokens_per_forward']:.2f}")
        if not is_main():  # validation, saving and the log are rank 0's
            continue
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            val, _ = validate(student, tok, valid, sid, "diffusion", block, max_new, args.eval_batch)
            rec.update(minutes=(time.time() - t0) / 60, **val)
            tqdm.write(f"step {step + 1:4d} | {rec['minutes']:5.1f} min | rollout KL {kl_sum:.4f} | tau=1.0 valid "
                       f"{val['val_valid_rate']:.3f} R@1 {val['val_recall1']:.3f} | tau=0.9 valid "
                       f"{val['val_valid_rate_0.9']:.3f} R@1 {val['val_recall1_0.9']:.3f}")
            log(**rec)  # before the save: a resumed run keeps the log up to its checkpoint, this record included
            save_progress(out, student, tok, stage, opt, step + 1, time.time() - t0)
        else:
            log(**rec)

    if not is_main():  # rank 0 saves and tests alone
        return None
    save_checkpoint(out, student, tok, {**stage, "step": args.steps})
    train_minutes, test_since = (time.time() - t0) / 60, time.time()
    kl_init = read_jsonl(log.path)[0]["kl_test"]
    kl_final = test_kl(student.eval(), teacher, tok, kl_examples, block, max_new, teacher_block=teacher_block)
    print(f"OPD took {(time.time() - t0) / 60:.1f} min; test KL to the teacher {kl_init:.4f} -> {kl_final:.4f}; testing ...")
    return test_stage(out, student, tok, test, sid, "diffusion", block, max_new, args.eval_batch, args.tau_n,
                      extra={"kl_to_teacher": {"init": kl_init, "final": kl_final}}, taus=args.taus,
                      train_minutes=train_minutes, test_since=test_since)


if __name__ == "__main__":
    main()
