"""
Qwen3 as an AR re-ranker and as a block-diffusion re-ranker: the one module every stage imports.

The model is a stock `Qwen3ForCausalLM`; nothing of it is copied or subclassed. What turns it into a
block-diffusion model is only (a) the attention mask we pass in, (b) the position ids, (c) a mask
token in the input and (d) the loss. Every line that differs from plain AR is tagged `# [diffusion]`.

Rows. A row is a sequence of segments, each token described by three integers (all (B, L) tensors):
    seg  PAD | PROMPT | CLEAN (a response token we can see) | NOISY + c (a response token of noisy copy c)
    blk  the response block of the token: response offset // block_size (-1 for prompt and pad)
    pos  its RoPE position id: 0..P-1 for the prompt, P..P+R-1 for the response
One rule builds every mask we need from these (True = may attend):
    PROMPT key:  a prompt query sees earlier prompt tokens (causal); every response query sees the prompt
    CLEAN key:   a clean query sees clean blocks <= its own (so its own block, bidirectionally);
                 a noisy query sees clean blocks < its own                  # [diffusion]
                 (context "causal": a clean query sees clean tokens at positions <= its own, the AR
                 parent's attention; noisy blocks are unchanged. NBDiff's context-causal mask.)
    NOISY key:   only noisy queries of the same copy and block (bidirectional inside x_t's block)  # [diffusion]
With block_size = 1 the CLEAN rule is exactly causal attention: the AR model is the B = 1 case.
The context rule is a property of the converted model (config.diffusion_context, saved with it): training,
decoding and replay all read it from there, so a checkpoint is always run with the mask it was trained on.

Training layout (BD3-LM / Fast-dLLM v2; the paper does not say, so this is an assumption):
    [ prompt (P) | x_t: noisy response (R) | x_0: clean response (R) | pad ]
    positions [0..P-1 | P..P+R-1 | P..P+R-1]  -- duplicated, or RoPE silently breaks
Several noisy copies can share one row, [prompt | x_t | x_t' | x_0]: copies never see each other, so each
gets exactly the logits it would get in a row of its own, and the prompt and x_0 are computed once. CFT
puts a response's two complementary masks in one row this way (synthetic default: 825 tokens, not 2 x 601).
Token shift: the logit at position i-1 predicts token i, exactly as in the AR model. For response
token r at offset j of its block the logit is read at
    j > 0:  x_t position r-1 (same noisy block)
    j = 0:  x_0 position r-1 (the last token of the clean previous block), or the last prompt token
which is the same logit a KV-cached decoder uses (the prefill or the forward that committed block b-1).

Masked-diffusion loss (per block b a noise level t_b ~ U(t_min, t_max); each response token of the block is
masked with probability t_b; prompt and padding are never noised and never scored):
    L = sum_{masked i} w_i * c_i * CE(logits_src(i), x_i) / sum_{masked i} w_i
    w_i = lambda_r for reasoning tokens, lambda_o for answer tokens; c_i = 1/t_b when --inv-t
The AR loss is the same with every response token scored from position i-1 under causal attention.
"""
import argparse
import json
import math
import os
import shutil
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config

PAD, PROMPT, CLEAN, NOISY = 0, 1, 2, 3
# How clean response tokens (x_0, and the finished blocks in the decoder's cache) see each other.  # [diffusion]
CONTEXTS = {"block": "bidirectional inside each block (BD3-LM, Fast-dLLM v2)",
            "causal": "causal, exactly as the AR parent computed them (NBDiff's context-causal mask)"}
# Weight dtypes by name. "bf16-mixed" keeps float32 weights (and AdamW state) and runs every forward under
# bfloat16 autocast: the GPU choice for training, since pure bfloat16 weights round away any update smaller
# than about 1/256 of the weight (at lr 1e-6 most of them).
# "auto" (the flag's default) resolves to bf16-mixed where the hardware computes bfloat16 natively, else float32.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "bf16-mixed": torch.float32}
DTYPE_HELP = ("auto (bf16-mixed on a CUDA GPU with bfloat16 or a CPU with AVX512-BF16/AMX, else float32); float32; "
              "bf16-mixed (float32 weights, bfloat16 compute); bfloat16 (pure)")
