"""model.py: masks, the training layout, token shift, losses and checkpoints on tiny random models."""
import argparse
import pytest
import torch

from conftest import EOS, MASK, PAD, random_prompts, tiny
from model import (attention_mask, batch_indices, build_rows, diffusion_loss, ar_loss, for_attention, hidden_states,
                   load_checkpoint, sample_noise, save_checkpoint, suffix_mask, target_sources)


def logits_of(model, rows):
    return model.lm_head(hidden_states(model, rows))


def test_block_size_one_is_the_causal_model(attn):
    model = tiny(attn)
    p, r = random_prompts(1)[0], random_prompts(1, 20, 21, seed=1)[0]
    ours = logits_of(model, build_rows([p], [r], block=1))
    ids = torch.tensor([p + r])
    plain = model(input_ids=ids).logits  # HF's own causal path, no mask passed
    assert (ours - plain).abs().max() <= 1e-5


def test_noisy_half_equals_block_causal_forward_when_noisy_is_clean(attn):
    model = tiny(attn)
    p, r = random_prompts(1)[0], random_prompts(1, 23, 24, seed=1)[0]
    block = 4
    plain = logits_of(model, build_rows([p], [r], block))          # [prompt | response], block-causal
    both = logits_of(model, build_rows([p], [r], block, noisy=[[r]]))  # [prompt | x_t = x_0 | x_0]
    P, R = len(p), len(r)
    assert (both[:, P:P + R] - plain[:, P:P + R]).abs().max() <= 1e-5
    assert (both[:, P + R:] - plain[:, P:]).abs().max() <= 1e-5


def test_a_later_block_never_changes_earlier_blocks(attn):
    model = tiny(attn)
    p, r = random_prompts(1)[0], random_prompts(1, 16, 17, seed=2)[0]
    block, k = 4, 2
    changed = list(r)
    changed[k * block + 1] = (changed[k * block + 1] + 7) % 50 + 1
    a = logits_of(model, build_rows([p], [r], block))
    b = logits_of(model, build_rows([p], [changed], block))
    cut = len(p) + k * block
    assert (a[:, :cut] - b[:, :cut]).abs().max() == 0
    assert (a[:, cut:cut + block] - b[:, cut:cut + block]).abs().max() > 1e-4  # but its own block does see it


def test_mask_is_bidirectional_inside_a_block_and_causal_across():
    rows = build_rows([[1, 2]], [[3, 4, 5, 6, 7]], block=2, noisy=[[[MASK] * 5]])
    desc = (rows["seg"], rows["blk"], rows["pos"])
    m = attention_mask(desc, desc)[0, 0]
    N, C = 2, 7  # segment starts: noisy, clean (the prompt is columns 0-1)
    assert m[1, 0] and not m[0, 1]                        # prompt is causal
    assert m[N + 0, N + 1] and m[N + 1, N + 0]            # noisy block 0 is bidirectional
    assert not m[N + 0, N + 2]                            # ... and cannot see noisy block 1
    assert m[N + 2, C + 1] and not m[N + 2, C + 2]        # noisy block 1 sees clean block 0, not clean block 1
    assert m[C + 2, C + 3] and m[C + 3, C + 2] and not m[C + 1, C + 2]  # clean copy is block-causal
    assert not m[C:, N:C].any()                           # clean tokens never see noisy ones


def test_causal_context_changes_only_how_clean_tokens_see_their_own_block():
    rows = build_rows([[1, 2]], [[3, 4, 5, 6, 7]], block=2, noisy=[[[MASK] * 5]])
    desc = (rows["seg"], rows["blk"], rows["pos"])
    block, causal = attention_mask(desc, desc)[0, 0], attention_mask(desc, desc, "causal")[0, 0]
    C = 7
    assert block[C + 2, C + 3] and not causal[C + 2, C + 3]   # a clean token no longer sees the next one in its block
    assert causal[C + 3, C + 2] and causal[C + 3, C + 1]       # ... but every earlier one
    differ = block != causal
    assert differ[C:, C:].sum() == 2 and not differ[:C].any()  # (2,3) and (4,5) of x_0 only; noisy rows unchanged


