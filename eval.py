"""
Parsing, validity and ranking metrics: the one place every stage reports with.

A response is `<think> reasoning </think>` followed by the answer, a bracketed list of 10 semantic
ids (SIDs), e.g. `[<a_3><b_17><c_0><d_0><a_9>...]`. We parse it, classify it

    valid        a permutation of the 10 candidates
    parse_error  no `</think>`, no `[...]` list, or something in the list that is not a SID
    out_of_set   a well-formed SID that is not one of the 10 candidates
    duplicate    some candidate named twice
    omission     fewer than 10 distinct candidates (and none of the above)

and score it. An invalid answer falls back to the retriever order, so a model that is never valid
scores exactly the retriever floor. With one relevant item (the held-out target) at rank r (1-based):

    Recall@k = 1[r <= k]          NDCG@k = 1[r <= k] / log2(r + 1)

This module only scores text: decoding lives in decode.py, the paper's tables in report.py.
"""
import math
import re

import numpy as np

SID_RE = re.compile(r"<a_(\d+)>\s*<b_(\d+)>\s*<c_(\d+)>\s*<d_(\d+)>")
KS = (1, 3, 5)
METRIC_KEYS = ("recall@1", "recall@3", "ndcg@3", "recall@5", "ndcg@5")
INVALID_KINDS = ("parse_error", "out_of_set", "duplicate", "omission")


def sid_str(a, b, c, d):
    """The canonical text of one semantic id."""
    return f"<a_{a}><b_{b}><c_{c}><d_{d}>"


def parse_answer(text):
    """The SIDs of the answer list after `</think>`, or None when the answer cannot be parsed."""
    if "</think>" not in text:
        return None
    answer = text.split("</think>", 1)[1]
    start, end = answer.find("["), answer.find("]")
    if start < 0 or end < start:
        return None
    inside = answer[start + 1:end]
    sids = [sid_str(*m.groups()) for m in SID_RE.finditer(inside)]
    if SID_RE.sub("", inside).strip():  # anything left over is not a SID: a broken answer
        return None
    return sids


def classify(ranking, candidates):
    """'valid' or the kind of invalid answer (see the module docstring)."""
    if ranking is None:
        return "parse_error"
    if any(s not in candidates for s in ranking):
        return "out_of_set"
    if len(set(ranking)) < len(ranking):
        return "duplicate"
    if len(ranking) < len(candidates):
        return "omission"
    return "valid"


def judge(text, candidates):
    """(ranking used for the metrics, validity class, parsed list or None) for one response."""
    parsed = parse_answer(text)
    kind = classify(parsed, candidates)
    return (parsed if kind == "valid" else list(candidates)), kind, parsed


INVALID_CAUSES = ("no ranking", "tie repeated", "sid mixed", "answer mis-copied", "order")
# a ranking line of teacher.teacher_trace: `score cK <a_><b_><c_><d_> ;`
RANKING_LINE_RE = re.compile(r"(\d+)\s+c(\d+)\s*(?:" + SID_RE.pattern + r")?\s*;")


def invalid_cause(text, candidates):
    """Where the trace of an invalid answer went wrong (a diagnostic of parallel decoding):

    no ranking         the reasoning has no `ranking :` section
    tie repeated       a ranking line names a candidate again, one that shares its score with another
    sid mixed          every candidate is named once, but some line's SID is not its candidate's
    answer mis-copied  the ranking lines are right; the answer list does not follow them
    order              anything else (a line lost, a wrong score, a candidate repeated across scores)
    """
    reasoning = text.split("</think>")[0]
    if "ranking :" not in reasoning:
        return "no ranking"
    evidence, ranking = reasoning.split("ranking :", 1)
    score = dict(re.findall(r"\bc(\d+)\b[^;=]*=\s*(\d+)", evidence))  # candidate number -> stated score
    lines = RANKING_LINE_RE.findall(ranking)                             # (score, k, a, b, c, d); a-d '' if no SID
    named = [k for _, k, *_ in lines]
    if sorted(named, key=int) == [str(k + 1) for k in range(len(candidates))]:
        right = all(not sid[0] or sid_str(*sid) == candidates[int(k) - 1] for _, k, *sid in lines)
        return "answer mis-copied" if right else "sid mixed"
    repeated = [k for k in set(named) if named.count(k) > 1]
    if repeated and all(list(score.values()).count(score.get(k)) > 1 for k in repeated):
        return "tie repeated"
    return "order"


