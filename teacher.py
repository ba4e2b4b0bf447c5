"""
The trace teacher: the reasoning every re-ranker imitates, and the ranking it implies.

The paper used a larger LLM with rejection sampling; offline this teacher is a rule. For each candidate it
states evidence: what the prompt shows (the brand of the last purchase and of the history, categories bought
before, shared title words, retriever position) and what training purchases say (how often a category
follows the last one's and, on a real catalogue, how often the item itself was bought right after the last
one, the example's own user left out). It scores a candidate by adding one integer weight per piece of
evidence,

    score(c) = sum_k W_k[e_k(c)],   W fitted on training examples (a conditional logit, then rounded),

so it ranks better than the retriever wherever the evidence carries signal. The ranking follows from the
stated scores, so a reasoning error changes the answer; a trace is kept only when the ranking puts the
target first. A trace (data.py writes it as the response, then the answer):

    last <leaf> -> <the leaf bought most often after it>
    c1 <brand> <leaf> last0 brand1 cat1 follow2 next0 words1 = 7 ;     (one line per candidate)
    ...
    ranking :
    7 c1 <a_3><b_9><c_0><d_0> ;                                         (high score first, ties in c order)
    ...

Nothing here is run on its own: `python data.py` calls it.
"""
import re
from collections import Counter, defaultdict

import numpy as np
import torch

from catalogue import words

# What the teacher weighs for each candidate, with the number of values each piece of evidence takes.
EVIDENCE = {"last": 2,     # same brand as the last history item (0/1)
            "brand": 3,    # history items of its brand (0-2)
            "cat": 2,      # its category is in the history (0/1)
            "follow": 6,   # rank of its category among those bought right after the last item's: 1-3, 4 = 4th-5th,
                           # 5 = 6th-10th, 0 = rarer or never (from training purchases: the teacher's knowledge of routines)
            "next": 5,     # times it was bought right after the last history item in training purchases: 0, 1, 2-3,
                           # 4-7, 8+ (the same knowledge, item by item: what METHOD.md calls "bought together")
            "words": 4,    # title words shared with the last history item (0-3)
            "pos": 10}     # retriever position, 0 for c1 ... 9 for c10 (the trace's c-number says it)
WEIGHT_SCALE = 9  # assumption: the largest fitted weight is rounded to 9, so a score is a sum of one-digit numbers


def leaf_of(item):
    return item["categories"][0][-1].lower() if item["categories"] and item["categories"][0] else "none"


PLACEHOLDER_TITLE = re.compile(r"title_\d+")  # source rows without a real title ("title_495"): no evidence


def brand_of(item):
    """The brand the reasoning cites: the title's first word (the item files carry no brand field; the synthetic
    titles start with the brand by construction, for a real catalogue it is a proxy), None for a placeholder."""
    w = words(item["title"])
    return None if not w or PLACEHOLDER_TITLE.fullmatch(item["title"].strip()) else w[0]


def title_terms(item):
    """The title's words after the brand: 3 letters or more, no numbers (sizes and counts are not taste)."""
    if brand_of(item) is None:
        return set()
    return {w for w in words(item["title"])[1:] if len(w) > 2 and not w.isdigit()}


def routine_ranks(items, train_seqs):
    """{category: {category bought right after it: rank}}, 1 = the commonest, from training sequences only."""
    trans = defaultdict(Counter)
    for s in train_seqs:
        for a, b in zip(s, s[1:]):
            trans[leaf_of(items[a])][leaf_of(items[b])] += 1
    return {leaf: {nxt: r for r, (nxt, _) in enumerate(c.most_common(), 1)} for leaf, c in trans.items()}


def next_counts(train_seqs):
    """{(item, item bought right after it): times}, from training sequences only."""
    return Counter(pair for s in train_seqs for pair in zip(s, s[1:]))


def next_bucket(n):
    return 0 if n <= 0 else 1 if n == 1 else 2 if n <= 3 else 3 if n <= 7 else 4


