"""
The re-ranking task: catalogue -> semantic ids -> retriever -> examples with teacher traces.

Every stage of Diffusion-GR2 trains and tests on what this script writes. The pipeline:

1. A catalogue (catalogue.py): Amazon Beauty 2014 5-core or any category in one JSONL layout, or the
   built-in synthetic world, written in that layout and read back (one code path for both).
2. Semantic ids (SIDs, catalogue.py): 4 tokens per item, levels a-c by residual k-means (RQ-KMeans) over
   a TF-IDF + SVD embedding of title and categories, level d numbering the items that still collide.
3. Chronological leave-one-out: last item = test target, second-to-last = validation target, every
   earlier position = a training example. A co-occurrence retriever (catalogue.py) fitted on training
   positions only ranks the catalogue; its top-K (in retriever order; K = 10 as in the paper, or `--candidates`)
   is the candidate list, and only examples whose target is in it are kept. A training example is scored with
   its own user's pairs removed, so train and test candidate lists look alike (no leakage, no shift).
4. A rule-based trace teacher (teacher.py; the paper used an LLM + rejection sampling) scores every candidate
   from evidence it states, fitted on training examples only, and keeps a trace only when its ranking puts
   the target first (stats.json: `teacher_kept_rate`; the teacher's own ranking of the test split is
   `teacher`, beside the retriever's `floor`). On a real catalogue each candidate's prompt line also states
   the item-level purchase count the teacher weighs (`| next2`, `--prompt-evidence`), so the trace can be read
   from the prompt instead of memorised item by item.
5. A tokenizer (a word-level one built here for the tiny model, or a Qwen3 one with the SID tokens and
   the mask token added), the tokenized splits as a `datasets.DatasetDict`, and stats.json.

    python data.py                                                # synthetic -> data/synthetic
    python data.py --raw ../shared/data/amazon-beauty             # a real catalogue -> data/beauty
    python data.py --tokenizer ../shared/data/qwen3-tokenizer --out data/synthetic-qwen3
    python data.py --candidates 5 --history 3 --max-eval 300 --out data/workshop   # run.sh's workshop task
"""
import argparse
import json
import math
import os
import re
import shutil
import sys
from collections import Counter
from pathlib import Path

import numpy as np

import eval as metrics
from catalogue import (CoocRetriever, DataError, catalogue_name, load_catalogue, make_synthetic, read_jsonl_layout,
                       semantic_ids, write_jsonl_layout)
from teacher import EVIDENCE, brand_of, evidence, fit_teacher, leaf_of, next_counts, rank_by, routine_ranks, teacher_trace

MASK_TOKEN = "<|mask|>"  # [diffusion] the token a block-diffusion model denoises
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<unk>", MASK_TOKEN]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Defaults of the built-in synthetic task (sized for fast learning on a CPU) and of any real catalogue.
SOURCE_DEFAULTS = {"synthetic": dict(codebook=256, history=5, title_words=3, max_eval=500,
                                     evidence="last,brand,cat,follow,words,pos", prompt_evidence=""),
                   "real": dict(codebook=256, history=6, title_words=5, max_eval=0,
                                evidence="last,brand,cat,follow,next,words,pos", prompt_evidence="next")}
# assumption: the synthetic world's routines are category-level by construction (catalogue.make_synthetic), so there
# item-level counts add nothing to `follow` (README, assumptions) and its teacher leaves `next` out; a real catalogue's
# teacher weighs it all, and its prompt states `next` (the assumption in build())


# ----------------------------------------------------------------------------- 1-3. catalogue, semantic ids, retriever: catalogue.py
# ----------------------------------------------------------------------------- 4. trace teacher: teacher.py
# ----------------------------------------------------------------------------- 5. prompts and tokenizer
def item_line(item, sid, title_words, shown=""):
    return f"{sid} {' '.join(item['title'].split()[:title_words])} | {leaf_of(item)}" + (f" | {shown}" if shown else "")


