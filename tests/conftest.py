"""Shared fixtures: tiny random-init Qwen3 models (no downloads) and the project root on sys.path."""
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SHARED = ROOT.parent / "shared" / "data"

VOCAB, MASK, EOS, PAD = 61, 60, 59, 0


def tiny(attn="sdpa", seed=0, sharpen=1.0, vocab=VOCAB):
    """A 2-layer Qwen3 with random weights; sharpen > 1 scales the LM head so decoding is confident."""
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
                      max_position_embeddings=512, pad_token_id=PAD, eos_token_id=EOS)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=torch.float32).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpen)
    return model


def random_prompts(n, lo=5, hi=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, EOS, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]


@pytest.fixture(params=["eager", "sdpa"])
def attn(request):
    return request.param
