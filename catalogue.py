"""
The catalogue side of the re-ranking task: where the users and items come from (1), the items' semantic
ids (2) and the retriever that proposes each example's candidates (3). data.py builds the task from them.

Both arrive in one JSONL layout, `*_items.jsonl` (item, item_id, title, categories) and `*_users.jsonl`
(user, user_id, items in time order), so everything after this file has one code path:

- Amazon Beauty 2014 5-core, already in that layout (../shared/data/amazon-beauty), or as McAuley's
  original `reviews_Beauty_5.json.gz` + `meta_Beauty.json.gz` (read, sorted by time, k-core filtered);
- a seeded synthetic beauty world (make_synthetic): a category tree whose leaves follow a routine,
  brands, and users with lasting tastes plus noise. It is *written* in the layout and read back.

Bad input raises DataError with the file, the line and what is wrong. Nothing here is run on its own:
`python data.py` calls it (its docstring says what the SIDs and the retriever are).
"""
import ast
import gzip
import html
import json
import math
import os
import re
import warnings
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm


# ----------------------------------------------------------------------------- 1. catalogues
class DataError(ValueError):
    """Bad input: the message names the file (and line) and what is wrong with it."""


def _lines(path):
    """(line number, text) of a plain or gzipped UTF-8 file; unreadable bytes raise DataError naming the file.
    Bytes are decoded line by line so that a bad byte is reported with its line."""
    line_no = 0
    try:
        with (gzip.open if str(path).endswith(".gz") else open)(path, "rb") as f:
            for line_no, line in enumerate(f, 1):
                yield line_no, line.decode("utf-8")
    except UnicodeDecodeError:
        raise DataError(f"{path}:{line_no}: not UTF-8 text") from None
    except (OSError, EOFError) as e:  # missing, a folder, not gzip, truncated
        raise DataError(f"{path}: cannot be read ({getattr(e, 'strerror', None) or e})") from None


def _strings(v):
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


# Required fields of a row: (check, what the value must be). data.py hashes the ids and iterates the lists,
# so a value of another type would fail far from its line or, worse, silently (a string iterates as letters).
ITEM_FIELDS = {"item": (lambda v: isinstance(v, str), "a string"), "title": (lambda v: isinstance(v, str), "a string"),
               "categories": (lambda v: isinstance(v, list) and all(map(_strings, v)), "a list of lists of strings")}
USER_FIELDS = {"user": (lambda v: True, "anything"), "items": (_strings, "a list of strings")}


def _read_jsonl(path, fields, what):
    """[(line number, row)] of a JSON-lines file, blank lines skipped; a clear error at the first bad line,
    and when the file holds no rows at all (`what` names them: "items", "users")."""
    rows = []
    for line_no, line in _lines(path):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{line_no}: malformed JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise DataError(f"{path}:{line_no}: expected a JSON object, got {type(row).__name__}")
        missing = [k for k in fields if k not in row]
        if missing:
            raise DataError(f"{path}:{line_no}: missing field(s) {missing}")
        for k, (ok, kind) in fields.items():
            if not ok(row[k]):
                raise DataError(f"{path}:{line_no}: field {k!r} should be {kind}, got {json.dumps(row[k])[:60]}")
        rows.append((line_no, row))
    if not rows:
        raise DataError(f"{path}: no {what} (the file is empty or blank)")
    return rows


def read_jsonl_layout(raw):
    """items (list of dicts) and users (list of item-id lists) from `*_items.jsonl` + `*_users.jsonl`."""
    if not Path(raw).is_dir():
        raise DataError(f"{raw}: directory not found")
    found = {}
    for kind in ("items", "users"):
        hits = sorted(Path(raw).glob(f"*{kind}.jsonl"))
        if len(hits) != 1:
            raise DataError(f"{raw}: expected exactly one *{kind}.jsonl, found {len(hits)}")
        found[kind] = hits[0]
    items, known = [], {}
    for line_no, it in _read_jsonl(found["items"], ITEM_FIELDS, "items"):
        if it["item"] in known:  # two rows for one id would give one item two indices
            raise DataError(f"{found['items']}:{line_no}: item {it['item']!r} already on line {known[it['item']]}")
        known[it["item"]] = line_no
        items.append(it)
    users = []
    for line_no, u in _read_jsonl(found["users"], USER_FIELDS, "users"):
        for it in u["items"]:
            if it not in known:
                raise DataError(f"{found['users']}:{line_no}: item {it!r} has no metadata in {found['items'].name}")
        users.append(u["items"])
    return items, users