# Random-init presets. 'tiny' is the default: sized so the whole synthetic pipeline trains on 2 CPU cores
# (1.3M parameters with the synthetic vocabulary); 'micro' only runs the mechanics in tests; 'qwen3-0.6b'
# has Qwen/Qwen3-0.6B's layer sizes (not its RoPE settings) with random weights: time and memory checks
# without a download (docs/gpu_preset.py).
PRESETS = {"tiny": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=6, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=32),
           "micro": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16),
           "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                              num_key_value_heads=8, head_dim=128)}


# ----------------------------------------------------------------------------- models and checkpoints
def compute(model):
    """The context every forward runs in: bfloat16 autocast for a model loaded as "bf16-mixed", else nothing."""
    return torch.autocast(model.device.type, dtype=torch.bfloat16, enabled=getattr(model, "bf16_mixed", False))


def resolve_dtype(dtype, device="cpu"):
    """A concrete DTYPES name for --dtype: "auto" becomes bf16-mixed where bfloat16 matmuls run natively. On a
    2-core AVX512-BF16 CPU that took 12-38% off a tiny-model training step (README, Results); a CPU without
    native bfloat16 (most laptops) keeps float32, the safe choice where bf16 would only be converted (not measured)."""
    if dtype != "auto":
        return dtype
    device = torch.device(device)
    if device.type == "cuda":
        native = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    elif device.type == "cpu":  # private but stable helpers (torch >= 2.3); absent ones count as "no"
        native = any(getattr(torch.cpu, f, lambda: False)() for f in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))
    else:
        native = False
    return "bf16-mixed" if native else "float32"


def with_dtype(model, dtype):
    model.bf16_mixed = dtype == "bf16-mixed"  # read by compute()
    return model


def create_model(spec, tok, attn="sdpa", dtype="float32", seed=0):
    """An AR Qwen3 for `tok`: a preset name (random init from PRESETS), a hub id or a local folder.

    The embedding gets a row for every token of `tok` (SIDs and the mask token included), so the
    AR model and the converted block-diffusion model share one vocabulary.
    """
    torch.manual_seed(seed)
    if spec in PRESETS:
        vocab = 64 * math.ceil(len(tok) / 64)
        cfg = Qwen3Config(vocab_size=vocab, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                          bos_token_id=None, max_position_embeddings=4096, rope_theta=10000.0,
                          tie_word_embeddings=True, rms_norm_eps=1e-6, **PRESETS[spec])
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
        emb[mask_id] = emb[:n_real][keep].mean(0)


def save_checkpoint(path, model, tok, stage, extra=None):
    """Save the HF way (safetensors + tokenizer) plus stage.json, into `path` (which may hold other files).

    Files are written to a temp folder and moved in one by one; stage.json goes last and marks the
    checkpoint complete, so an interrupted save never looks like a finished one.
    """
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    if extra is not None:  # training state for resuming: tensors and numbers only (loaded with weights_only)
        torch.save(extra, tmp / "trainer.pt")
    (tmp / "stage.json").write_text(json.dumps({**stage, "saved": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=2))
    path.mkdir(parents=True, exist_ok=True)
    (path / "stage.json").unlink(missing_ok=True)
    for f in sorted(tmp.iterdir(), key=lambda f: f.name == "stage.json"):
        os.replace(f, path / f.name)
    tmp.rmdir()


def load_checkpoint(path, attn="sdpa", dtype="float32", tok=None):
    """(model, tokenizer, stage dict) from a folder written by save_checkpoint; never unpickles code.
    `tok`: the run's tokenizer, already in memory, instead of parsing it again (Qwen3's takes ~2 s)."""
    path = Path(path)
    if not (path / "stage.json").exists():
        raise FileNotFoundError(f"{path}: not a checkpoint of this project (no stage.json)")
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn, dtype=DTYPES[dtype], use_safetensors=True)
    tok = AutoTokenizer.from_pretrained(path) if tok is None else tok
    return with_dtype(model, dtype), tok, json.loads((path / "stage.json").read_text())


