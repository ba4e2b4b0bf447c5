"""
Where the users and items come from: the two catalogues data.py builds the re-ranking task from.

Both arrive in one JSONL layout, `*_items.jsonl` (item, item_id, title, categories) and `*_users.jsonl`
(user, user_id, items in time order), so everything after this file has one code path:

- Amazon Beauty 2014 5-core, already in that layout (../shared/data/amazon-beauty), or as McAuley's
  original `reviews_Beauty_5.json.gz` + `meta_Beauty.json.gz` (read, sorted by time, k-core filtered);
- a seeded synthetic beauty world (make_synthetic): a category tree whose leaves follow a routine,
  brands, and users with lasting tastes plus noise. It is *written* in the layout and read back.

Bad input raises DataError with the file, the line and what is wrong. Nothing here is run on its own:
`python data.py` calls it.
"""
import ast
import gzip
import html
import json
import os
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np


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
