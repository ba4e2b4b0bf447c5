"""
Qwen3 as an AR re-ranker and as a block-diffusion re-ranker: the method, in one module.

The model is a stock `Qwen3ForCausalLM`; nothing of it is copied or subclassed. What turns it into a
block-diffusion model is only (a) the attention mask we pass in, (b) the position ids, (c) a mask
token in the input and (d) the loss. Every line that differs from plain AR is tagged `# [diffusion]`.

Rows. A row is a sequence of segments, each token described by three integers (all (B, L) tensors):
    seg  PAD | PROMPT | CLEAN (a response token we can see) | NOISY + c (a token of noisy copy c)
    blk  the response block of the token: response offset // block_size (-1 for prompt and pad)
    pos  its RoPE position id: 0..P-1 for the prompt, P..P+R-1 for the response
One rule builds every mask we need from these (True = may attend):
    PROMPT key:  a prompt query sees earlier prompt tokens (causal); every response query sees the prompt
    CLEAN key:   a clean query sees clean blocks <= its own (its own block bidirectionally);
                 a noisy query sees clean blocks < its own                                   # [diffusion]
    NOISY key:   only noisy queries of the same copy and block (bidirectional inside a block)  # [diffusion]
With block_size = 1 the CLEAN rule is exactly causal attention: the AR model is the B = 1 case.

Training layout (BD3-LM / Fast-dLLM v2; the paper does not say, so this is an assumption):
    [ prompt (P) | x_t: noisy response | x_0: clean response (R) | pad ]
    positions [0..P-1 | P..P+R-1 | P..P+R-1]  -- duplicated, or RoPE silently breaks
x_t is padded with mask tokens to whole blocks, exactly as the decoder's last block looks before the end
token is committed; those padding positions are never scored. Several noisy copies can share one row,
[prompt | x_t | x_t' | x_0]: copies never see each other, so each gets exactly the logits it would get in a
row of its own, and the prompt and x_0 are computed once (CFT's complementary masks, OPD/RL's replay).
Token shift: the logit at position i-1 predicts token i, exactly as in the AR model. For response
token r at offset j of its block the logit is read at
    j > 0:  x_t position r-1 (same noisy block)
    j = 0:  x_0 position r-1 (the last token of the clean previous block), or the last prompt token
which is the same logit a KV-cached decoder uses (the prefill or the forward that committed block b-1).

Masked-diffusion loss (per block b a noise level t_b ~ U(t_min, t_max); each response token of the block is
masked with probability t_b; prompt and padding are never noised and never scored):
    L = sum_{masked i} w_i * c_i * CE(logits_src(i), x_i) / sum_{masked i} w_i
    w_i = lambda_r for reasoning tokens, lambda_o for answer tokens; c_i = 1/t_b with --inv-t, else 1
The AR loss is the same with every response token scored from position i-1 under causal attention.
"""
import math

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, Qwen3Config

from plumbing import DTYPES, compute, with_dtype

PAD, PROMPT, CLEAN, NOISY = 0, 1, 2, 3
# Random-init presets. 'tiny' (the default) is sized so the whole synthetic pipeline trains on 2 CPU cores;
# 'micro' only runs the mechanics in tests; 'qwen3-0.6b' has Qwen/Qwen3-0.6B's layer sizes with random weights
# (time and memory checks without a download).
PRESETS = {"tiny": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=6, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=32),
           "micro": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16),
           "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                              num_key_value_heads=8, head_dim=128)}


# ----------------------------------------------------------------------------- the model
def create_model(spec, tok, attn="sdpa", dtype="float32", seed=0):
    """An AR Qwen3 for `tok`: a preset name (random init from PRESETS), a hub id or a local folder.

    The embedding gets a row for every token of `tok` (SIDs and the mask token included), so the AR model and
    the converted block-diffusion model share one vocabulary. A hub Qwen3 has 267 spare rows and the SID codes
    need hundreds, so its embeddings (and LM head) are resized to the tokenizer's length.
    """
    torch.manual_seed(seed)
    if spec in PRESETS:
        cfg = Qwen3Config(vocab_size=64 * math.ceil(len(tok) / 64), pad_token_id=tok.pad_token_id,
                          eos_token_id=tok.eos_token_id, bos_token_id=None, max_position_embeddings=4096,
                          rope_theta=10000.0, tie_word_embeddings=True, rms_norm_eps=1e-6, **PRESETS[spec])
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=DTYPES[dtype])
    else:
        model = AutoModelForCausalLM.from_pretrained(spec, attn_implementation=attn, dtype=DTYPES[dtype], use_safetensors=True)
        if len(tok) > model.config.vocab_size:
            model.resize_token_embeddings(len(tok), pad_to_multiple_of=64)
    return with_dtype(model, dtype)