def read_mcauley(raw, k_core=5):
    """McAuley's 2014 files: reviews sorted by time per user (stable), k-core filtered, with metadata."""
    rev_path, meta_path = Path(raw) / "reviews_Beauty_5.json.gz", Path(raw) / "meta_Beauty.json.gz"
    for p in (rev_path, meta_path):
        if not p.exists():
            raise DataError(f"{p}: file not found")
    by_user = defaultdict(list)
    for line_no, line in _lines(rev_path):
        try:
            r = json.loads(line)
            by_user[r["reviewerID"]].append((int(r["unixReviewTime"]), r["asin"]))
        except (ValueError, KeyError, TypeError) as e:
            raise DataError(f"{rev_path}:{line_no}: malformed review ({e})") from None
    meta = {}
    for line_no, line in _lines(meta_path):
        try:  # the 2014 metadata is Python-literal, not JSON; literal_eval runs no code
            m = ast.literal_eval(line)
            meta[m["asin"]] = m
        except (ValueError, SyntaxError, KeyError, TypeError) as e:
            raise DataError(f"{meta_path}:{line_no}: malformed metadata ({e})") from None
    seqs = {u: list(dict.fromkeys(a for _, a in sorted(v, key=lambda x: x[0]))) for u, v in by_user.items()}
    while True:  # k-core: a no-op on the 5-core file, needed for anything larger
        counts = Counter(a for s in seqs.values() for a in s)
        new = {u: [a for a in s if counts[a] >= k_core] for u, s in seqs.items()}
        new = {u: s for u, s in new.items() if len(s) >= k_core}
        if new == seqs:
            break
        seqs = new
    users = list(seqs.values())
    if not users:
        raise DataError(f"{rev_path}: no users with {k_core} or more reviewed items ({len(by_user)} users before the filter)")
    order = list(dict.fromkeys(a for s in users for a in s))
    for a in order:
        if a not in meta or not meta[a].get("title"):
            raise DataError(f"{meta_path}: item {a!r} has no metadata (title)")
    items = [{"item": a, "title": html.unescape(meta[a]["title"]), "categories": meta[a].get("categories", [])}
             for a in order]
    return items, users


def catalogue_name(raw):
    """The catalogue's own name, for stats.json and the default output folder: the prefix of its
    `NAME_items.jsonl` (lower-cased), "beauty" for McAuley's Beauty files, else the folder's name."""
    if not Path(raw).is_dir():
        raise DataError(f"{raw}: directory not found")
    hits = sorted(Path(raw).glob("*items.jsonl"))
    if hits and hits[0].name.endswith("_items.jsonl"):
        return hits[0].name[:-len("_items.jsonl")].lower()
    if (Path(raw) / "reviews_Beauty_5.json.gz").exists():
        return "beauty"
    return Path(raw).resolve().name.lower()


def load_catalogue(raw):
    if not Path(raw).is_dir():
        raise DataError(f"{raw}: directory not found")
    if list(Path(raw).glob("*items.jsonl")) or list(Path(raw).glob("*users.jsonl")):
        return read_jsonl_layout(raw)
    if (Path(raw) / "reviews_Beauty_5.json.gz").exists():
        return read_mcauley(raw)
    raise DataError(f"{raw}: unknown format (expected *_items.jsonl + *_users.jsonl, "
                    "or reviews_Beauty_5.json.gz + meta_Beauty.json.gz)")


# A small beauty world: top category -> leaf categories in routine order (each leaf's next is the one after).
WORLD = {"hair": ["shampoo", "conditioner", "treatment", "oil", "spray"],
         "skin": ["cleanser", "toner", "serum", "moisturizer", "sunscreen"],
         "makeup": ["primer", "foundation", "concealer", "mascara", "lipstick"],
         "nails": ["basecoat", "polish", "topcoat", "remover", "cuticle"],
         "body": ["bodywash", "scrub", "lotion", "deodorant", "perfume"]}
ADJECTIVES = {"hair": ["silk", "argan", "volume", "repair", "shine"], "skin": ["hydra", "clear", "glow", "calm", "bright"],
              "makeup": ["matte", "velvet", "bold", "soft", "nude"], "nails": ["gloss", "gel", "quick", "strong", "chrome"],
              "body": ["fresh", "shea", "citrus", "pure", "cocoa"]}
BRANDS = ["aurora", "belle", "cedar", "dune", "ember", "fable", "halo", "iris", "jade", "kelp", "luna", "mira",
          "nova", "opal", "pearl", "quill", "rosa", "sage", "terra", "umbra", "vela", "willow", "yara", "zeph"]