def load_trainer_state(path):
    """The optimizer/step/rng state saved next to a checkpoint, or None."""
    f = Path(path) / "trainer.pt"
    return torch.load(f, weights_only=True) if f.exists() else None


def save_progress(out, model, tok, stage, optimizer, step, state):
    """OUT/last: the model so far plus what --resume needs (optimizer, step, the log's best score)."""
    save_checkpoint(Path(out) / "last", model, tok, stage, {"optimizer": optimizer.state_dict(), "step": step, **state})


def resume(out, model, optimizer):
    """(next step, saved state) from OUT/last, loading its weights and optimizer state; (0, {}) if none."""
    last = Path(out) / "last"
    state = load_trainer_state(last)
    if state is None:
        return 0, {}
    from safetensors.torch import load_file
    weights = {}
    for f in sorted(last.glob("*.safetensors")):
        weights.update(load_file(f))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:  # the tied head is stored once, as the embedding
        raise ValueError(f"{last} does not hold this model's weights (missing {sorted(missing)}, unexpected "
                         f"{sorted(unexpected)}): pass --fresh to start over, or another --out")
    optimizer.load_state_dict(state.pop("optimizer"))
    print(f"resuming from {last} at step {state['step']}")
    return state.pop("step"), state


def keep_best(out, model, tok, stage, opt, step, val, score, best, t0, **extra):
    """After an evaluation: the model becomes OUT's checkpoint when `score` beats `best`, and OUT/last is
    always refreshed (so an interruption loses at most eval_every steps). Returns the best score so far."""
    if score > best:
        best = score
        save_checkpoint(out, model, tok, {**stage, "step": step, "val": val})
    save_progress(out, model, tok, stage, opt, step, {"best": best, "elapsed": time.time() - t0, **extra})
    return best