def init_mask_embedding(model, mask_id, n_real):  # [diffusion]
    """Set the mask token's input embedding to the mean of the real tokens' rows (it was never trained)."""
    emb = model.get_input_embeddings().weight
    with torch.no_grad():
        keep = torch.ones(n_real, dtype=torch.bool)
        keep[mask_id] = False
        emb[mask_id] = emb[:n_real][keep].mean(0)  # assumption: the mean embedding (METHOD.md's suggestion)


def without_mask(logits, mask_id):  # [diffusion]
    """The policy's logits: the mask token is an input symbol, never an output, so it gets no probability.
    Used wherever the policy's distribution is (sampling, replayed log-probs, the OPD KL). A finite fill, not
    -inf, keeps KL terms 0 * (min - min) = 0 instead of NaN where both sides exclude the token."""
    return logits.index_fill(-1, torch.tensor([mask_id], device=logits.device), torch.finfo(logits.dtype).min)


# ----------------------------------------------------------------------------- rows and masks
def attention_mask(q, k):
    """(B, 1, Q, K) bool mask, True = attend, from the (seg, blk, pos) descriptors of queries and keys."""
    sq, bq, pq = (t[:, :, None] for t in q)
    sk, bk, pk = (t[:, None, :] for t in k)
    see_prompt = (sk == PROMPT) & (((sq == PROMPT) & (pk <= pq)) | (sq == CLEAN) | (sq >= NOISY))
    see_clean = (sk == CLEAN) & (((sq == CLEAN) & (bk <= bq)) | ((sq >= NOISY) & (bk < bq)))  # [diffusion] blocks
    see_noisy = (sk >= NOISY) & (sk == sq) & (bk == bq)  # [diffusion] a block of a noisy copy sees itself only
    pad_self = (sq == PAD) & (sk == PAD)  # a pad query needs some key, or a kernel may return NaN
    return (see_prompt | see_clean | see_noisy | pad_self)[:, None]


def for_attention(mask, model):
    """sdpa takes the bool mask; eager *adds* the mask to the scores, so it needs 0 / dtype-min."""
    if model.config._attn_implementation == "eager":
        dtype = model.dtype
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
    return mask


