"""
How much sharing a row saves: noisy copies packed into one row [prompt | x_t | x_t' | x_0] (model.py)
against one row per copy, timed side by side on the same batch, forward and backward.

- CFT: one training step's loss on a batch of traces with complementary masks, packed (what
  cft.py runs) against the same two masks in rows of their own (two calls with complementary=False:
  the same tokens scored, the layout cft.py used before).
- OPD / RL: the replayed canvases of 16 rollouts (4 prompts x 4, at tau 0.9 and temperature 1, as
  opd.py's defaults), scored with decode.replay_chunks at pack = 1 (a row per canvas), 2, 3 and 4,
  and the decoding of those rollouts, which packing does not touch (the rest of an OPD step).

Every setting runs once per round, rounds alternate, and the median round is reported, so a machine
that slows down mid-run slows every setting alike.

    python docs/pack_bench.py --ckpt out/cft --data data/synthetic        # a block-diffusion checkpoint
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import data  # noqa: E402
from decode import generate, replay_chunks  # noqa: E402
from model import batch_indices, collate, diffusion_loss, load_checkpoint, pad_to_block, sample_noise  # noqa: E402


def timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", default="out/cft", help="a block-diffusion checkpoint (its weights only set the rollouts)")
    ap.add_argument("--data", default="data/synthetic", help="folder written by data.py")
    ap.add_argument("--batch-size", type=int, default=16, help="CFT traces per step (cft.py's default)")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds; the median is reported")
    ap.add_argument("--commit", default=None, help="the rollouts' commit rule (default: the checkpoint's)")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    train, _, _, _ = data.load_splits(args.data, 10, 10)
    model, tok, stage = load_checkpoint(args.ckpt)
    block, mask_id, eos_id, pad_id = stage["block_size"], tok.mask_token_id, tok.eos_token_id, tok.pad_token_id

    batch = collate([train[i] for i in batch_indices(0, len(train), args.batch_size, 0)])
    lengths = [len(pad_to_block(r, block, eos_id)) for r in batch["response_ids"]]
    masked, _, _ = sample_noise(lengths, block, (0.02, 0.98), generator=torch.Generator().manual_seed(0))
    real = torch.arange(masked.shape[1])[None] < torch.tensor(lengths)[:, None]
    loss = lambda m, complementary: diffusion_loss(model, batch, block, mask_id, eos_id, masked=m, pad_id=pad_id,
                                                    complementary=complementary)[0]
    cft = {"packed: one row, two noisy copies": lambda: loss(masked, True).backward(),
           "a row per copy": lambda: (loss(masked, False) + loss(~masked & real, False)).backward()}

    prompts = [ex["prompt_ids"] for ex in train[:4] for _ in range(4)]
    rollouts = lambda: generate(model, tok, prompts, "diffusion", block, 0.9, stage["max_new"], len(prompts),
                                temperature=1.0, generator=torch.Generator().manual_seed(0),
                                sub_block=stage.get("sub_block", 0), commit=args.commit or stage.get("commit", "any"))[0]
    roll = rollouts()
    keep = [len(t) for t in roll.tokens]
    canvases = sum(max(st) + 1 for st in roll.steps)

    def replay(pack):
        for logits, _ in replay_chunks(model, prompts, roll.canvas, roll.steps, block, mask_id, keep, pad_id, 64, pack):
            logits.logsumexp(-1).sum().backward()
    opd = {f"pack {p}": (lambda p=p: replay(p)) for p in (1, 2, 3, 4)}
    opd["the rollouts themselves (decoding)"] = rollouts  # what packing leaves alone: an OPD step is both

    model.train()
    times = {name: [] for name in [*cft, *opd]}
    for _ in range(args.rounds):
        for name, fn in [*cft.items(), *opd.items()]:
            times[name].append(timed(fn))
            model.zero_grad(set_to_none=True)
    med = {name: statistics.median(t) for name, t in times.items()}
    print(f"CFT step, batch {args.batch_size}, forward + backward (median of {args.rounds} rounds):")
    for name in cft:
        print(f"  {name:<36} {med[name]:6.2f} s  ({med['a row per copy'] / med[name]:.2f}x)")
    print(f"OPD replay of {len(prompts)} rollouts ({sum(keep)} tokens, {canvases} canvases), forward + backward:")
    decode = med["the rollouts themselves (decoding)"]
    for name in opd:
        ratio = f"  ({med['pack 1'] / med[name]:.2f}x)" if name.startswith("pack") else ""
        print(f"  {name:<36} {med[name]:6.2f} s{ratio}")
    print(f"OPD step (rollouts + replay), pack 2 against pack 1: {(decode + med['pack 1']) / (decode + med['pack 2']):.2f}x")
    return med


if __name__ == "__main__":
    main()