def evidence(items, history, cands, routine, follows=None, own=()):
    """One tuple per candidate: its value of each piece of EVIDENCE, in that order. All but `follow` and `next`
    are checkable in the prompt; those two are the teacher's knowledge of training purchases (`routine` by
    category, `follows` by item), with the user's `own` training sequence taken out for a training example."""
    last, follows = items[history[-1]], follows or Counter()
    own_follows = Counter(zip(own, own[1:]))
    brands = Counter(b for b in map(brand_of, (items[h] for h in history)) if b)
    leaves = {leaf_of(items[h]) for h in history}
    after, last_words = routine.get(leaf_of(last), {}), title_terms(last)
    rows = []
    for pos, c in enumerate(cands):
        brand, r = brand_of(items[c]), after.get(leaf_of(items[c]), 0)
        follow = 0 if not r or r > 10 else r if r <= 3 else 4 if r <= 5 else 5
        after_last = next_bucket(follows[history[-1], c] - own_follows[history[-1], c])
        rows.append((int(brand is not None and brand == brand_of(last)), min(brands[brand], 2) if brand else 0,
                     int(leaf_of(items[c]) in leaves), follow, after_last, min(len(title_terms(items[c]) & last_words), 3),
                     pos))
    return rows


def fit_teacher(evidences, targets, pieces=tuple(EVIDENCE)):
    """Integer weights {evidence: [weight of each value]} fitted on training examples, for the named `pieces`.

    A conditional logit: P(candidate j) = softmax_j(sum_k W_k[e_jk]), the target's likelihood maximised by
    L-BFGS with a small L2 penalty. Each table is shifted to a minimum of 0 (every candidate has one value
    of each, so no ranking changes) and all are scaled so the largest is WEIGHT_SCALE, then rounded.
    """
    used = [i for i, k in enumerate(EVIDENCE) if k in pieces]
    sizes = [list(EVIDENCE.values())[i] for i in used]
    offsets = torch.tensor(np.cumsum([0] + sizes[:-1]))
    columns = torch.tensor(evidences)[:, :, used] + offsets  # (examples, 10 candidates, pieces used)
    X = torch.zeros(*columns.shape[:2], sum(sizes), dtype=torch.float64).scatter_(2, columns, 1.0)
    y = torch.tensor(targets)
    w = torch.zeros(sum(sizes), dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w], max_iter=200, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(X @ w, y) + 1e-3 * (w ** 2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    tables = [t - t.min() for t in w.detach().split(sizes)]
    top = max(float(t.max()) for t in tables) or 1.0
    names = [k for k in EVIDENCE if k in pieces]
    return {k: [int(round(v)) for v in (t * WEIGHT_SCALE / top).tolist()] for k, t in zip(names, tables)}


def rank_by(ev, weights):
    """Candidate positions sorted by score (high first), ties kept in retriever order; and the scores."""
    scores = [sum(weights[k][v] for k, v in zip(EVIDENCE, e) if k in weights) for e in ev]
    return sorted(range(len(ev)), key=lambda p: -scores[p]), scores


def teacher_trace(items, sid, history, cands, target, routine, weights, ev):
    """(reasoning, answer) when the teacher's ranking puts the target first, else None; `ev` is the candidates'
    evidence (evidence())."""
    order, scores = rank_by(ev, weights)
    if cands[order[0]] != target:
        return None
    last = leaf_of(items[history[-1]])
    after = routine.get(last, {})
    lines = [f"last {last} -> {min(after, key=after.get) if after else 'none'}"]
    lines += [f"c{p + 1} {brand_of(items[c]) or 'none'} {leaf_of(items[c])} "
              + " ".join(f"{k}{v}" for k, v in zip(EVIDENCE, e) if k in weights and k != "pos") + f" = {s} ;"
              for p, (c, e, s) in enumerate(zip(cands, ev, scores))]
    lines += ["ranking :"] + [f"{scores[p]} c{p + 1} {sid[cands[p]]} ;" for p in order]
    return "<think>\n" + "\n".join(lines) + "\n</think>", answer_text(sid, cands, order)


def answer_text(sid, cands, order):
    """The answer of every trace: the candidates' SIDs in ranked order (`order` holds candidate positions)."""
    return "\n\n[" + "".join(sid[cands[p]] for p in order) + "]"