def load_best(out, args, name, t0, tok):
    """The best checkpoint of a finished stage, on args.device, for its final test (training kept `tok`)."""
    model, tok, stage = load_checkpoint(out, args.attn, args.dtype, tok)
    print(f"{name} took {(time.time() - t0) / 60:.1f} min; testing the best checkpoint (step {stage['step']}) ...")
    return model.to(args.device), tok, stage


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """--help keeps the module docstring's layout and ends each flag's help with its default (unless None/False)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default is None or action.default is False or action.default is argparse.SUPPRESS or "%(default)" in text:
            return text
        return text + " (default: %(default)s)"


def add_common_args(ap, token_weights=True, **defaults):
    """The flags every training stage shares (each stage sets its own defaults). token_weights=False leaves out
    --lambda-r / --lambda-o (OPD's and RL's losses do not weight tokens); tau_n=None leaves out --tau-n (SFT)."""
    d = dict(steps=1000, batch_size=32, lr=1e-3, warmup=50, eval_every=100, val_n=200, tau_n=200) | defaults
    ap.add_argument("--data", default="data/synthetic", help="folder written by data.py")
    ap.add_argument("--steps", type=int, default=d["steps"], help="optimizer steps" + (" (0 = from --epochs)" if not d["steps"] else ""))
    if d["batch_size"]:  # OPD and RL count prompts per step instead
        ap.add_argument("--batch-size", type=int, default=d["batch_size"], help="examples per step")
    ap.add_argument("--lr", type=float, default=d["lr"], help="peak learning rate (warm-up, then cosine to 10%%)")
    ap.add_argument("--warmup", type=int, default=d["warmup"], help="warm-up steps")
    if token_weights:  # assumption: lambda_r = 0.5, lambda_o = 1.0 (the paper names the weights, not their values)
        ap.add_argument("--lambda-r", type=float, default=0.5, help="weight of reasoning tokens in the loss")
        ap.add_argument("--lambda-o", type=float, default=1.0, help="weight of answer tokens in the loss")
    ap.add_argument("--eval-every", type=int, default=d["eval_every"], help="validate and checkpoint every this many steps")
    ap.add_argument("--val-n", type=int, default=d["val_n"], help="validation examples decoded at each evaluation")
    ap.add_argument("--test-n", type=int, default=0, help="test examples for the final metrics (0 = all)")
    if d["tau_n"] is not None:
        ap.add_argument("--tau-n", type=int, default=d["tau_n"],
                        help="test examples for the extra thresholds 0.9/0.6/0.4 (0 = all; a subset keeps CPU runs short)")
    ap.add_argument("--eval-batch", type=int, default=64, help="decoding batch size")
    add_runtime_args(ap)
    ap.add_argument("--seed", type=int, default=0, help="seed for the init, the batch order and the noise")
    ap.add_argument("--fresh", action="store_true", help="ignore OUT/last and start over")


def add_runtime_args(ap):
    """Where and how a model runs (every stage and decode.py)."""
    ap.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"], help="attention implementation")
    ap.add_argument("--dtype", default="auto", choices=["auto", *DTYPES], help=DTYPE_HELP)
    ap.add_argument("--device", default="cpu", help="torch device")
    ap.add_argument("--threads", type=int, default=0, help="CPU threads for torch (0 = torch's default)")


def start(args):
    """Resolve --dtype auto, print the resolved config and set the CPU threads."""
    args.dtype = resolve_dtype(args.dtype, args.device)
    print("config:", json.dumps(vars(args)))
    if args.threads:
        torch.set_num_threads(args.threads)


def setup(args):
    """start(), then make OUT; returns OUT as a Path.

    A stage's metrics.json and predictions describe the checkpoint of a finished run; a run that may change
    the checkpoint starts without them, so an interrupted one is never taken for finished (run.sh skips a stage
    with metrics.json) and the report never pairs old answers with new weights. --fresh also drops OUT/last."""
    start(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for stale in [out / "metrics.json", *out.glob("predictions*.jsonl")]:
        stale.unlink(missing_ok=True)
    if args.fresh:
        shutil.rmtree(out / "last", ignore_errors=True)
    return out


class Log:
    """Appends one record per line to OUT/log.jsonl (the plots read it). A run that starts at step 0 starts a
    new file; a resumed one keeps the records up to its step and drops the later ones, which the interrupted
    run logged after its last checkpoint and the resumed run logs again."""

    def __init__(self, out, start):
        self.path = Path(out) / "log.jsonl"
        if start == 0:
            self.path.unlink(missing_ok=True)
        elif self.path.exists():
            lines = [line for line in self.path.read_text().splitlines() if Log.step_of(line) <= start]
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text("".join(line + "\n" for line in lines))
            os.replace(tmp, self.path)

    @staticmethod
    def step_of(line):
        """A record's step; infinity for a line cut short by the interruption, so that it is dropped too."""
        try:
            return json.loads(line).get("step", 0)
        except json.JSONDecodeError:
            return float("inf")

    def __call__(self, **rec):
        if torch.cuda.is_available():  # the number a GPU user sizes --batch-size / --rows by
            rec["peak_gpu_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        return rec


def lr_at(step, total, peak, warmup):
    """Linear warm-up, then cosine decay to 10% of the peak (assumption: one schedule for every
    stage; the paper gives OPD a constant lr and does not say for the others)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def batch_indices(step, n, batch_size, seed):
    """The example indices of training step `step`: seeded epochs, so a resumed run sees the same batches. Stages
    with the same --seed walk the same order (RL's prompts are the first ones OPD distilled on)."""
    per_epoch = max(1, n // batch_size)
    epoch, k = divmod(step, per_epoch)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100003 + epoch))
    return perm[k * batch_size:(k + 1) * batch_size].tolist()


def collate(examples):
    """The batch dict the losses take: the columns they need, as lists."""
    return {k: [ex[k] for ex in examples] for k in ("prompt_ids", "response_ids", "n_reasoning")}


# ----------------------------------------------------------------------------- rows and masks
def context_of(model):  # [diffusion]
    """The context rule (CONTEXTS) of a model or of its config; an AR model or an older checkpoint: "block"."""
    return getattr(getattr(model, "config", model), "diffusion_context", "block")


def attention_mask(q, k, context="block"):
    """(B, 1, Q, K) bool mask, True = attend, from the (seg, blk, pos) descriptors of queries and keys."""
    sq, bq, pq = (t[:, :, None] for t in q)
    sk, bk, pk = (t[:, None, :] for t in k)
    see_prompt = (sk == PROMPT) & (((sq == PROMPT) & (pk <= pq)) | (sq == CLEAN) | (sq >= NOISY))  # [diffusion] noisy too
    clean_to_clean = (pk <= pq) if context == "causal" else (bk <= bq)  # [diffusion] CONTEXTS
    see_clean = (sk == CLEAN) & (((sq == CLEAN) & clean_to_clean) | ((sq >= NOISY) & (bk < bq)))  # [diffusion] blocks
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

    prompts, responses: lists of token-id lists. noisy: the noisy copies, each a list with one token-id
    list per row (noisy[c][i] has len(responses[i])); () for plain rows. Returns a dict of (B, L) tensors
    ids/seg/blk/pos and per row the columns where the segments start: (P, (start of each copy), x_0's start).
    """
    rows, starts = [], []
    for i, (p, r) in enumerate(zip(prompts, responses)):
        P, R = len(p), len(r)
        rblk = [j // block for j in range(R)]
        ids, seg, blk, pos = list(p), [PROMPT] * P, [-1] * P, list(range(P))
        noisy_starts = []
        for c, copy in enumerate(noisy):  # [diffusion] x_t copies before x_0, same positions
            noisy_starts.append(len(ids))
            ids += copy[i]; seg += [NOISY + c] * R; blk += rblk; pos += list(range(P, P + R))
        clean_start = len(ids)
        ids += r; seg += [CLEAN] * R; blk += rblk; pos += list(range(P, P + R))
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

    Rows are built on the CPU; they move to the model's device here, at the model's door.
    """
    desc = tuple(rows[k].to(model.device) for k in ("seg", "blk", "pos"))
    mask = attention_mask(desc, desc, context_of(model))
    with compute(model):
        out = model.model(input_ids=rows["ids"].to(model.device), attention_mask=for_attention(mask, model),
                          position_ids=desc[2])
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
def ar_loss(model, batch, lam_r=0.5, lam_o=1.0, pad_id=0):
    """Weighted causal-LM loss on the response only. batch: dict with prompt_ids, response_ids, n_reasoning."""
    prompts, responses = batch["prompt_ids"], batch["response_ids"]
    w = token_weights([len(r) for r in responses], batch["n_reasoning"], lam_r, lam_o)
    w = torch.cat([w[i, :len(r)] for i, r in enumerate(responses)]).to(model.device)  # (row, position) order
    targets = torch.tensor([t for r in responses for t in r], device=model.device)
    ce = F.cross_entropy(ar_logits(model, prompts, responses, pad_id), targets, reduction="none")
    return (w * ce).sum() / w.sum()


def pad_to_block(response, block, eos_id):  # [diffusion]
    """A response padded with eos to a whole number of blocks (the model learns to fill the tail)."""
    return list(response) + [eos_id] * (-len(response) % block)


def suffix_mask(t, block):  # [diffusion]
    """(B, R) mask of the last round(t * block) positions of every block (at least one): t is (B, R), constant per block."""
    k = (t * block).round().clamp(1, block)
    return torch.arange(t.shape[1])[None] % block >= block - k


def sample_noise(lengths, block, t_range=(1e-3, 1.0), per="block", generator=None, shape="random",
                 suffix_frac=0.5):  # [diffusion]
    """(masked, t, suffix): which response tokens are masked, the noise level t ~ U(t_range) of each token's
    block/row, and which tokens lie in a suffix-shaped block (all (B, R)).

    shape "random" masks each token with probability t; "suffix" masks the last t * block positions of each
    block: the only canvases the prefix commit rules of decode.py ever show the model; "mixed" makes each
    block suffix-shaped with probability `suffix_frac` and random otherwise."""
    Rmax = max(lengths)
    nblk = math.ceil(Rmax / block)
    per_block = lambda x: x.repeat_interleave(block, 1)[:, :Rmax]  # (B, nblk) -> (B, Rmax)
    if per == "block":
        t = per_block(torch.rand(len(lengths), nblk, generator=generator))
    else:  # one level for the whole response
        t = torch.rand(len(lengths), 1, generator=generator).expand(len(lengths), Rmax)
    t = t_range[0] + (t_range[1] - t_range[0]) * t
    if shape == "suffix":
        masked, suffix = suffix_mask(t, block), torch.ones(len(lengths), Rmax, dtype=torch.bool)
    else:
        masked = torch.rand(len(lengths), Rmax, generator=generator) < t
        suffix = torch.zeros(len(lengths), Rmax, dtype=torch.bool)
    if shape == "mixed":  # a coin per block, drawn after the random masks (so suffix_frac 0 is exactly "random")
        suffix = per_block(torch.rand(len(lengths), nblk, generator=generator) < suffix_frac)
        masked = torch.where(suffix, suffix_mask(t, block), masked)
    real = torch.arange(Rmax)[None] < torch.tensor(lengths)[:, None]
    return masked & real, t, suffix


def diffusion_loss(model, batch, block, mask_id, eos_id, lam_r=0.5, lam_o=1.0, t_range=(1e-3, 1.0), noise_per="block",
                   inv_t=False, complementary=True, masked=None, pad_id=0, generator=None, noise_shape="random",
                   ar_weight=0.0, suffix_frac=0.5):  # [diffusion]
    """Masked-diffusion loss of the module docstring on a batch (same dict as ar_loss), plus ar_weight x the AR loss.

    `masked` (B, Rmax) fixes the noise (tests; its blocks count as suffixes only for noise_shape "suffix");
    otherwise it is sampled (`noise_shape`, `suffix_frac`: sample_noise).
    With complementary=True each response is also trained with the inverted mask, so every response token is a
    target once per pair; a suffix-shaped block's second copy masks the suffix of the other length, (1 - t) * block.
    The two noisy copies share one row, [prompt | x_t | x_t' | x_0] (module docstring): the same loss as one
    row per copy, with the prompt and x_0 computed once. Returns (loss, number of scored tokens).
    ar_weight > 0 (NBDiff's AR guidance) adds ar_loss, read from the same forward: under the causal context
    (CONTEXTS) x_0 is computed exactly as the AR model computes the response, so its logits are the AR ones.
    """
    if ar_weight and context_of(model) != "causal":
        raise ValueError("ar_weight > 0 needs the causal context: under 'block' each x_0 token sees its whole block, "
                         "so x_0's logits are not next-token predictions")
    responses = [pad_to_block(r, block, eos_id) for r in batch["response_ids"]]
    lengths = [len(r) for r in responses]
    if masked is None:
        masked, t, suffix = sample_noise(lengths, block, t_range, noise_per, generator, noise_shape, suffix_frac)
    else:
        t, suffix = torch.ones(masked.shape), torch.full(masked.shape, noise_shape == "suffix")
    real = torch.arange(masked.shape[1])[None] < torch.tensor(lengths)[:, None]
    copies = [(masked & real, t)]  # (which tokens are masked, their noise level); prompt and padding never are
    if complementary:
        t2 = (1 - t).clamp_min(t_range[0])
        other = torch.where(suffix, suffix_mask(t2, block), ~masked)  # a suffix stays a suffix
        copies.append((other & real, t2))
    noisy = [[[mask_id if m[i, j] else tok for j, tok in enumerate(r)] for i, r in enumerate(responses)] for m, _ in copies]
    rows = build_rows(batch["prompt_ids"], responses, block, noisy=noisy, pad_id=pad_id)
    w_all = token_weights(lengths, batch["n_reasoning"], lam_r, lam_o)
    b, col, j, w, t = [], [], [], [], []  # per scored token: row, source column, response offset, weight, noise level
    for c, (m, level) in enumerate(copies):
        src, _ = target_sources(rows, lengths, block, copy=c)
        bc, jc = m.nonzero(as_tuple=True)
        b.append(bc); col.append(src[bc, jc]); j.append(jc); w.append(w_all[bc, jc]); t.append(level[bc, jc])
    b, col, j, w, t = (torch.cat(x) for x in (b, col, j, w, t))
    if len(b) == 0:
        return torch.zeros((), requires_grad=True), 0
    hidden = hidden_states(model, rows)
    logits = gather_logits(model, hidden, (b, col))
    targets = torch.tensor([responses[bi][ji] for bi, ji in zip(b.tolist(), j.tolist())], device=logits.device)
    ce = F.cross_entropy(logits, targets, reduction="none")
    w, t = w.to(logits.device), t.to(logits.device)
    scale = w / t if inv_t else w  # assumption: no 1/t weight by default (as Fast-dLLM v2)
    loss = (scale * ce).sum() / w.sum()
    if ar_weight:  # the response as the AR parent saw it (no eos padding), each token from x_0's previous position
        true_lengths = [len(r) for r in batch["response_ids"]]
        src, real = target_sources(rows, true_lengths, block, copy=None)
        ab, aj = real.nonzero(as_tuple=True)
        ar_targets = torch.tensor([responses[bi][ji] for bi, ji in zip(ab.tolist(), aj.tolist())], device=logits.device)
        ar_ce = F.cross_entropy(gather_logits(model, hidden, (ab, src[ab, aj])), ar_targets, reduction="none")
        ar_w = token_weights(true_lengths, batch["n_reasoning"], lam_r, lam_o)[ab, aj].to(logits.device)
        loss = loss + ar_weight * (ar_w * ar_ce).sum() / ar_w.sum()
    return loss, len(b)


def token_kl(logp_teacher, logits_student, reverse=False):  # [diffusion] OPD
    """Per-token KL in float32 from log-probabilities: KL(teacher || student) or, reverse, KL(student || teacher).

    logp_teacher: (N, V) log-softmax of the teacher; logits_student: (N, V) raw student logits.
    """
    logp_s = torch.log_softmax(logits_student.float(), -1)
    logp_t = logp_teacher.float()
    if reverse:
        return (logp_s.exp() * (logp_s - logp_t)).sum(-1)
    return (logp_t.exp() * (logp_t - logp_s)).sum(-1)


def ar_logits(model, prompts, responses, pad_id=0):
    """Logits (N, V) predicting every response token under causal attention, in (row, position) order."""
    lengths = [len(r) for r in responses]
    rows = build_rows(prompts, responses, block=1, pad_id=pad_id)
    src, real = target_sources(rows, lengths, 1)
    b, j = real.nonzero(as_tuple=True)
    return gather_logits(model, hidden_states(model, rows), (b, src[b, j]))
