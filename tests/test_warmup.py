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
