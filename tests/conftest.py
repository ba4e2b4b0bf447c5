"""Shared fixtures: micro random-init Qwen3 models (no downloads), a tiny synthetic dataset, the project root on sys.path."""
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SHARED = ROOT.parent / "shared" / "data"
QWEN = SHARED / "qwen3-tokenizer"

from model import PRESETS  # noqa: E402  (needs ROOT on sys.path)

# A vocabulary small enough that every logit row is cheap; the mask and end tokens sit at its top, as they may.
VOCAB, MASK, EOS, PAD = 61, 60, 59, 0


def tiny(attn="sdpa", seed=0, sharpen=1.0, vocab=VOCAB):
    """The 'micro' preset with random weights and an untied head; sharpen > 1 scales the LM head so that
    decoding is confident (several commits per step, softmax at exactly 1.0)."""
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=vocab, tie_word_embeddings=False, max_position_embeddings=512, pad_token_id=PAD,
                      eos_token_id=EOS, bos_token_id=None, rope_theta=10000.0, **PRESETS["micro"])
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=torch.float32).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpen)
    return model


def random_prompts(n, lo=5, hi=12, seed=0):
    """n token-id lists of lengths in [lo, hi), never containing the end or the mask token."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, EOS, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]


@pytest.fixture(params=["eager", "sdpa"])
def attn(request):
    """Both attention kernels: eager adds the mask to the scores, sdpa takes it as a bool tensor."""
    return request.param


def build_data(out, tokenizer="word", users=150, max_eval=4):
    """A synthetic dataset as data.py writes it, sized for seconds (150 users, 4 valid / test examples)."""
    import data
    assert data.main(["--out", str(out), "--users", str(users), "--max-eval", str(max_eval),
                      "--tokenizer", str(tokenizer)]) == 0
    return out


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """One word-tokenizer dataset shared by every test that runs a stage script."""
    return build_data(tmp_path_factory.mktemp("data") / "synthetic")