def prompt_text(items, sid, history, cands, title_words, shown=None):
    """shown: per candidate, the evidence its line also states (--prompt-evidence), such as "next2"."""
    return layout_prompt([item_line(items[h], sid[h], title_words) for h in history],
                         [item_line(items[c], sid[c], title_words, s) for c, s in zip(cands, shown or [""] * len(cands))])


def layout_prompt(history_lines, candidate_lines):
    """The prompt: the history's item lines, then the candidates' numbered c1, c2, ..."""
    hist = " ;\n".join(history_lines)
    cand = " ;\n".join(f"c{p + 1} {line}" for p, line in enumerate(candidate_lines))
    return f"history :\n{hist}\ncandidates :\n{cand}\nrank the candidates ."


def prompt_lines(prompt):
    """The inverse of layout_prompt: (history lines, candidate lines without their numbers)."""
    head, tail = prompt.split("\ncandidates :\n")
    hist = head.removeprefix("history :\n")
    cands = tail.removesuffix("\nrank the candidates .").split(" ;\n")
    return hist.split(" ;\n") if hist else [], [re.sub(r"^c\d+ ", "", line) for line in cands]


def build_word_tokenizer(texts, sid_tokens, max_vocab=16000):
    """A word-level tokenizer (lower-cased) over `texts`, with SID and special tokens as single tokens.

    Ids: the special tokens first, then the SID tokens, then words by frequency (ties alphabetical).
    """
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    split = pre_tokenizers.Whitespace()
    specials = SPECIALS + sid_tokens
    pattern = re.compile("|".join(re.escape(t) for t in specials))
    counts = Counter(w for text in texts for piece in pattern.split(text.lower()) for w, _ in split.pre_tokenize_str(piece))
    words_ = sorted((w for w in counts if w not in specials), key=lambda w: (-counts[w], w))
    vocab = {t: i for i, t in enumerate(specials + words_[:max_vocab - len(specials)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = split
    tok.add_special_tokens(specials)  # already in the vocab: this only stops them being split
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<|endoftext|>",
                                   eos_token="<|im_end|>", mask_token=MASK_TOKEN)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def load_hub_tokenizer(name, sid_tokens):
    """A Qwen3 tokenizer (hub id or folder) with the mask token and the SID tokens added."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(name)
    tok.add_special_tokens({"mask_token": MASK_TOKEN})  # [diffusion] id 151669 on Qwen3: a spare row
    tok.add_tokens(sid_tokens)
    return tok


def tokenize(tok, prompt, reasoning, answer):
    """prompt ids (chat template), response ids (reasoning + answer + eos) and the reasoning length."""
    p = tok(tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False),
            add_special_tokens=False).input_ids
    r = tok(reasoning, add_special_tokens=False).input_ids
    a = tok(answer, add_special_tokens=False).input_ids + [tok.eos_token_id]
    return p, r + a, len(r)


# ----------------------------------------------------------------------------- 6. build everything
def build(args, log=print):
    name = "synthetic" if not args.raw else catalogue_name(args.raw)
    d = SOURCE_DEFAULTS["synthetic" if not args.raw else "real"]
    codebook, history_cap, words_shown = (args.codebook or d["codebook"], args.history or d["history"],
                                          args.title_words or d["title_words"])
    pieces = (args.evidence or d["evidence"]).split(",")
    in_prompt = d["prompt_evidence"] if args.prompt_evidence is None else args.prompt_evidence
    shown_pieces = [p for p in in_prompt.split(",") if p]
    if not args.raw:
        raw_items, raw_users = make_synthetic(args.seed, args.users)
        raw_dir = Path(args.tmp) / "raw"
        write_jsonl_layout(raw_items, raw_users, raw_dir, "synthetic")
        raw_items, raw_users = read_jsonl_layout(raw_dir)  # one code path for both sources
    else:
        raw_dir = args.raw
        raw_items, raw_users = load_catalogue(raw_dir)
    index = {it["item"]: i for i, it in enumerate(raw_items)}
    items = raw_items
    seqs = [[index[a] for a in u] for u in raw_users]
    short = [i for i, s in enumerate(seqs) if len(s) < 3]
    if short:
        raise DataError(f"{raw_dir}: user #{short[0] + 1} has {len(seqs[short[0]])} items: leave-one-out needs at least 3")
    log(f"catalogue {name}: {len(seqs)} users, {len(items)} items, {sum(map(len, seqs))} interactions")

    codes = semantic_ids(items, codebook, args.seed)
    sid = [metrics.sid_str(*c) for c in codes]
    sid_unique = len(set(sid)) / len(sid)
    prefix_unique = len({tuple(c[:3]) for c in codes}) / len(codes)
    log(f"semantic ids: codebook {codebook}, unique first 3 levels {prefix_unique:.3f}, full {sid_unique:.3f}")

    train_seqs = [s[:-2] for s in seqs]  # only training positions feed the retriever and the teacher
    retriever = CoocRetriever(len(items)).fit(train_seqs)
    routine, follows = routine_ranks(items, train_seqs), next_counts(train_seqs)
    splits = {"train": [(u, t) for u, s in enumerate(seqs) for t in range(1, len(s) - 2)],
              "valid": [(u, len(s) - 2) for u, s in enumerate(seqs)],
              "test": [(u, len(s) - 1) for u, s in enumerate(seqs)]}
    examples = {}  # split -> [(user, position, history shown, candidates)] whose target is a candidate
    for split, pairs in splits.items():
        hists = [seqs[u][:t] for u, t in pairs]
        own = [train_seqs[u] for u, _ in pairs] if split == "train" else None
        tops = retriever.top_k(hists, args.candidates, own, desc=f"retriever, {split}")
        if split == "test":
            ranks = [top.index(seqs[u][t]) + 1 if seqs[u][t] in top else 0 for (u, t), top in zip(pairs, tops)]
            recall10 = float(np.mean([r > 0 for r in ranks]))
            ndcg10 = float(np.mean([1 / math.log2(r + 1) if r else 0 for r in ranks]))
        examples[split] = [(u, t, hist[-history_cap:], cands) for (u, t), hist, cands in zip(pairs, hists, tops)
                           if seqs[u][t] in cands]
    log(f"teacher: fitting its evidence weights on {len(examples['train'])} training examples")
    train_evidence = [evidence(items, h, c, routine, follows, train_seqs[u]) for u, _, h, c in examples["train"]]
    weights = fit_teacher(train_evidence, [c.index(seqs[u][t]) for u, t, _, c in examples["train"]], pieces)
    log("teacher weights (fitted on training examples): " + json.dumps(weights))

    data, stats_examples, all_examples, kept = {}, {}, {}, 0
    for split, exs in examples.items():
        rows = []
        for k, (u, t, hist, cands) in enumerate(exs):
            target = seqs[u][t]
            reasoning, answer = "", ""
            shown = None
            if shown_pieces:  # assumption: on a real catalogue the prompt hands the re-ranker the item-level purchase
                # counts its teacher weighs (`next`), as an upstream system hands features to a re-ranker; the paper's
                # LLM teacher reasons from product knowledge, which a tiny model cannot memorise item by item
                ev = train_evidence[k] if split == "train" else evidence(items, hist, cands, routine, follows)
                shown = [" ".join(f"{p}{e[list(EVIDENCE).index(p)]}" for p in shown_pieces) for e in ev]
            if split == "train":
                trace = teacher_trace(items, sid, hist, cands, target, routine, weights, train_evidence[k])
                if trace is None:
                    continue
                kept += 1
                reasoning, answer = trace
            rows.append({"id": f"{split}-u{u}-t{t}", "user": u, "history": hist, "candidates": cands,
                         "target": target, "prompt": prompt_text(items, sid, hist, cands, words_shown, shown),
                         "reasoning": reasoning, "answer": answer})
        all_examples[split] = len(rows)
        max_eval = d["max_eval"] if args.max_eval is None else args.max_eval
        if split != "train" and max_eval and len(rows) > max_eval:  # a fixed, seeded subset keeps evaluation quick
            rows = [rows[i] for i in sorted(np.random.default_rng(args.seed).choice(len(rows), max_eval, replace=False))]
        data[split] = rows
        stats_examples[split] = len(rows)
        log(f"{split}: {len(splits[split])} positions -> {all_examples[split]} re-rank examples" +
            (f", a seeded subset of {len(rows)} kept" if len(rows) < all_examples[split] else ""))
    log(f"retriever on the full test split: Recall@10 {recall10:.4f}  NDCG@10 {ndcg10:.4f}")

    sid_tokens = [f"<{lv}_{j}>" for lv, n in zip("abcd", codes.max(0) + 1) for j in range(n)]
    if args.tokenizer == "word":
        # the vocabulary comes from training text and item metadata only: nothing of valid/test moves an id
        corpus = [r["prompt"] + " " + r["reasoning"] + " " + r["answer"] for r in data["train"]]
        corpus += [item_line(it, "", words_shown) for it in items]
        tok = build_word_tokenizer(corpus + ["user assistant system"], sid_tokens)
    else:
        tok = load_hub_tokenizer(args.tokenizer, sid_tokens)
    for rows in data.values():
        for r in rows:
            r["prompt_ids"], r["response_ids"], r["n_reasoning"] = tokenize(tok, r["prompt"], r["reasoning"], r["answer"])
            if not r["reasoning"]:
                r["response_ids"], r["n_reasoning"] = [], 0

    test, train = data["test"], data["train"]
    floor = metrics.summarize(metrics.floor_rows(test))
    teacher = [metrics.rank_metrics([ex["candidates"][p] for p in rank_by(
        evidence(items, ex["history"], ex["candidates"], routine, follows), weights)[0]], ex["target"]) for ex in test]
    stats = {"source": name, "users": len(seqs), "items": len(items), "interactions": sum(map(len, seqs)),
             "sid_unique_rate": sid_unique, "sid_prefix_unique_rate": prefix_unique, "codebook": codebook,
             "retriever_recall@10": recall10, "retriever_ndcg@10": ndcg10, "examples": stats_examples,
             "examples_before_cap": all_examples,
             "teacher_kept_rate": kept / max(len(examples["train"]), 1),
             "floor": {k: floor[k] for k in metrics.METRIC_KEYS},
             "teacher": {k: float(np.mean([r[k] for r in teacher])) for k in metrics.METRIC_KEYS},
             "teacher_weights": weights, "prompt_evidence": shown_pieces,
             "tokens": {"prompt_mean": float(np.mean([len(r["prompt_ids"]) for r in train])),
                        "reasoning_mean": float(np.mean([r["n_reasoning"] for r in train])),
                        "answer_mean": float(np.mean([len(r["response_ids"]) - r["n_reasoning"] for r in train]))},
             "vocab_size": len(tok), "tokenizer": args.tokenizer, "seed": args.seed}
    return data, items, sid, codes, tok, stats


def save(out, data, items, sid, codes, tok, stats, tmp):
    from datasets import Dataset, DatasetDict
    Path(tmp).mkdir(parents=True, exist_ok=True)  # here, not before build: bad input leaves no folder behind
    DatasetDict({k: Dataset.from_list(v) for k, v in data.items()}).save_to_disk(str(Path(tmp) / "dataset"))
    tok.save_pretrained(str(Path(tmp) / "tokenizer"))
    with open(Path(tmp) / "items.jsonl", "w") as f:
        for i, (it, s, c) in enumerate(zip(items, sid, codes)):
            f.write(json.dumps({"index": i, "item": it["item"], "title": it["title"], "leaf": leaf_of(it),
                                "brand": brand_of(it), "sid": s, "codes": c.tolist()}) + "\n")
    with open(Path(tmp) / "stats.json", "w") as f:
        json.dump(stats, f, indent=2)
    # A folder cannot be renamed onto a full one, so the old one moves aside first: `out` is never half
    # written, and a crash between the two renames leaves the old data in .NAME.old beside it.
    old = Path(out).parent / f".{Path(out).name}.old"
    shutil.rmtree(old, ignore_errors=True)
    if Path(out).exists():
        os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


# ----------------------------------------------------------------------------- readers for the stages
def load_split(data_dir, split, n=0):
    """The first n (0 = all) examples of one split as a list of dicts, and the SID string of every item."""
    from datasets import load_from_disk
    path = Path(data_dir)
    if not (path / "dataset").exists():
        raise DataError(f"{path}: no dataset here (run `python data.py --out {path}` first)")
    sid = [json.loads(line)["sid"] for line in open(path / "items.jsonl")]
    ds = load_from_disk(str(path / "dataset"))[split]
    return list(ds.select(range(min(n, len(ds)))) if n else ds), sid


def load_splits(data_dir, val_n=0, test_n=0):
    """What every stage reads: train, the first val_n valid and test_n test examples (0 = all), and the SIDs."""
    train, sid = load_split(data_dir, "train")
    return train, load_split(data_dir, "valid", val_n)[0], load_split(data_dir, "test", test_n)[0], sid


def max_new_tokens(train, block=32):
    """Decoding budget: 1.25x the longest training response, in whole blocks."""
    longest = max(len(ex["response_ids"]) for ex in train)
    return block * math.ceil(1.25 * longest / block)


def main(argv=None):
    from plumbing import HelpFormatter  # the shared --help layout; imported here because only the command line needs it
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    ap.add_argument("--raw", help="a real catalogue's folder (JSONL layout, or McAuley's 2014 .json.gz files); "
                    "without it, the built-in synthetic one")
    ap.add_argument("--out", help="output directory (default data/<catalogue name>: data/synthetic, data/beauty, ...)")
    ap.add_argument("--tokenizer", default="word", help="'word' builds a small word-level tokenizer; or a Qwen3 hub id / folder")
    ap.add_argument("--seed", type=int, default=0, help="seed for the synthetic world, k-means and the teacher")
    ap.add_argument("--users", type=int, default=8000, help="synthetic only: number of users")
    ap.add_argument("--candidates", type=int, default=10, help="candidates per list: the retriever's top K (the paper: 10)")
    ap.add_argument("--codebook", type=int, default=0, help="codes per SID level (0 = 256, TIGER's size)")
    ap.add_argument("--history", type=int, default=0, help="history items shown in the prompt (0 = default: 5 synthetic, 6 real)")
    ap.add_argument("--max-eval", type=int, default=None, help="cap on valid/test examples, a seeded subset (default: 500 synthetic, all real)")
    ap.add_argument("--title-words", type=int, default=0, help="words of each title shown (0 = default: 3 synthetic, 5 real)")
    ap.add_argument("--evidence", help="the pieces of evidence the teacher weighs, comma-separated, from "
                    f"{','.join(EVIDENCE)} (default: all but 'next' synthetic, all real)")
    ap.add_argument("--prompt-evidence", help="pieces of the teacher's evidence each candidate's prompt line also "
                    "states, as 'next2' (default: none synthetic, 'next' real; '' for none)")
    args = ap.parse_args(argv)
    for flag, value in (("--evidence", args.evidence), ("--prompt-evidence", args.prompt_evidence)):
        unknown = [k for k in (value or "").split(",") if k and k not in EVIDENCE]
        if unknown:
            ap.error(f"{flag}: no piece {unknown[0]!r} (the pieces: {','.join(EVIDENCE)})")
    if not 2 <= args.candidates <= EVIDENCE["pos"]:  # the teacher's `pos` evidence has one weight per position
        ap.error(f"--candidates must be from 2 to {EVIDENCE['pos']}, got {args.candidates}")
    try:
        out = Path(args.out or f"data/{catalogue_name(args.raw) if args.raw else 'synthetic'}")
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    args.tmp = str(out.parent / f".{out.name}.tmp{os.getpid()}")
    print("config:", json.dumps({k: v for k, v in vars(args).items() if k != "tmp"}))
    try:
        built = build(args)
        save(out, *built, tmp=args.tmp)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        shutil.rmtree(args.tmp, ignore_errors=True)
    print(json.dumps(built[-1], indent=2))
    print(f"wrote {out}/ (dataset, tokenizer, items.jsonl, stats.json)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