def build_rows(prompts, responses, block, noisy=(), pad_id=0):
    """Right-padded rows [prompt | noisy copies | response | pad] and their descriptors.

    prompts, responses: lists of token-id lists. noisy: the noisy copies, each a list with one token-id list
    per row (noisy[c][i] is responses[i], partly masked, possibly padded to whole blocks); () for plain rows.
    Returns a dict of (B, L) tensors ids/seg/blk/pos and, per row, where its segments start:
    (P, (start of each copy), x_0's start).
    """
    rows, starts = [], []
    for i, (p, r) in enumerate(zip(prompts, responses)):
        P = len(p)
        ids, seg, blk, pos = list(p), [PROMPT] * P, [-1] * P, list(range(P))
        noisy_starts = []
        for c, copy in enumerate(noisy):  # [diffusion] x_t copies before x_0, same positions
            n = len(copy[i])
            noisy_starts.append(len(ids))
            ids += copy[i]; seg += [NOISY + c] * n; blk += [j // block for j in range(n)]; pos += list(range(P, P + n))
        clean_start = len(ids)
        ids += r; seg += [CLEAN] * len(r); blk += [j // block for j in range(len(r))]; pos += list(range(P, P + len(r)))
        rows.append((ids, seg, blk, pos))
        starts.append((P, tuple(noisy_starts), clean_start))
    L = max(len(r[0]) for r in rows)
    fill = (pad_id, PAD, -1, 0)
    out = {name: torch.tensor([r[j] + [fill[j]] * (L - len(r[j])) for r in rows])
           for j, name in enumerate(("ids", "seg", "blk", "pos"))}
    out["starts"] = starts
    return out


def target_sources(rows, lengths, block, copy=0):
    """For every response token, the column whose logit predicts it (token shift; see the docstring),
    reading noisy copy `copy` of a row that has noisy copies (copy=None: x_0's previous position, as in AR).

    Returns (B, Rmax) long columns and a (B, Rmax) bool mask of real tokens.
    """
    Rmax = max(lengths)
    src = torch.zeros(len(lengths), Rmax, dtype=torch.long)
    real = torch.zeros(len(lengths), Rmax, dtype=torch.bool)
    for i, ((P, noisy_starts, clean_start), R) in enumerate(zip(rows["starts"], lengths)):
        r = torch.arange(R)
        if not noisy_starts or copy is None:  # plain row: position i-1 predicts i
            col = clean_start + r - 1
        else:  # [diffusion] inside a block from x_t, at a block's first token from x_0's previous block
            col = torch.where(r % block != 0, noisy_starts[copy] + r - 1, clean_start + r - 1)
        col[0] = P - 1  # the first response token is predicted by the last prompt token
        src[i, :R], real[i, :R] = col, True
    return src, real


def hidden_states(model, rows):
    """Final hidden states (B, L, H) of a forward over `rows` with our mask and explicit positions.
    Rows are built on the CPU; they move to the model's device here."""
    desc = tuple(rows[k].to(model.device) for k in ("seg", "blk", "pos"))
    with compute(model):
        out = model.model(input_ids=rows["ids"].to(model.device), position_ids=desc[2],
                          attention_mask=for_attention(attention_mask(desc, desc), model))
    return out.last_hidden_state


def gather_logits(model, hidden, cols):
    """Logits (N, V) at hidden[b, col] for index tensors (b, col): the LM head only where it is needed."""
    with compute(model):
        return model.lm_head(hidden[cols[0].to(hidden.device), cols[1].to(hidden.device)]).float()


def token_weights(lengths, n_reasoning, lam_r, lam_o):
    """(B, Rmax) weight of each response token: lambda_r for reasoning, lambda_o for the answer."""
    w = torch.zeros(len(lengths), max(lengths))
    for i, (R, nr) in enumerate(zip(lengths, n_reasoning)):
        w[i, :nr], w[i, nr:R] = lam_r, lam_o
    return w


# ----------------------------------------------------------------------------- losses
def ar_logits(model, prompts, responses, pad_id=0):
    """Logits (N, V) predicting every response token under causal attention, in (row, position) order."""
    lengths = [len(r) for r in responses]
    rows = build_rows(prompts, responses, block=1, pad_id=pad_id)
    src, real = target_sources(rows, lengths, 1)
    b, j = real.nonzero(as_tuple=True)
    return gather_logits(model, hidden_states(model, rows), (b, src[b, j]))


def ar_loss(model, batch, lam_r=0.5, lam_o=1.0, pad_id=0):
    """Weighted causal-LM loss on the response only. batch: dict with prompt_ids, response_ids, n_reasoning."""
    prompts, responses = batch["prompt_ids"], batch["response_ids"]
    w = token_weights([len(r) for r in responses], batch["n_reasoning"], lam_r, lam_o)
    w = torch.cat([w[i, :len(r)] for i, r in enumerate(responses)]).to(model.device)  # (row, position) order
    targets = torch.tensor([t for r in responses for t in r], device=model.device)
    # assumption: the softmax runs over the whole vocabulary, the mask token included (it is never a target, so
    # training pushes it down; the diffusion policy leaves it out altogether, see without_mask)
    ce = F.cross_entropy(ar_logits(model, prompts, responses, pad_id), targets, reduction="none")
    return (w * ce).sum() / w.sum()


def sample_noise(lengths, block, t_range=(0.02, 0.98), generator=None):  # [diffusion]
    """(masked, t): which response tokens are masked and the noise level of each token's block, both (B, Rmax).
    One level per block, t_b ~ U(t_range); each real token of the block is masked with probability t_b."""
    Rmax = max(lengths)
    t = torch.rand(len(lengths), math.ceil(Rmax / block), generator=generator).repeat_interleave(block, 1)[:, :Rmax]
    t = t_range[0] + (t_range[1] - t_range[0]) * t
    real = torch.arange(Rmax)[None] < torch.tensor(lengths)[:, None]
    return (torch.rand(len(lengths), Rmax, generator=generator) < t) & real, t


def noisy_copy(response, masked_row, block, mask_id):  # [diffusion]
    """x_t: the response with its masked tokens replaced by the mask token, padded with masks to whole blocks."""
    x_t = [mask_id if m else tok for tok, m in zip(response, masked_row)]
    return x_t + [mask_id] * (-len(x_t) % block)


def diffusion_loss(model, batch, block, mask_id, lam_r=0.5, lam_o=1.0, t_range=(0.02, 0.98), inv_t=False,
                   complementary=True, masked=None, pad_id=0, generator=None):  # [diffusion]
    """Masked-diffusion loss of the module docstring on a batch (same dict as ar_loss).

    `masked` (B, Rmax) fixes the noise (tests); otherwise it is sampled. With complementary=True each response
    is also trained with the inverted mask, so every response token is a target once per pair; the two noisy
    copies share one row, [prompt | x_t | x_t' | x_0]. Returns (loss, number of scored tokens).
    """
    responses = batch["response_ids"]
    lengths = [len(r) for r in responses]
    if masked is None:
        masked, t = sample_noise(lengths, block, t_range, generator)
    else:
        t = torch.ones(masked.shape)
    real = torch.arange(masked.shape[1])[None] < torch.tensor(lengths)[:, None]
    copies = [(masked & real, t)]  # (which tokens are masked, their noise level)
    if complementary:
        copies.append((~masked & real, (1 - t).clamp_min(t_range[0])))
    noisy = [[noisy_copy(r, m[i].tolist(), block, mask_id) for i, r in enumerate(responses)] for m, _ in copies]
    rows = build_rows(batch["prompt_ids"], responses, block, noisy=noisy, pad_id=pad_id)
    w_all = token_weights(lengths, batch["n_reasoning"], lam_r, lam_o)
    b, col, j, w, lv = [], [], [], [], []  # per scored token: row, source column, response offset, weight, noise level
    for c, (m, level) in enumerate(copies):
        src, _ = target_sources(rows, lengths, block, copy=c)
        bc, jc = m.nonzero(as_tuple=True)
        b.append(bc); col.append(src[bc, jc]); j.append(jc); w.append(w_all[bc, jc]); lv.append(level[bc, jc])
    b, col, j, w, lv = (torch.cat(x) for x in (b, col, j, w, lv))
    if len(b) == 0:
        return torch.zeros((), requires_grad=True), 0
    logits = gather_logits(model, hidden_states(model, rows), (b, col))
    targets = torch.tensor([responses[bi][ji] for bi, ji in zip(b.tolist(), j.tolist())], device=logits.device)
    ce = F.cross_entropy(logits, targets, reduction="none")  # assumption: the mask token stays in the training softmax
    w, lv = w.to(logits.device), lv.to(logits.device)
    scale = w / lv if inv_t else w  # assumption: no 1/t weight (as Fast-dLLM v2); --inv-t turns it on
    # assumption: divide by the summed weight of the scored tokens, a weighted mean over them: with complementary
    # masks that is every response token once, with one copy the masked ones only; 1/t never enters the divisor
    return (scale * ce).sum() / w.sum(), len(b)


def token_kl(logits_teacher, logits_student, mask_id):  # [diffusion] OPD
    """Per-token KL(teacher || student) in float32, both distributions without the mask token. (N, V) -> (N,)."""
    logp_t = torch.log_softmax(without_mask(logits_teacher.float(), mask_id), -1)
    logp_s = torch.log_softmax(without_mask(logits_student.float(), mask_id), -1)
    return (logp_t.exp() * (logp_t - logp_s)).sum(-1)