def rank_metrics(ranking, target):
    """Recall@1/3/5 and NDCG@3/5 of one ranking with a single relevant item."""
    r = ranking.index(target) + 1 if target in ranking else math.inf
    out = {f"recall@{k}": float(r <= k) for k in KS}
    for k in (3, 5):
        out[f"ndcg@{k}"] = 1.0 / math.log2(r + 1) if r <= k else 0.0
    return out


def score_responses(texts, examples, sid_of):
    """Per-example records for responses `texts` to `examples` (dicts with candidates/target item ids).

    sid_of maps an item index to its SID string. Returns a list of dicts with the parsed ranking,
    the validity class and the metrics; `summarize` turns it into the report numbers.
    """
    rows = []
    for text, ex in zip(texts, examples):
        cands = [sid_of[i] for i in ex["candidates"]]
        ranking, kind, parsed = judge(text, cands)
        rows.append({"validity": kind, "parsed": parsed, "copies_retriever": kind == "valid" and parsed == cands,
                     **rank_metrics(ranking, sid_of[ex["target"]])})
    return rows


def floor_rows(examples):
    """The retriever order scored the same way: the floor every re-ranker is compared with."""
    return [{"validity": "valid", "copies_retriever": True, **rank_metrics(list(ex["candidates"]), ex["target"])}
            for ex in examples]


def summarize(rows):
    """Means of the metrics, the valid rate, the identity rate and the breakdown of invalid answers.

    identity_rate: the share of answers that are valid and copy the retriever order, the reward-hacking signal
    RL must not raise (an invalid answer falls back to that order but is not counted here)."""
    n = len(rows)
    out = {k: float(np.mean([r[k] for r in rows])) if n else 0.0 for k in METRIC_KEYS}
    out["valid_rate"] = sum(r["validity"] == "valid" for r in rows) / max(n, 1)
    out["identity_rate"] = sum(r["copies_retriever"] for r in rows) / max(n, 1)
    out["invalid"] = {k: sum(r["validity"] == k for r in rows) for k in INVALID_KINDS}
    out["n"] = n
    return out


def bootstrap_ci(values, n_boot=1000, alpha=0.05, seed=0):
    """Percentile bootstrap interval of the mean of `values`."""
    values = np.asarray(values, dtype=np.float64)
    if len(values) == 0:
        return (0.0, 0.0)
    idx = np.random.default_rng(seed).integers(0, len(values), size=(n_boot, len(values)))
    means = values[idx].mean(1)
    return (float(np.quantile(means, alpha / 2)), float(np.quantile(means, 1 - alpha / 2)))


def paired_bootstrap(a, b, n_boot=1000, alpha=0.05, seed=0):
    """Mean of b - a over the same examples with its bootstrap interval: is b better than a?"""
    diff = np.asarray(b, dtype=np.float64) - np.asarray(a, dtype=np.float64)
    lo, hi = bootstrap_ci(diff, n_boot, alpha, seed)
    return float(diff.mean()) if len(diff) else 0.0, lo, hi


def rerank_reward(text, candidates, target, bonus=0.2):
    """GR2's reward: rank promotion of the target, a format bonus only when it helps, -1 when invalid.

        R = (rank_before(target) - rank_after(target)) / N  +  0.2 * 1[R > 0  or  target first before and after]
    The bonus is conditional so that copying the retriever order earns nothing (reward hacking).
    """
    ranking, kind, _ = judge(text, candidates)
    if kind != "valid":
        return -1.0
    before, after = candidates.index(target) + 1, ranking.index(target) + 1
    r = (before - after) / len(candidates)
    return r + bonus if r > 0 or before == after == 1 else r


# ----------------------------------------------------------------------------- a stage's metrics.json
def stage_metrics(quality, examples, by_tau=None):
    """OUT/metrics.json content: quality-mode metrics at the top, the floor, and (diffusion) other taus."""
    out = {k: quality[k] for k in (*METRIC_KEYS, "valid_rate", "identity_rate", "invalid", "n")}
    for k in ("tokens_per_forward", "tokens_per_s", "mean_length"):
        if k in quality:
            out[k] = quality[k]
    floor = summarize(floor_rows(examples))
    out["floor"] = {k: floor[k] for k in (*METRIC_KEYS, "n")}
    if by_tau:
        out["by_tau"] = {str(t): {k: m[k] for k in (*METRIC_KEYS, "valid_rate", "identity_rate", "invalid", "n", "tokens_per_forward",
                                                    "tokens_per_s")}
                         for t, m in by_tau.items()}
    return out