def make_synthetic(seed=0, n_users=8000, p_routine=0.6, p_taste=0.2, p_fav_brand=0.7, mean_len=8):
    """A seeded catalogue with structure to reason about: tastes, brand loyalty, routines and noise.

    Each brand makes products in two top categories. A user has one or two favourite top categories
    and two favourite brands. After each purchase the next one follows the routine (the next leaf of
    the last item's top category) with p_routine, stays in a favourite category with p_taste, and is
    a popular item from anywhere otherwise; inside a category a favourite brand wins with p_fav_brand.
    """
    rng = np.random.default_rng(seed)
    tops = list(WORLD)
    leaf_top = {leaf: top for top, leaves in WORLD.items() for leaf in leaves}
    items = []
    for brand in BRANDS:
        for top in rng.choice(tops, size=2, replace=False):
            for leaf in WORLD[top]:
                for adj in rng.choice(ADJECTIVES[top], size=rng.integers(1, 4), replace=False):
                    items.append({"item": f"S{len(items):04d}", "title": f"{brand} {adj} {leaf}",
                                  "categories": [["Beauty", top.title(), leaf.title()]], "brand": brand, "leaf": leaf})
    pop = 1.0 / (1 + rng.permutation(len(items))) ** 0.7
    by_leaf = defaultdict(list)
    for i, it in enumerate(items):
        by_leaf[it["leaf"]].append(i)

    def pick(cands, fav_brands):
        fav = [i for i in cands if items[i]["brand"] in fav_brands]
        pool = fav if fav and rng.random() < p_fav_brand else cands
        w = pop[pool] / pop[pool].sum()
        return int(rng.choice(pool, p=w))

    users = []
    for _ in range(n_users):
        fav_tops = list(rng.choice(tops, size=1 + (rng.random() < 0.3), replace=False))
        makers = [b for b in BRANDS if any(items[i]["brand"] == b for t in fav_tops for l in WORLD[t] for i in by_leaf[l])]
        fav_brands = set(rng.choice(makers, size=2, replace=False))
        length = min(5 + rng.poisson(mean_len - 5), 20)
        seq = []
        while len(seq) < length:
            u = rng.random()
            if seq and u < p_routine:
                last = items[seq[-1]]["leaf"]
                leaves = WORLD[leaf_top[last]]
                cands = by_leaf[leaves[(leaves.index(last) + 1) % len(leaves)]]
            elif not seq or u < p_routine + p_taste:
                cands = by_leaf[rng.choice(WORLD[rng.choice(fav_tops)])]
            else:
                cands = list(range(len(items)))
            choice = pick([i for i in cands if i not in seq] or cands, fav_brands)
            if choice not in seq:
                seq.append(choice)
        users.append([items[i]["item"] for i in seq])
    return items, users


def write_jsonl_layout(items, users, out_dir, name):
    """Write a catalogue in the shared JSONL layout (the synthetic one goes through this too)."""
    os.makedirs(out_dir, exist_ok=True)
    with open(Path(out_dir) / f"{name}_items.jsonl", "w") as f:
        for i, it in enumerate(items, 1):
            f.write(json.dumps({"item": it["item"], "item_id": i, "title": it["title"], "categories": it["categories"]}) + "\n")
    with open(Path(out_dir) / f"{name}_users.jsonl", "w") as f:
        for u, seq in enumerate(users, 1):
            f.write(json.dumps({"user": f"U{u:05d}", "user_id": u, "items": seq}) + "\n")


# ----------------------------------------------------------------------------- 2. semantic ids
def words(text):
    return re.findall(r"[a-z0-9]+", text.lower())


def item_embeddings(items, dim=64, max_vocab=4096, seed=0):  # assumption: 64 dims of the 4,096 commonest words
    """TF-IDF of title + category words, reduced to `dim` dimensions by a (seeded) randomized SVD."""
    docs = [words(it["title"]) + [w for path in it["categories"] for c in path for w in words(c)] for it in items]
    df = Counter(w for d in docs for w in set(d))
    # Columns by document frequency, ties alphabetical: never by set order, which changes with PYTHONHASHSEED
    # (and with it the SVD, the k-means and every SID).
    vocab = {w: j for j, w in enumerate(sorted(df, key=lambda w: (-df[w], w))[:max_vocab])}
    X = torch.zeros(len(docs), len(vocab))
    for i, d in enumerate(docs):
        for w, c in Counter(d).items():
            if w in vocab:
                X[i, vocab[w]] = (1 + math.log(c)) * math.log(len(docs) / df[w])
    X = X / X.norm(dim=1, keepdim=True).clamp_min(1e-8)
    torch.manual_seed(seed)
    U, S, _ = torch.svd_lowrank(X, q=min(dim, min(X.shape) - 1), niter=4)
    return (U * S).numpy().astype(np.float64)