def test_under_the_causal_context_x0_is_exactly_the_ar_forward(attn):
    model = tiny(attn)
    model.config.diffusion_context = "causal"
    p, r = random_prompts(1)[0], random_prompts(1, 13, 14, seed=1)[0]
    rows = build_rows([p], [r], 4, noisy=[[[MASK] * len(r)]])
    ours = logits_of(model, rows)[:, -len(r):]  # the x_0 copy
    plain = model(input_ids=torch.tensor([p + r])).logits[:, len(p):]  # HF's own causal path
    assert (ours - plain).abs().max() <= 1e-5


def test_ar_weight_adds_exactly_the_ar_loss_and_needs_the_causal_context():
    model = tiny()
    batch = {"prompt_ids": random_prompts(2), "response_ids": random_prompts(2, 6, 11, seed=3), "n_reasoning": [3, 5]}
    masked = torch.rand(2, 12, generator=torch.Generator().manual_seed(0)) < 0.5
    with pytest.raises(ValueError, match="causal context"):
        diffusion_loss(model, batch, 4, MASK, EOS, masked=masked, ar_weight=0.5)
    model.config.diffusion_context = "causal"
    plain, _ = diffusion_loss(model, batch, 4, MASK, EOS, masked=masked)
    both, _ = diffusion_loss(model, batch, 4, MASK, EOS, masked=masked, ar_weight=0.5)
    assert abs((both - plain).item() - 0.5 * ar_loss(model, batch).item()) <= 1e-5


def test_eager_and_sdpa_agree_on_the_padded_training_layout():
    eager, sdpa = tiny("eager"), tiny("sdpa")
    ps, rs = random_prompts(3), random_prompts(3, 9, 19, seed=3)
    noisy = [[MASK if i % 3 == 0 else t for i, t in enumerate(r)] for r in rs]
    rows = build_rows(ps, rs, 4, noisy=[noisy], pad_id=PAD)
    real = rows["seg"] != 0
    a, b = logits_of(eager, rows)[real], logits_of(sdpa, rows)[real]
    assert (a - b).abs().max() <= 1e-5


def test_eager_needs_an_additive_mask():
    model = tiny("eager")
    m = torch.ones(1, 1, 2, 2, dtype=torch.bool).tril()
    assert for_attention(m, model).dtype == torch.float32 and for_attention(m, model)[0, 0, 0, 1] < -1e30


def test_token_shift_sources():
    rows = build_rows([[1, 2, 3]], [[4, 5, 6, 7, 8]], block=2, noisy=[[[MASK] * 5]])
    src, _ = target_sources(rows, [5], 2)
    P, N, C = 3, 3, 8
    assert src[0].tolist() == [P - 1, N + 0, C + 1, N + 2, C + 3]
    plain = build_rows([[1, 2, 3]], [[4, 5, 6, 7, 8]], block=2)
    assert target_sources(plain, [5], 2)[0][0].tolist() == [2, 3, 4, 5, 6]


