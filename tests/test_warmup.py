"""warmup.py: its responses copy the candidates in a fresh random order, and sft.py starts from its weights."""
import json
import re

import numpy as np
import torch
from transformers import AutoTokenizer

import data
import eval as metrics
import warmup
from model import create_model


def test_a_copy_response_lists_every_candidate_once_in_a_random_order(tiny_data):
    train, _, _, sid = data.load_splits(tiny_data, 1, 1)
    tok = AutoTokenizer.from_pretrained(tiny_data / "tokenizer")
    ex = train[0]
    orders = []
    for seed in range(4):
        copy = warmup.copy_example(ex, sid, tok, np.random.default_rng(seed))
        assert copy["prompt_ids"] == ex["prompt_ids"]
        text = tok.decode(copy["response_ids"])
        reasoning = tok.decode(copy["response_ids"][:copy["n_reasoning"]])
        assert reasoning.endswith("</think>") and copy["response_ids"][-1] == tok.eos_token_id
        # each line names a candidate by its number and copies that candidate's SID (word tokenizer: spaced tokens)
        lines = re.findall(r"c(\d+) ((?:<[a-d]_\d+> ?){4});", reasoning)
        order = [int(n) - 1 for n, _ in lines]
        assert sorted(order) == list(range(len(ex["candidates"])))
        assert [s.replace(" ", "") for _, s in lines] == [sid[ex["candidates"][p]] for p in order]
        row = metrics.score_responses([text], [ex], sid)[0]  # the answer follows the lines and is a valid ranking
        assert row["validity"] == "valid" and row["parsed"] == [sid[ex["candidates"][p]] for p in order]
        orders.append(order)
    assert len({tuple(o) for o in orders}) > 1  # the order comes from the generator, not from the example


def test_warmup_writes_a_checkpoint_that_sft_starts_from(tiny_data, tmp_path):
    out = tmp_path / "warmup"
    result = warmup.main(["--data", str(tiny_data), "--out", str(out), "--model", "micro", "--steps", "2",
                          "--eval-every", "2", "--batch-size", "2", "--val-n", "2", "--eval-batch", "2"])
    assert json.loads((out / "metrics.json").read_text()) == result and 0 <= result["val_copy_exact"] <= 1
    assert json.loads((out / "stage.json").read_text())["stage"] == "warmup"
    micro = create_model("micro", AutoTokenizer.from_pretrained(tiny_data / "tokenizer"))
    loaded = create_model(str(out), AutoTokenizer.from_pretrained(out))
    moved = [not torch.equal(a, b) for a, b in zip(micro.state_dict().values(), loaded.state_dict().values())]
    assert any(moved)  # two steps of training changed the micro init, and sft.py --model OUT loads the changed weights


def test_copy_accuracy_counts_a_sid_right_only_when_all_four_codes_are(tiny_data, monkeypatch):
    """With a stand-in for the model's logits: the true next token everywhere, then one code of one SID wrong."""
    _, valid, _, sid = data.load_splits(tiny_data, 3, 1)
    tok = AutoTokenizer.from_pretrained(tiny_data / "tokenizer")
    model = create_model("micro", tok)
    wrong = {"n": 0}

    def perfect_logits(model, prompts, responses, pad_id):
        target = torch.tensor([t for r in responses for t in r])
        logits = torch.nn.functional.one_hot(target, len(tok)).float()
        codes = [k for k, t in enumerate(target.tolist()) if warmup.SID_CODE.fullmatch(tok.convert_ids_to_tokens(t))]
        for k in codes[2:2 + wrong["n"]]:  # the 3rd code of the first SID (and on) predicted as another token
            logits[k] = torch.roll(logits[k], 1)
        return logits

    monkeypatch.setattr(warmup, "ar_logits", perfect_logits)
    n_sids = 3 * 2 * len(valid[0]["candidates"])  # each copy response writes every candidate twice (lines, answer)
    assert warmup.copy_accuracy(model, tok, valid, sid, batch_size=5) == (1.0, [1.0] * 4)
    wrong["n"] = 1
    miss = (n_sids - 1) / n_sids
    assert warmup.copy_accuracy(model, tok, valid, sid, batch_size=5) == (miss, [1.0, 1.0, miss, 1.0])
    wrong["n"] = 4  # codes 3-6: the last two of the first SID and the first two of the second
    assert warmup.copy_accuracy(model, tok, valid, sid, batch_size=5) == ((n_sids - 2) / n_sids, [miss] * 4)


def test_the_curriculum_grows_the_prompt_from_one_candidate_to_the_whole_prompt():
    sizes = [warmup.prompt_size(step, 100, 0.5, 10, 6) for step in range(100)]
    assert sizes[0] == (1, 0) and sizes[50] == sizes[99] == (10, 6)
    assert all(a <= b and h <= g for (a, h), (b, g) in zip(sizes, sizes[1:]))  # it never shrinks
    assert len(set(sizes[:50])) > 5  # it grows step by step, not in one jump
    assert {warmup.prompt_size(step, 100, 0.0, 10, 6) for step in range(100)} == {(10, 6)}  # off: the whole prompt


def test_a_curriculum_prompt_keeps_some_candidates_renumbered_and_the_last_history_items(tiny_data):
    train, _, _, sid = data.load_splits(tiny_data, 1, 1)
    tok = AutoTokenizer.from_pretrained(tiny_data / "tokenizer")
    ex = next(e for e in train if len(e["history"]) >= 2)
    hist_lines, cand_lines = data.prompt_lines(ex["prompt"])
    assert data.layout_prompt(hist_lines, cand_lines) == ex["prompt"]  # the layout and its inverse
    copy = warmup.copy_example(ex, sid, tok, np.random.default_rng(0), n_cands=2, n_hist=1)
    prompt = tok.decode(copy["prompt_ids"])
    shown = [c for c in ex["candidates"] if sid[c] in prompt.replace(" ", "")]
    assert len(shown) == 2 and "c2 " in prompt and "c3 " not in prompt  # two of them, numbered c1 and c2
    assert sid[ex["history"][-1]] in prompt.replace(" ", "") and sid[ex["history"][-2]] not in prompt.replace(" ", "")
    reasoning = tok.decode(copy["response_ids"][:copy["n_reasoning"]]).replace(" ", "")
    assert sorted(re.findall(r"c(\d+)((?:<[a-d]_\d+>){4})", reasoning)) == [("1", sid[shown[0]]), ("2", sid[shown[1]])]
