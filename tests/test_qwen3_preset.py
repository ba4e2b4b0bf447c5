"""The hub path without a hub: the real Qwen3 tokenizer and a random-init model with Qwen/Qwen3-0.6B's exact
config, saved as a local folder and passed as `sft.py --model FOLDER`, then one step of every stage at short
lengths on the CPU. Slow (a 0.6B model): `python -m pytest -m slow tests/test_qwen3_preset.py`."""
import json
import math

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer, Qwen3Config

from conftest import QWEN, build_data

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not QWEN.exists(), reason="no local Qwen3 tokenizer")]

# Qwen/Qwen3-0.6B's config.json, field by field (random weights: nothing is downloaded)
QWEN3_06B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, hidden_act="silu",
                 max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
                 attention_bias=False, attention_dropout=0.0, bos_token_id=151643, eos_token_id=151645,
                 initializer_range=0.02, use_cache=True, use_sliding_window=False, sliding_window=None,
                 max_window_layers=28)


def test_every_stage_runs_on_a_random_qwen3_0_6b(tmp_path):
    import cft
    import opd
    import rl
    import sft
    from model import PRESETS
    d = build_data(tmp_path / "data", tokenizer=QWEN, users=150, max_eval=4)
    tok = AutoTokenizer.from_pretrained(d / "tokenizer")
    assert {k: QWEN3_06B[k] for k in PRESETS["qwen3-0.6b"]} == PRESETS["qwen3-0.6b"]
    cfg = Qwen3Config(**QWEN3_06B)
    cfg.save_pretrained(tmp_path / "qwen3-0.6b")
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "qwen3-0.6b")
    common = ["--data", str(d), "--dtype", "float32", "--val-n", "1", "--test-n", "1", "--eval-every", "100",
              "--eval-batch", "1", "--fresh"]
    sft.main(["--model", str(tmp_path / "qwen3-0.6b"), "--out", str(tmp_path / "sft"), "--steps", "1",
              "--batch-size", "1", "--max-new", "32", *common])
    rows = load_file(tmp_path / "sft" / "model.safetensors")["model.embed_tokens.weight"].shape[0]
    print(f"tokenizer length {len(tok)}; embedding rows {rows}")
    assert rows == max(151936, 64 * math.ceil(len(tok) / 64))

    cft.main(["--init", str(tmp_path / "sft"), "--out", str(tmp_path / "cft"), "--steps", "1", "--batch-size", "1",
              "--block", "32", "--tau-n", "1", *common])
    conv, _, _ = cft.convert(tmp_path / "sft", "sdpa", "float32")
    emb = conv.get_input_embeddings().weight
    keep = torch.ones(len(tok), dtype=torch.bool)
    keep[tok.mask_token_id] = False
    assert torch.allclose(emb[tok.mask_token_id], emb[:len(tok)][keep].mean(0), atol=1e-6)

    roll = ["--init", str(tmp_path / "cft"), "--steps", "1", "--prompts-per-step", "1", "--group", "2", "--rows", "8",
            "--tau-n", "1", *common]
    opd.main([*roll, "--teacher", str(tmp_path / "sft"), "--out", str(tmp_path / "opd")])
    rl.main([*roll, "--out", str(tmp_path / "rl")])
    for stage in ("sft", "cft", "opd", "rl"):
        assert json.loads((tmp_path / stage / "metrics.json").read_text())["n"] == 1

    import data
    ex = data.load_splits(d)[0][0]  # the chat template writes the prompt, the trace opens one think block
    assert tok.decode(ex["prompt_ids"] + ex["response_ids"]).count("<think>") == 1