def kmeans(X, k, seed, iters=25):
    """Plain k-means with k-means++ seeding; returns (assignments, centroids)."""
    rng = np.random.default_rng(seed)
    k = min(k, len(X))
    C = [X[rng.integers(len(X))]]
    d2 = ((X - C[0]) ** 2).sum(1)
    for _ in range(1, k):
        C.append(X[rng.choice(len(X), p=d2 / d2.sum())] if d2.sum() > 0 else X[rng.integers(len(X))])
        d2 = np.minimum(d2, ((X - C[-1]) ** 2).sum(1))
    C = np.stack(C)
    for _ in range(iters):
        assign = ((X ** 2).sum(1)[:, None] - 2 * X @ C.T + (C ** 2).sum(1)[None]).argmin(1)
        for j in range(k):
            if (assign == j).any():
                C[j] = X[assign == j].mean(0)
    return assign, C


def semantic_ids(items, codebook, seed=0):
    """(N, 4) codes: 3 levels of residual k-means, then a collision counter that makes each SID unique."""
    residual = item_embeddings(items, seed=seed)
    codes = []
    for level in range(3):
        assign, C = kmeans(residual, codebook, seed + level)
        codes.append(assign)
        residual = residual - C[assign]
    codes = np.stack(codes, 1)
    seen = Counter()
    last = np.zeros(len(items), dtype=np.int64)
    for i, prefix in enumerate(map(tuple, codes)):
        last[i] = seen[prefix]
        seen[prefix] += 1
    return np.concatenate([codes, last[:, None]], 1)


# ----------------------------------------------------------------------------- 3. retriever
class CoocRetriever:
    """Item-to-item co-occurrence on training sequences, recency-weighted over the history.

    C[i, j] adds 1/gap for j bought `gap` <= window positions after i, and `back`/gap for before.
    score(j | history) = sum_h decay^(age of h) * C[h, j] / count(j)^pop_alpha; history items are
    excluded and popular items backfill when fewer than k items score above zero.
    """

    # assumption: METHOD.md asks for a retriever whose top 10 are the candidates, not which one; these weights set
    # the candidate lists and so the floor, which the data's stats.json records
    def __init__(self, n_items, window=3, back=0.5, decay=0.6, pop_alpha=0.2, max_history=10):
        self.n, self.window, self.back, self.decay = n_items, window, back, decay
        self.pop_alpha, self.max_history = pop_alpha, max_history

    def pair_weights(self, seq):
        """(i, j, w) co-occurrence contributions of one sequence."""
        out = []
        for p, i in enumerate(seq):
            for gap in range(1, self.window + 1):
                if p + gap < len(seq):
                    j = seq[p + gap]
                    out += [(i, j, 1.0 / gap), (j, i, self.back / gap)]
        return out

    def fit(self, train_seqs):
        rows, cols, vals = zip(*[t for s in train_seqs for t in self.pair_weights(s)])
        C = torch.sparse_coo_tensor(torch.tensor([rows, cols]), torch.tensor(vals, dtype=torch.float64),
                                    (self.n, self.n), check_invariants=True).coalesce()  # cheap at this size
        self.count = torch.bincount(torch.tensor([i for s in train_seqs for i in s]), minlength=self.n).double()
        with warnings.catch_warnings():  # CSR is the fast layout for sparse @ dense on CPU; torch calls it beta
            warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
            self.CT = C.t().coalesce().to_sparse_csr()  # (to, from): scores = CT @ history weights
        self.norm = self.count.clamp_min(1) ** self.pop_alpha
        return self

    def history_weights(self, history):
        hist = history[-self.max_history:]
        return {h: self.decay ** (len(hist) - 1 - a) for a, h in enumerate(hist)}

    def scores(self, histories, own_seqs=None):
        """(len(histories), n_items) scores; own_seqs[r] removes that user's own pairs from row r."""
        H = torch.zeros(len(histories), self.n, dtype=torch.float64)
        for r, hist in enumerate(histories):
            for h, w in self.history_weights(hist).items():
                H[r, h] += w
        S = torch.sparse.mm(self.CT, H.t()).t()  # (rows, n_items)
        for r, own in enumerate(own_seqs or []):
            if own:
                for i, j, w in self.pair_weights(own):
                    S[r, j] -= H[r, i] * w
        return S.clamp_min(0) / self.norm

    def top_k(self, histories, k=10, own_seqs=None, chunk=2048, desc="retriever"):
        """The top-k items (retriever order) for each history."""
        out = []
        for s in tqdm(range(0, len(histories), chunk), desc=desc, unit="chunk", leave=False):
            S = self.scores(histories[s:s + chunk], own_seqs[s:s + chunk] if own_seqs else None)
            S = S + 1e-9 * self.count / self.count.max()  # popularity backfill and tie-break
            for r, hist in enumerate(histories[s:s + chunk]):
                S[r, list(set(hist))] = -1.0
            top = torch.topk(S, k, dim=1).indices
            out += top.tolist()
        return out