def batch_of(ps, rs):
    return {"prompt_ids": ps, "response_ids": rs, "n_reasoning": [len(r) // 2 for r in rs]}


def test_diffusion_loss_scores_only_masked_response_tokens():
    model = tiny()
    ps, rs = [random_prompts(1)[0], random_prompts(1, 12, 13, seed=4)[0]], [[5, 6, 7, 8, 9, 10], [11, 12, 13, 14]]
    block = 4
    masked = torch.zeros(2, 8, dtype=torch.bool)
    masked[0, [1, 5]] = True  # only example 0 has targets; example 1 is padding-length different
    loss, n = diffusion_loss(model, batch_of(ps, rs), block, MASK, EOS, lam_r=1.0, lam_o=1.0, complementary=False, masked=masked)
    assert n == 2
    # the same two targets computed by hand from one forward of the layout
    resp0 = rs[0] + [EOS, EOS]  # padded to a whole block with the end token
    noisy0 = [MASK if masked[0, j] else t for j, t in enumerate(resp0)]
    rows = build_rows([ps[0]], [resp0], block, noisy=[[noisy0]])
    logits = logits_of(model, rows)[0]
    src, _ = target_sources(rows, [8], block)
    ce = [torch.nn.functional.cross_entropy(logits[src[0, j]][None], torch.tensor([resp0[j]])) for j in (1, 5)]
    assert torch.allclose(loss, torch.stack(ce).mean(), atol=1e-6)
    # alone, example 0 gives the same loss: the other row's different length leaks nothing
    alone, _ = diffusion_loss(model, batch_of(ps[:1], rs[:1]), block, MASK, EOS, lam_r=1.0, lam_o=1.0,
                              complementary=False, masked=masked[:1])
    assert torch.allclose(loss, alone, atol=1e-6)


def test_noisy_copies_sharing_a_row_get_the_logits_of_rows_of_their_own(attn):
    model, block = tiny(attn), 4
    ps, rs = random_prompts(2), random_prompts(2, 6, 11, seed=5)  # different lengths: padding in both layouts
    g = torch.Generator().manual_seed(1)
    copies = [[[MASK if torch.rand(1, generator=g) < 0.5 else x for x in r] for r in rs] for _ in range(2)]
    shared = build_rows(ps, rs, block, noisy=copies, pad_id=PAD)
    h = logits_of(model, shared)
    lengths = [len(r) for r in rs]
    for c in range(2):  # every logit that predicts a response token from copy c, read in both layouts
        alone = build_rows(ps, rs, block, noisy=[copies[c]], pad_id=PAD)
        a = logits_of(model, alone)
        src_shared, _ = target_sources(shared, lengths, block, copy=c)
        src_alone, _ = target_sources(alone, lengths, block)
        for i, n in enumerate(lengths):
            assert (h[i, src_shared[i, :n]] - a[i, src_alone[i, :n]]).abs().max() <= 1e-5
    assert (shared["seg"] == 4).sum() == sum(map(len, rs))  # the second copy has a segment id of its own


def test_complementary_loss_in_one_row_equals_the_two_rows_of_its_masks():
    model, block = tiny(), 4
    ps, rs = random_prompts(2), [[5, 6, 7, 8, 9, 10], [11, 12, 13]]  # padded to 8 and 4 tokens
    masked = torch.rand(2, 8, generator=torch.Generator().manual_seed(2)) < 0.4
    real = torch.arange(8)[None] < torch.tensor([[8], [4]])
    args = (model, batch_of(ps, rs), block, MASK, EOS)
    pair, n = diffusion_loss(*args, complementary=True, masked=masked)
    one, n1 = diffusion_loss(*args, complementary=False, masked=masked)
    two, n2 = diffusion_loss(*args, complementary=False, masked=~masked & real)
    w = torch.tensor([0.5] * 3 + [1.0] * 5), torch.tensor([0.5] + [1.0] * 3)  # lambda_r on the first n_reasoning
    w1, w2 = (sum(float(wi[m[i, :len(wi)]].sum()) for i, wi in enumerate(w)) for m in (masked, ~masked & real))
    assert n == n1 + n2 == 8 + 4  # every real response token is a target exactly once per pair
    assert torch.allclose(pair, (w1 * one + w2 * two) / (w1 + w2), atol=1e-5)


def test_suffix_noise_masks_the_end_of_every_block_and_its_pair_the_other_end():
    lengths, block = [8, 12, 5], 4
    masked, t, suffix = sample_noise(lengths, block, (0.02, 0.98), generator=torch.Generator().manual_seed(0), shape="suffix")
    assert suffix.all()
    other = suffix_mask(1 - t, block)
    for i, n in enumerate(lengths):
        for lo in range(0, n, block):
            row = masked[i, lo:min(lo + block, n)].tolist()
            k = sum(row)
            assert k >= 1 and row == [False] * (len(row) - k) + [True] * k  # a suffix, never empty
            if lo + block <= n:  # a whole block (cft pads every response to whole blocks)
                assert k == max(1, round(float(t[i, lo]) * block))  # of the sampled length
                assert abs(k + int(other[i, lo:lo + block].sum()) - block) <= 1  # the pair's lengths add up to a block
        assert not masked[i, n:].any()  # padding beyond the response is never masked


def test_mixed_noise_makes_each_block_a_suffix_or_the_random_draw():
    lengths, block = [8, 12, 5], 4
    draw = lambda shape, frac=0.5: sample_noise(lengths, block, (0.02, 0.98), generator=torch.Generator().manual_seed(3),
                                                shape=shape, suffix_frac=frac)
    random_masked, t, _ = draw("random")
    assert torch.equal(draw("mixed", 0.0)[0], random_masked)  # the same draws: mixed only adds a coin per block
    suffix_masked, _, suffix = draw("mixed", 1.0)
    real = torch.arange(12)[None] < torch.tensor(lengths)[:, None]
    assert suffix.all() and torch.equal(suffix_masked, suffix_mask(t, block) & real)
    masked, _, suffix = draw("mixed", 0.5)
    assert 0 < suffix[real].float().mean() < 1  # both kinds occur in this draw
    assert torch.equal(masked, torch.where(suffix, suffix_masked, random_masked))  # block by block, one or the other
    for i, n in enumerate(lengths):  # the coin is per block: a block is wholly one kind
        for lo in range(0, n, block):
            assert len(set(suffix[i, lo:min(lo + block, n)].tolist())) == 1


def test_diffusion_loss_prompt_tokens_are_never_targets():
    model = tiny()
    ps, rs = random_prompts(2), [[5, 6, 7], [8, 9, 10, 11, 12]]
    full = torch.ones(2, 8, dtype=torch.bool)  # ask for everything: only the real response tokens count
    _, n = diffusion_loss(model, batch_of(ps, rs), 4, MASK, EOS, complementary=False, masked=full)
    assert n == 4 + 8  # both responses padded to 4 and 8 tokens; no prompt, no padding beyond


def test_ar_loss_is_weighted_response_cross_entropy():
    model = tiny()
    p, r = random_prompts(1)[0], [5, 6, 7, 8]
    loss = ar_loss(model, {"prompt_ids": [p], "response_ids": [r], "n_reasoning": [2]}, lam_r=0.5, lam_o=1.0)
    logits = model(input_ids=torch.tensor([p + r])).logits[0, len(p) - 1:-1]
    ce = torch.nn.functional.cross_entropy(logits, torch.tensor(r), reduction="none")
    w = torch.tensor([0.5, 0.5, 1.0, 1.0])
    assert torch.allclose(loss, (w * ce).sum() / w.sum(), atol=1e-6)


def test_batches_cover_each_example_once_per_epoch_and_repeat_after_a_restart():
    n, size = 10, 3  # 3 batches an epoch; the 10th example waits for a later epoch
    epoch0 = [batch_indices(step, n, size, seed=1) for step in range(3)]
    seen = [i for b in epoch0 for i in b]
    assert all(len(b) == size for b in epoch0) and len(set(seen)) == 9
    assert [batch_indices(step, n, size, seed=1) for step in range(3)] == epoch0  # a resumed run sees the same
    assert batch_indices(3, n, size, seed=1) != epoch0[0]  # a new epoch, a new order
    assert batch_indices(0, n, size, seed=2) != epoch0[0]


def test_save_load_round_trips_logits(tmp_path):
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models
    model = tiny()
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>")))
    save_checkpoint(tmp_path / "ck", model, tok, {"stage": "test"})
    again, _, stage = load_checkpoint(tmp_path / "ck", attn="sdpa")
    assert stage["stage"] == "test" and not list(tmp_path.glob("*.tmp"))
    assert not list((tmp_path / "ck").glob("*.bin")) and list((tmp_path / "ck").glob("*.safetensors"))
    ids = torch.tensor([random_prompts(1)[0]])
    assert torch.equal(model(input_ids=ids).logits, again(input_ids=ids).logits)


def test_bf16_mixed_keeps_float32_weights_and_computes_in_bfloat16():
    from model import ar_logits, with_dtype
    model = tiny()
    prompts, responses = random_prompts(2), random_prompts(2, 6, 9, seed=3)
    exact = ar_logits(model, prompts, responses, PAD)
    mixed = with_dtype(model, "bf16-mixed")
    seen = []
    hook = mixed.model.layers[0].mlp.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    approx = ar_logits(mixed, prompts, responses, PAD)
    hook.remove()
    assert seen == [torch.bfloat16] and all(p.dtype == torch.float32 for p in mixed.parameters())
    assert approx.dtype == torch.float32 and 0 < (approx - exact).abs().max() < 0.1  # bf16 rounding, nothing worse


def test_dtype_auto_is_bf16_mixed_only_where_the_cpu_computes_bfloat16_natively(monkeypatch):
    from model import resolve_dtype, start
    assert resolve_dtype("float32") == "float32" and resolve_dtype("bfloat16", "cuda") == "bfloat16"  # explicit wins
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    assert resolve_dtype("auto", "cpu") == "float32"  # no native bfloat16: float32
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True, raising=False)
    assert resolve_dtype("auto", "cpu") == "bf16-mixed"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_dtype("auto", "cuda") == "float32"
    args = argparse.Namespace(dtype="auto", device="cpu", threads=0)
    start(args)  # every stage resolves before it prints its config and saves vars(args) in stage.json
    assert args.dtype == "bf16-mixed"


def test_the_qwen3_preset_has_the_shape_of_the_model_card():
    """Qwen/Qwen3-0.6B's card: 28 layers, 16 query / 8 KV heads, 0.44B parameters besides the embedding."""
    from transformers import AutoModelForCausalLM, Qwen3Config
    from model import PRESETS
    cfg = Qwen3Config(vocab_size=151936, tie_word_embeddings=True, **PRESETS["qwen3-0.6b"])
    with torch.device("meta"):  # the shape without the memory
        model = AutoModelForCausalLM.from_config(cfg)
    non_embedding = sum(p.numel() for p in model.parameters()) - 151936 * cfg.hidden_size
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (28, 16, 8)
    assert round(non_embedding / 1e9, 2) == 0.44


def test_a_resumed_log_drops_the_records_logged_after_its_checkpoint(tmp_path):
    import json
    from model import Log
    log = Log(tmp_path, 0)
    for step in range(6):  # an OPD/RL-style log: a record every step, the last checkpoint at step 3
        log(step=step, loss=float(step))
    with open(tmp_path / "log.jsonl", "a") as f:
        f.write('{"step": 6, "lo')  # the interruption cut the last record short
    Log(tmp_path, 3)(step=4, loss=-4.0)  # resumed at step 3: 4 and 5 are logged again by the resumed run
    records = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in records] == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 3.0), (4, -4.0)]
    Log(tmp_path, 0)
    assert not (tmp_path / "log.jsonl").exists()  # a run from step 0 starts a new log


@pytest.mark.parametrize("fresh", [False, True])
def test_a_stage_starts_without_the_results_of_an_earlier_run(tmp_path, fresh):
    from argparse import Namespace
    from model import setup
    out = tmp_path / "stage"
    (out / "last").mkdir(parents=True)
    for name in ("metrics.json", "predictions.jsonl", "predictions_tau0.9.jsonl", "log.jsonl", "model.safetensors"):
        (out / name).write_text("{}")
    setup(Namespace(out=str(out), fresh=fresh, threads=0, dtype="float32", device="cpu"))
    # metrics and answers describe a finished checkpoint: gone, so run.sh and the report cannot take them for this
    # run's; the log, the weights and (unless --fresh) OUT/last stay for resuming
    assert sorted(p.name for p in out.iterdir()) == sorted(["log.jsonl", "model.safetensors"] + ([] if fresh else ["last"]))
