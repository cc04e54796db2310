#!/usr/bin/env python3
"""Train the Deltafin demo model (Kimi K3's architecture at toy scale, tools/demo/k3_torch.py) from scratch.

    PY=.venv-demo/bin/python
    $PY tools/demo/train.py --dry-run                          # parameter counts and projected sizes
    $PY tools/demo/train.py --smoke                            # tiny model on CPU: loop, resume, init-from, time box
    $PY tools/demo/train.py --bench-steps 10                   # tokens/s at the given --batch/--seq, nothing saved
    $PY tools/demo/train.py --data target/demo/tokenizer --out /tmp/run --compact $OUT/compact \\
        --total-steps 3000 --minutes 9                         # a first time-boxed piece
    $PY tools/demo/train.py ... --resume /tmp/run --minutes 9  # the next piece, same machine (full checkpoint)
    $PY tools/demo/train.py ... --init-from ckpt/compact       # a later session, from the compact weights only
    $PY tools/demo/train.py --data D --out /tmp/ft --init-hf models/k3-demo/hf --chat-data D --chat-frac 0.4 \
        --total-steps 400 --lr 6e-4 --warmup 40 ...            # a fine-tune of the bundle: a new schedule

Training: CUDA with bf16 autocast (the router and the KDA recurrence run in float32 inside the model), chunked KDA,
AdamW (fused on CUDA) with decoupled weight decay on matrices only, linear warm-up then cosine to --min-lr-ratio of
the peak at --total-steps, gradient clipping at 1.0, batches of random windows of the token stream (the windows of
optimizer step s are a function of (seed, s) alone, so the data position is the step count), and after every
optimizer step the auxiliary-loss-free router-bias update (K3ForCausalLM.update_router_bias, no auxiliary loss)
with u decaying linearly from --bias-u-start 1e-2 to --bias-u 1e-3 over the run (see bias_u_at). On CUDA the routed
experts run as three batched matmuls over all experts (--moe-impl bmm, checked against k3_torch's per-expert loop in
--smoke; ~9k instead of ~34k ops per forward + backward of the demo model). --qat-from S trains the routed experts
through MXFP4 fake quantisation from step S on (off by default), so the export's MXFP4 experts are what was trained.

Checkpoints:
  full     OUT/ckpt-SSSSSSS.pt: f32 weights and router biases, AdamW moments, step, tokens, RNG states, the loss
           log and the run's hyperparameters. --resume FILE|DIR continues exactly (the same losses on CPU).
  compact  --compact DIR: the weights in bf16 (the few tensors the release keeps in f32 stay f32: A_log, dt_bias,
           conv taps, o_norm, router biases), named as in the Hugging Face checkpoint, in at most 3 safetensors files
           of at most 15 MiB, plus config.json, state.json (step, tokens, hyperparameters) and loss.jsonl.
           --init-from DIR restarts at the same step with fresh AdamW moments and a short LR re-warm-up.
           6 files (about 38 MiB for demo_config.json): within what a device run hands back from $OUT.
Both are written at --save-every steps, when --minutes runs out and at --total-steps. Keep --out on the machine's
local disk (a full checkpoint of the demo model is ~240 MB) and point --compact into $OUT.

--minutes M counts from the start of the process: before each step the script checks that the step, any validation
due and the final validation + checkpoints (times measured as the run goes) fit before M minutes, else it stops
there, validates, saves both checkpoints and exits 0.

Log: one line per --log-every steps on stdout (step, tokens, train loss, lr, max grad norm, tokens/s, and the
expert loads summed over the window: the worst layer's max/min ratio (min counted as at least 1) and max/mean
ratio (top-k of E caps it at E/k), and how many (layer, expert) pairs got no token; peak GPU memory) and the same
as JSON lines in OUT/loss.jsonl (copied into the compact folder); validation loss on a fixed set of windows of
valid.bin every --eval-every steps and at the end.

Token files: uint16 ids, documents as [BOS] + tokens back to back (tools/demo/tokenizer.py); NAME.bin.gz is read
too when NAME.bin is absent.

Fine-tuning: --init-hf DIR starts a new schedule (step 0, fresh AdamW moments, --total-steps of its own) from the
weights of a Hugging Face export (the bundle's bf16 spine, its MXFP4 experts dequantised). --chat-data DIR adds the
chat set of tools/demo/chat_data.py (chat-train.bin + chat-train.idx.npy, chat-valid.*): --chat-frac of each
batch's windows start at a conversation's first token, the rest are plain-text windows as above; validation then
reports the chat loss (windows from the held-out conversations' starts) beside the plain one. Both are saved with
the run, so --resume continues a fine-tune exactly.
"""

import time

T0 = time.time()  # --minutes counts from here

import argparse  # noqa: E402
import copy  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import types  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))
import k3_torch as k3  # noqa: E402

COMPACT_FILE_LIMIT = 15 * 2**20  # bytes per compact shard
COMPACT_MAX_FILES = 3

# Hyperparameters that define the run (the LR schedule, the data order, the optimizer). A fresh run takes them from
# the command line or these defaults; --resume / --init-from take them from the checkpoint unless a flag is given.
SCHEDULE_DEFAULTS = dict(
    seed=1234, seq=512, batch=64, lr=2e-3, min_lr_ratio=0.1, warmup=100, total_steps=None, weight_decay=0.1,
    beta1=0.9, beta2=0.95, grad_clip=1.0, bias_u=1e-3, bias_u_start=1e-2, bias_u_decay=None, rewarmup=50,
    qat_from=None, chat_frac=0.0,
)


def log(msg: str) -> None:
    print(msg, flush=True)


# ----------------------------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------------------------


def load_config(path) -> k3.K3Config:
    return k3.K3Config.from_dict(json.loads(Path(path).read_text()))


def smoke_config() -> k3.K3Config:
    """A tiny K3: 4 layers (KDA 1-3, MLA 4), dense first layer, 8 experts top-2, 2 attention-residual blocks."""
    d = json.loads((HERE / "demo_config.json").read_text())["text_config"]
    d.update(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2, intermediate_size=128,
        q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        num_experts=8, num_experts_per_token=2, moe_intermediate_size=32, routed_expert_hidden_size=32,
        attn_res_block_size=2,
    )
    d["linear_attn_config"] = dict(d["linear_attn_config"], kda_layers=[1, 2, 3], full_attn_layers=[4],
                                   num_heads=2, head_dim=32)
    return k3.K3Config.from_dict(d)


@torch.no_grad()
def demo_init(model: k3.K3ForCausalLM, seed: int) -> None:
    """On top of k3.init_weights: KDA dt_bias as flash-linear-attention's KDA layer initialises it (inverse softplus
    of dt ~ log-uniform [1e-3, 1e-1]), so the channels start with a spread of slow decays instead of all forgetting
    ~92% per token (dt_bias = 0 with gate_lower_bound -5 gives log g = -2.5 everywhere); and the attention-residual
    pseudo-queries (*_res_proj) at zero, so every residual mix starts as a uniform average (the AttnRes paper's
    initialisation)."""
    g = torch.Generator().manual_seed(seed + 1)
    for name, p in model.named_parameters():
        if name.endswith("dt_bias"):
            dt = torch.exp(torch.rand(p.shape, generator=g) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
            dt = dt.clamp_min(1e-4)
            p.copy_(dt + torch.log(-torch.expm1(-dt)))
        elif name.endswith("_res_proj.weight"):
            p.zero_()


def build_model(cfg: k3.K3Config, seed: int, moe_impl: str) -> k3.K3ForCausalLM:
    torch.manual_seed(seed)
    model = k3.K3ForCausalLM(cfg)
    k3.init_weights(model, seed=seed)
    demo_init(model, seed)
    model.set_kda_mode("chunk")
    if moe_impl == "bmm":
        for m in model.moe_layers().values():
            m.forward = types.MethodType(moe_forward_bmm, m)
    return model


def moe_forward_bmm(self: k3.LatentMoE, x: torch.Tensor) -> torch.Tensor:
    """k3.LatentMoE.forward with the per-expert Python loop replaced by three batched matmuls over all experts: the
    (token, slot) pairs, sorted by expert as in the original, are laid out [E, C, LAT] (C = the busiest expert's
    count, unused rows zero), each expert's weights stacked [E, I, LAT]. The same products, the same float32
    SiTU, the same weighted index_add in the same order; on the GPU about 10 kernels a layer instead of ~20 per
    expert. The router, expert_load and last_topk are exactly as in the original. (Checked against it in --smoke.)"""
    cfg = self.cfg
    B, T, Hd = x.shape
    E = cfg.num_experts
    xf = x.reshape(B * T, Hd)  # [N, H]
    with k3._no_autocast(x.device):
        logits = F.linear(k3.f32(xf), k3.f32(self.gate.weight))  # [N, E]
        idx, w = k3.select_experts(
            logits, self.gate.e_score_correction_bias, cfg.num_experts_per_token, cfg.num_expert_group,
            cfg.topk_group, cfg.routed_scaling_factor, cfg.moe_renormalize,
        )  # [N, k], [N, k]
    k = idx.shape[-1]
    self.last_topk = idx.detach().view(B, T, k)
    if self.training:
        with torch.no_grad():
            self.expert_load += torch.bincount(idx.flatten(), minlength=E).to(self.expert_load)

    y = self.routed_expert_down_proj(xf) if self.latent is not None else xf  # [N, LAT]
    flat = idx.flatten()  # [N*k]
    order = torch.argsort(flat, stable=True)  # [N*k]
    e_sorted = flat[order]  # [N*k] expert of each sorted pair
    tok = order // k  # [N*k] its token
    wts = w.flatten()[order]  # [N*k]
    counts = torch.bincount(flat, minlength=E)  # [E]
    starts = torch.cumsum(counts, 0) - counts  # [E]
    pos = torch.arange(flat.numel(), device=x.device) - starts[e_sorted]  # [N*k] row within its expert
    C = int(counts.max())  # one host sync (the original has one too)
    X = y.new_zeros(E, C, y.shape[-1]).index_put((e_sorted, pos), y[tok])  # [E, C, LAT]
    W1 = torch.stack([ex.w1.weight for ex in self.experts])  # [E, I, LAT] gate
    W3 = torch.stack([ex.w3.weight for ex in self.experts])  # [E, I, LAT] up
    W2 = torch.stack([ex.w2.weight for ex in self.experts])  # [E, LAT, I] down
    if getattr(self, "qat", False):
        W1, W3, W2 = fake_mxfp4(W1), fake_mxfp4(W3), fake_mxfp4(W2)
    h = k3.situ(torch.bmm(X, W3.transpose(1, 2)), torch.bmm(X, W1.transpose(1, 2)), cfg.situ_beta,
                cfg.activation_situ_linear_beta)  # [E, C, I]
    he = torch.bmm(h, W2.transpose(1, 2))  # [E, C, LAT]
    hs = he[e_sorted, pos]  # [N*k, LAT] back in sorted pair order
    out = torch.zeros(xf.shape[0], y.shape[-1], dtype=wts.dtype, device=x.device)  # [N, LAT] f32
    out.index_add_(0, tok, k3.f32(hs) * wts[:, None])
    out = out.to(y.dtype)
    if getattr(self, "routed_expert_norm", None) is not None:
        out = self.routed_expert_norm(out)
    if self.latent is not None:
        out = self.routed_expert_up_proj(out)  # [N, H]
    if cfg.num_shared_experts:
        out = out + self.shared_experts(xf)
    return out.reshape(B, T, Hd)


def fake_mxfp4(w: torch.Tensor) -> torch.Tensor:
    """Quantisation-aware training of the routed experts: the forward sees the weights as the export will store
    them (k3.mxfp4_quantize per row of each expert matrix, groups of 32 along the input dimension, as hf_state_dict
    does), the backward passes the gradient straight through to the float weights."""
    E, R, C = w.shape
    dq = k3.mxfp4_dequantize(*k3.mxfp4_quantize(w.reshape(E * R, C))).reshape(E, R, C).to(w.dtype)
    return w + (dq - w).detach()


def set_qat(model: k3.K3ForCausalLM, on: bool) -> None:
    for m in model.moe_layers().values():
        m.qat = on


def is_expert(name: str) -> bool:
    return ".experts." in name


def param_counts(model: k3.K3ForCausalLM) -> dict:
    cfg = model.cfg
    total = experts = embed = 0
    for name, p in model.named_parameters():
        total += p.numel()
        if is_expert(name):
            experts += p.numel()
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            embed += p.numel()
    spine = total - experts
    active = spine + experts * cfg.num_experts_per_token // cfg.num_experts
    return dict(total=total, experts=experts, spine=spine, embeddings=embed, active=active,
                active_no_embed=active - model.language_model.model.embed_tokens.weight.numel())


def projected_sizes(model: k3.K3ForCausalLM) -> dict:
    """Bytes of: the compact checkpoint (bf16, release-f32 tensors f32), the Hugging Face export (bf16 spine, MXFP4
    experts: 0.5 byte per weight + 1 scale byte per 32), and an estimate of a Deltafin store (int8 spine matrices
    with one f32 scale per row, f32 vectors, the same MXFP4 expert records)."""
    compact = hf = store = 0
    for name, t in model.state_dict().items():
        n = t.numel()
        f32_kind = name.endswith(k3._F32_SUFFIXES)
        compact += n * (4 if f32_kind else 2)
        if is_expert(name):
            mx = n // 2 + n // k3.MXFP4_GROUP
            hf += mx
            store += mx
        else:
            hf += n * (4 if f32_kind else 2)
            store += n + 4 * t.shape[0] if (t.ndim == 2 and not f32_kind) else 4 * n
    return dict(compact=compact, hf=hf, store=store)


def mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB ({n / 2**20:.1f} MiB)"


def describe(model: k3.K3ForCausalLM) -> None:
    cfg = model.cfg
    c = param_counts(model)
    s = projected_sizes(model)
    lac = cfg.linear_attn_config
    kinds = "".join("K" if cfg.is_kda(i) else "M" for i in range(cfg.num_hidden_layers))
    log(f"model: {cfg.num_hidden_layers} layers {kinds} (K = KDA, M = NoPE MLA), hidden {cfg.hidden_size}, "
        f"vocab {cfg.vocab_size}, KDA {lac['num_heads']}x{lac['head_dim']}, MLA {cfg.num_attention_heads} heads, "
        f"{len(model.moe_layers())} MoE layers x {cfg.num_experts} experts top-{cfg.num_experts_per_token} "
        f"(latent {cfg.routed_expert_hidden_size}, expert width {cfg.moe_intermediate_size}, "
        f"{cfg.num_shared_experts} shared), attention-residual blocks of {cfg.attn_res_block_size}")
    log(f"params: total {c['total']:,}  experts {c['experts']:,}  spine {c['spine']:,} "
        f"(of which embeddings + head {c['embeddings']:,})")
    log(f"params active per token: {c['active']:,} ({c['active_no_embed']:,} without the input embedding)")
    log(f"projected sizes: compact checkpoint {mb(s['compact'])}; Hugging Face export (bf16 spine + MXFP4 experts) "
        f"{mb(s['hf'])}; Deltafin store (int8 spine + MXFP4 experts) ~{mb(s['store'])}")
    if s["compact"] > COMPACT_FILE_LIMIT * COMPACT_MAX_FILES * 0.98:
        log(f"WARNING: the compact checkpoint will not fit {COMPACT_MAX_FILES} files of "
            f"{COMPACT_FILE_LIMIT / 2**20:.0f} MiB")


# ----------------------------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------------------------


class Tokens:
    """A uint16 token file (or the same gzipped, NAME.bin.gz, read into memory: token files compress about 3x,
    which helps them travel). Training batches: windows of seq + 1 tokens at offsets drawn by
    numpy.random.default_rng([seed, step]); validation: fixed windows spread evenly over the file."""

    def __init__(self, path: Path):
        gz = path.with_name(path.name + ".gz")
        if path.exists():
            self.path, self.ids = path, np.memmap(path, dtype=np.uint16, mode="r")
        elif gz.exists():
            import gzip

            self.path, self.ids = gz, np.frombuffer(gzip.decompress(gz.read_bytes()), dtype=np.uint16)
        else:
            raise SystemExit(f"no {path} (or {gz.name})")

    def __len__(self) -> int:
        return len(self.ids)

    def train_batch(self, seed: int, step: int, batch: int, seq: int) -> torch.Tensor:
        rng = np.random.default_rng([seed, step])
        offs = rng.integers(0, len(self.ids) - seq - 1, size=batch)
        return torch.from_numpy(np.stack([self.ids[o : o + seq + 1] for o in offs]).astype(np.int64))  # [B, seq+1]

    def eval_windows(self, n: int, seq: int) -> torch.Tensor:
        fit = (len(self.ids) - 1) // (seq + 1)
        n = max(1, min(n, fit))
        offs = np.linspace(0, len(self.ids) - seq - 1, n).astype(np.int64)
        return torch.from_numpy(np.stack([self.ids[o : o + seq + 1] for o in offs]).astype(np.int64))  # [n, seq+1]


class ChatTokens(Tokens):
    """tools/demo/chat_data.py's conversations (NAME.bin, back to back) and where each starts (NAME.idx.npy): windows
    start at a conversation's first token, so every window holds at least one whole turn from its beginning."""

    def __init__(self, path: Path):
        super().__init__(path)
        starts = np.load(path.with_name(path.name.replace(".bin", ".idx.npy")))
        self.starts = starts

    def usable(self, seq: int) -> np.ndarray:
        ok = self.starts[self.starts + seq + 1 <= len(self.ids)]
        if len(ok) == 0:
            raise SystemExit(f"{self.path}: no conversation start leaves a window of {seq + 1} tokens")
        return ok

    def train_batch(self, seed: int, step: int, batch: int, seq: int) -> torch.Tensor:
        rng = np.random.default_rng([seed, step, 1])
        offs = rng.choice(self.usable(seq), size=batch)
        return torch.from_numpy(np.stack([self.ids[o : o + seq + 1] for o in offs]).astype(np.int64))  # [B, seq+1]

    def eval_windows(self, n: int, seq: int) -> torch.Tensor:
        ok = self.usable(seq)
        offs = ok[np.linspace(0, len(ok) - 1, min(n, len(ok))).astype(np.int64)]
        return torch.from_numpy(np.stack([self.ids[o : o + seq + 1] for o in offs]).astype(np.int64))  # [n, seq+1]


def make_synthetic_tokens(path: Path, n: int, vocab_lo: int, bos: int, seed: int = 0) -> None:
    """A learnable stand-in for train.bin/valid.bin: documents of [BOS] + a noisy arithmetic walk over 512 ids."""
    rng = np.random.default_rng(seed)
    out, total = [], 0
    while total < n:
        L = int(rng.integers(50, 400))
        a, b = int(rng.integers(1, 7)), int(rng.integers(0, 512))
        x = np.empty(L, dtype=np.int64)
        x[0] = rng.integers(0, 512)
        noise = rng.random(L) < 0.1
        rnd = rng.integers(0, 512, size=L)
        for t in range(1, L):
            x[t] = rnd[t] if noise[t] else (x[t - 1] * a + b) % 512
        doc = np.concatenate([[bos], vocab_lo + x])
        out.append(doc)
        total += len(doc)
    np.concatenate(out)[:n].astype(np.uint16).tofile(path)


# ----------------------------------------------------------------------------------------------------------------
# Schedule, optimizer
# ----------------------------------------------------------------------------------------------------------------


def lr_at(step: int, h: dict, rewarm_from) -> float:
    """LR of the optimizer step taken when `step` steps are done: linear warm-up over h.warmup steps, then cosine
    from h.lr down to h.lr * h.min_lr_ratio at h.total_steps. After --init-from (fresh AdamW moments) the LR is
    also ramped up linearly over h.rewarmup steps from the restart."""
    peak, total, warm = h["lr"], h["total_steps"], h["warmup"]
    if step < warm:
        lr = peak * (step + 1) / warm
    else:
        p = min(1.0, (step - warm) / max(1, total - warm))
        lr = peak * (h["min_lr_ratio"] + (1 - h["min_lr_ratio"]) * 0.5 * (1 + math.cos(math.pi * p)))
    if rewarm_from is not None and h["rewarmup"] > 0:
        lr *= min(1.0, (step - rewarm_from + 1) / h["rewarmup"])
    return lr


def bias_u_at(step: int, h: dict) -> float:
    """Router-bias update rate: h.bias_u_start at step 0, linearly down to h.bias_u at h.bias_u_decay steps (default
    the whole run), then h.bias_u. Why not 1e-3 throughout: on CPU tests of a 4-layer, 64-expert top-8 model at
    LR 2e-3, u = 1e-3 left each layer's routing collapsed onto about 8 experts taken by every token (window
    max/mean load 7.7 of a possible 8) for the 125 steps the test ran after warm-up, and so did 1e-2 decayed to
    1e-3 over 80 steps; u = 1e-2 balanced it by step ~100 (max/mean 1.36 at 125). The score gaps reach ~0.5
    while the bias moves u a step."""
    decay = h["bias_u_decay"] or h["total_steps"]
    if step >= decay:
        return h["bias_u"]
    f = step / max(1, decay)
    return h["bias_u_start"] + f * (h["bias_u"] - h["bias_u_start"])


def make_optimizer(model, h: dict, device: torch.device) -> torch.optim.Optimizer:
    """AdamW; weight decay on the matrices (embeddings, projections, experts, router), none on norms, conv taps,
    A_log, dt_bias and the attention-residual pseudo-queries."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.ndim >= 2 and "conv1d" not in name and not name.endswith("_res_proj.weight"):
            decay.append(p)
        else:
            no_decay.append(p)
    groups = [dict(params=decay, weight_decay=h["weight_decay"]), dict(params=no_decay, weight_decay=0.0)]
    kw = dict(lr=h["lr"], betas=(h["beta1"], h["beta2"]), eps=1e-8)
    if device.type == "cuda":
        try:
            opt = torch.optim.AdamW(groups, fused=True, **kw)
            return opt
        except (RuntimeError, TypeError) as e:  # pragma: no cover
            log(f"fused AdamW unavailable ({e}); using the default implementation")
    return torch.optim.AdamW(groups, **kw)


# ----------------------------------------------------------------------------------------------------------------
# Checkpoints
# ----------------------------------------------------------------------------------------------------------------


def config_json(cfg: k3.K3Config) -> dict:
    text = cfg.to_text_dict()
    return {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
            "torch_dtype": "bfloat16", "tie_word_embeddings": cfg.tie_word_embeddings, "text_config": text}


def rng_state() -> dict:
    st = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict) -> None:
    torch.set_rng_state(st["torch"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


def save_full(path: Path, model, opt, state: dict, h: dict, loss_log: list) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".pt.tmp")
    torch.save({
        "format": "deltafin-demo-full-1", "config": config_json(model.cfg), "model": model.state_dict(),
        "optimizer": opt.state_dict(), "state": state, "hparams": h, "rng": rng_state(), "loss_log": loss_log,
    }, tmp)
    os.replace(tmp, path)


def list_full(run_dir: Path) -> list:
    return sorted(run_dir.glob("ckpt-*.pt"))


def resolve_full(p: Path) -> Path:
    if p.is_dir():
        found = list_full(p)
        if not found:
            raise SystemExit(f"--resume: no ckpt-*.pt in {p}")
        return found[-1]
    return p


def compact_tensors(model) -> dict:
    """The weights under the checkpoint's names: bf16, except the release's f32 tensors (router biases among them)."""
    return k3.hf_state_dict(model, mxfp4_experts=False, dtype=torch.bfloat16)


def write_shards(tensors: dict, out_dir: Path, groups: list, name_fmt: str) -> dict:
    """Write each group of names as one safetensors file; returns {name: file}."""
    from safetensors.torch import save_file

    weight_map = {}
    for i, names in enumerate(groups):
        fname = name_fmt.format(i=i + 1, n=len(groups))
        save_file({n: tensors[n] for n in names}, str(out_dir / fname), metadata={"format": "pt"})
        for n in names:
            weight_map[n] = fname
    return weight_map


def pack_compact(tensors: dict) -> list:
    """Names in order, cut into consecutive groups of at most COMPACT_FILE_LIMIT bytes (header allowance 160 bytes
    a tensor + 1 KiB)."""
    groups, cur, size = [], [], 1024
    for n in sorted(tensors):
        b = tensors[n].numel() * tensors[n].element_size() + 160 + len(n)
        if cur and size + b > COMPACT_FILE_LIMIT:
            groups.append(cur)
            cur, size = [], 1024
        cur.append(n)
        size += b
    groups.append(cur)
    return groups


def save_compact(out: Path, model, state: dict, h: dict, loss_log: list) -> list:
    """The compact checkpoint, written to OUT.tmp and swapped in, so an interrupted write leaves the old one."""
    tensors = compact_tensors(model)
    groups = pack_compact(tensors)
    if len(groups) > COMPACT_MAX_FILES:
        log(f"WARNING: the compact checkpoint needs {len(groups)} files of <= {COMPACT_FILE_LIMIT / 2**20:.0f} MiB "
            f"(more than {COMPACT_MAX_FILES})")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write_shards(tensors, tmp, groups, "model-{i:05d}-of-{n:05d}.safetensors")
    (tmp / "config.json").write_text(json.dumps(config_json(model.cfg), indent=2) + "\n")
    (tmp / "state.json").write_text(json.dumps({
        "format": "deltafin-demo-compact-1", "state": state, "hparams": h,
        "note": "weights only: --init-from re-initialises the AdamW moments"}, indent=2) + "\n")
    write_jsonl(tmp / "loss.jsonl", loss_log)
    old = out.with_name(out.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if out.exists():
        os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)
    return sorted(out.iterdir())


def load_compact(path: Path) -> tuple:
    """-> (config, state_dict in float32 under the module's names, state.json, loss log)."""
    from safetensors.torch import load_file

    cfg = load_config(path / "config.json")
    sd = {}
    for f in sorted(path.glob("*.safetensors")):
        sd.update({n: t.float() for n, t in load_file(str(f)).items()})
    meta = json.loads((path / "state.json").read_text())
    loss_log = read_jsonl(path / "loss.jsonl")
    return cfg, sd, meta, loss_log


def write_jsonl(path: Path, records: list) -> None:
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def read_jsonl(path: Path) -> list:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ----------------------------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------------------------


def autocast_ctx(device: torch.device, amp: str):
    if amp == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return torch.autocast(device_type=device.type, enabled=False)


@torch.no_grad()
def evaluate(model, windows: torch.Tensor, micro: int, device, amp: str) -> float:
    """Mean next-token loss over every position of the fixed validation windows."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(windows), micro):
        w = windows[i : i + micro].to(device)
        with autocast_ctx(device, amp):
            logits = model(w[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1), reduction="sum")
        total += float(loss)
        count += w[:, 1:].numel()
    model.train()
    return total / count


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def resolve_hparams(args, saved) -> dict:
    """Schedule-defining hyperparameters: a flag given on the command line wins; otherwise the checkpoint's value
    (when resuming), else the default."""
    h = {}
    for k, default in SCHEDULE_DEFAULTS.items():
        given = getattr(args, k)
        if saved is not None and k in saved:
            if given is not None and given != saved[k]:
                log(f"note: {k} = {given} from the command line (the checkpoint had {saved[k]})")
            h[k] = given if given is not None else saved[k]
        else:
            h[k] = given if given is not None else default
    if h["total_steps"] is None:
        raise SystemExit("--total-steps is required for a fresh run (it fixes the LR schedule across pieces)")
    return h


def train(args) -> dict:
    """One piece of training. Returns {"losses": {step: train loss of that log window}, "valid": {step: loss},
    "step": last step, "stopped": why, "tok_s": tokens/s}."""
    t0 = getattr(args, "t0", None) or T0
    deadline = t0 + args.minutes * 60 if args.minutes else None
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    amp = args.amp or ("bf16" if device.type == "cuda" else "none")
    moe_impl = args.moe_impl or ("bmm" if device.type == "cuda" else "loop")
    if args.threads:
        torch.set_num_threads(args.threads)
    bench = args.bench_steps > 0
    out = Path(args.out) if args.out else None
    if out is None and not bench:
        raise SystemExit("--out is required (the run folder: full checkpoints and loss.jsonl)")
    compact_dir = Path(args.compact) if args.compact else (out / "compact" if out else None)

    # --- what we start from ---
    full = meta = None
    loss_log: list = []
    mode = "resume" if args.resume else "init_from" if args.init_from else "fresh"
    if sum(bool(x) for x in (args.resume, args.init_from, getattr(args, "init_hf", None))) > 1:
        raise SystemExit("--resume, --init-from and --init-hf exclude each other")
    hf_model = None
    if args.resume:
        path = resolve_full(Path(args.resume))
        full = torch.load(path, map_location="cpu", weights_only=False)
        cfg = k3.K3Config.from_dict(full["config"])
        h = resolve_hparams(args, full["hparams"])
        state = dict(full["state"])
        loss_log = list(full["loss_log"])
        src = f"resumed from {path} (step {state['step']})"
    elif args.init_from:
        cfg, sd, meta, loss_log = load_compact(Path(args.init_from))
        h = resolve_hparams(args, meta["hparams"])
        state = dict(meta["state"])
        state["rewarm_from"] = state["step"]
        src = (f"initialised from the compact checkpoint {args.init_from} (step {state['step']}): weights only, "
               f"AdamW moments re-initialised, LR re-warmed over {h['rewarmup']} steps")
    elif getattr(args, "init_hf", None):
        hf_model = k3.load_hf(Path(args.init_hf), dtype=torch.float32)
        cfg = hf_model.cfg
        h = resolve_hparams(args, None)
        state = {"step": 0, "tokens": 0, "rewarm_from": None}
        src = (f"fine-tune from the Hugging Face export {args.init_hf} (its MXFP4 experts dequantised): a new "
               "schedule from step 0, fresh AdamW moments")
    else:
        cfg = smoke_config() if args.smoke_model else load_config(args.config)
        h = resolve_hparams(args, None)
        state = {"step": 0, "tokens": 0, "rewarm_from": None}
        src = "fresh start"
    if h["qat_from"] is not None and moe_impl != "bmm":
        raise SystemExit("--qat-from needs --moe-impl bmm")
    if h["seq"] > cfg.raw.get("max_position_embeddings", 1 << 30):
        raise SystemExit(f"--seq {h['seq']} exceeds max_position_embeddings {cfg.raw['max_position_embeddings']}")

    model = build_model(cfg, h["seed"], moe_impl)
    if full is not None:
        model.load_state_dict(full["model"], strict=True)
    elif meta is not None:
        model.load_state_dict(sd, strict=True)
    elif hf_model is not None:
        model.load_state_dict(hf_model.state_dict(), strict=True)
        del hf_model
    model.to(device).train()
    opt = make_optimizer(model, h, device)
    if full is not None:
        opt.load_state_dict(full["optimizer"])
        set_rng_state(full["rng"])
        del full
    micro = args.micro_batch or h["batch"]
    if h["batch"] % micro:
        raise SystemExit("--batch must be a multiple of --micro-batch")

    # --- data ---
    data_dir = Path(args.data)
    train_tok = Tokens(data_dir / "train.bin")
    valid_tok = Tokens(data_dir / "valid.bin")
    eval_w = valid_tok.eval_windows(args.eval_windows, h["seq"])
    top = int(max(train_tok.ids.max(), valid_tok.ids.max()))
    chat_tok = chat_eval_w = None
    n_chat = round(h["batch"] * h["chat_frac"])
    if h["chat_frac"] > 0:
        if not getattr(args, "chat_data", None):
            raise SystemExit("this run mixes in chat windows (chat_frac > 0): --chat-data DIR is required")
        chat_tok = ChatTokens(Path(args.chat_data) / "chat-train.bin")
        chat_valid = ChatTokens(Path(args.chat_data) / "chat-valid.bin")
        chat_eval_w = chat_valid.eval_windows(args.eval_windows, h["seq"])
        top = max(top, int(chat_tok.ids.max()), int(chat_valid.ids.max()))
    if top >= cfg.vocab_size:
        raise SystemExit(f"token id {top} >= vocab_size {cfg.vocab_size}")

    log(f"{src}; device {device}, autocast {amp}, MoE {moe_impl}, {torch.get_num_threads()} CPU threads")
    describe(model)
    tok_step = h["batch"] * h["seq"]
    log(f"data: train {len(train_tok):,} tokens, valid {len(valid_tok):,} ({len(eval_w)} eval windows of {h['seq']}); "
        f"{tok_step:,} tokens/step = batch {h['batch']} (micro {micro}) x seq {h['seq']}; "
        f"{h['total_steps']} steps = {h['total_steps'] * tok_step / max(1, len(train_tok)):.2f} epochs")
    if chat_tok is not None:
        log(f"chat: {len(chat_tok):,} tokens in {len(chat_tok.starts):,} conversations; {n_chat} of {h['batch']} "
            f"windows per step start at a conversation ({h['total_steps'] * n_chat * h['seq'] / len(chat_tok):.2f} "
            f"epochs); {len(chat_eval_w)} held-out chat windows")
    log("hparams: " + json.dumps(h))

    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        if mode == "init_from":
            loss_log.append({"event": "init_from", "step": state["step"], "path": str(args.init_from),
                             "note": "optimizer moments re-initialised", "rewarmup": h["rewarmup"]})
        elif mode == "fresh":
            loss_log.append({"event": "start", "step": 0, "hparams": h})
        else:
            loss_log.append({"event": "resume", "step": state["step"], "path": str(args.resume)})
        write_jsonl(out / "loss.jsonl", loss_log)
    loss_file = open(out / "loss.jsonl", "a") if out is not None else None

    def record(r: dict) -> None:
        loss_log.append(r)
        if loss_file is not None:
            loss_file.write(json.dumps(r) + "\n")
            loss_file.flush()

    # --- timing estimates for the time box ---
    # save: until measured, 2 s + the bytes of both checkpoints at 100 MB/s (f32 weights + 2 moments + bf16 copy)
    n_params = sum(p.numel() for p in model.parameters())
    est = {"step": None, "eval": None, "save": 2.0 + n_params * 14 / 100e6}

    def eval_estimate() -> float:
        """Measured, or before the first validation: a forward is about a third of a training step."""
        if est["eval"] is not None:
            return est["eval"]
        return est["step"] * len(eval_w) * h["seq"] / tok_step / 3 + 2

    def run_eval() -> float:
        t = time.time()
        v = evaluate(model, eval_w, micro, device, amp)
        r = {"step": state["step"], "tokens": state["tokens"], "valid_loss": v}
        chat = ""
        if chat_eval_w is not None:
            r["chat_valid_loss"] = evaluate(model, chat_eval_w, micro, device, amp)
            chat = f", chat {r['chat_valid_loss']:.4f} ({len(chat_eval_w)} windows)"
        est["eval"] = time.time() - t
        r["eval_s"] = round(est["eval"], 2)
        record(r)
        log(f"step {state['step']:6d}  valid loss {v:.4f}  ({len(eval_w)} windows{chat}, {est['eval']:.1f} s)")
        return v

    def save_all() -> None:
        if bench:
            return
        t = time.time()
        path = out / f"ckpt-{state['step']:07d}.pt"
        save_full(path, model, opt, state, h, loss_log)
        if args.keep_full > 0:
            for old in list_full(out)[: -args.keep_full]:
                old.unlink()
        files = save_compact(compact_dir, model, state, h, loss_log)
        est["save"] = time.time() - t
        sizes = ", ".join(f"{f.name} {f.stat().st_size / 2**20:.2f} MiB" for f in files if f.suffix == ".safetensors")
        log(f"step {state['step']:6d}  saved {path.name} and compact {compact_dir} ({sizes}) in {est['save']:.1f} s")

    qat_on = h["qat_from"] is not None and state["step"] >= h["qat_from"]
    set_qat(model, qat_on)
    result = {"losses": {}, "valid": {}, "stopped": None}
    if state["step"] == 0 and not bench and args.eval_every:
        result["valid"][0] = run_eval()

    win = {"loss": torch.zeros((), device=device), "n": 0, "tokens": 0, "time": 0.0,
           "loads": None, "gnorm": torch.zeros((), device=device)}
    steps_this_run = 0
    total_train_time, total_train_tokens = 0.0, 0
    stop = None
    end_step = h["total_steps"] if not bench else state["step"] + args.bench_steps + 2
    while state["step"] < end_step:
        step = state["step"]
        if deadline is not None and est["step"] is not None:
            eval_due = bool(args.eval_every) and (step + 1) % args.eval_every == 0
            save_due = bool(args.save_every) and (step + 1) % args.save_every == 0
            need = (est["step"] * 1.5 + eval_estimate() * (2 if eval_due else 1)
                    + est["save"] * (2.5 if save_due else 1.5) + 5)
            if time.time() + need > deadline:
                stop = "time"
                break
        t_step = time.time()
        qat = h["qat_from"] is not None and step >= h["qat_from"]
        if qat and not qat_on:
            log(f"step {step:6d}  quantisation-aware training of the routed experts (MXFP4) from here on")
            set_qat(model, True)
            qat_on = True
        lr = lr_at(step, h, state.get("rewarm_from"))
        for g in opt.param_groups:
            g["lr"] = lr
        batch = train_tok.train_batch(h["seed"], step, h["batch"] - n_chat, h["seq"])
        if n_chat:
            batch = torch.cat([batch, chat_tok.train_batch(h["seed"], step, n_chat, h["seq"])])
            batch = batch[torch.randperm(len(batch), generator=torch.Generator().manual_seed(h["seed"] + step))]
        opt.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=device)
        for i in range(0, h["batch"], micro):
            w = batch[i : i + micro].to(device, non_blocking=True)
            with autocast_ctx(device, amp):
                logits = model(w[:, :-1])  # [b, seq, V]
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1))
            (loss * (w.shape[0] / h["batch"])).backward()
            loss_sum += loss.detach() * (w.shape[0] / h["batch"])
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), h["grad_clip"])
        opt.step()
        loads = model.update_router_bias(bias_u_at(step, h))
        state["step"] = step + 1
        state["tokens"] += tok_step
        steps_this_run += 1
        win["loss"] += loss_sum
        win["gnorm"] = torch.maximum(win["gnorm"], gnorm.detach().float())
        win["n"] += 1
        win["tokens"] += tok_step
        L = torch.stack([loads[i] for i in sorted(loads)]) if loads else None  # [layers, E]
        win["loads"] = L if win["loads"] is None else win["loads"] + L
        if steps_this_run <= 2 or state["step"] % args.log_every == 0 or state["step"] == end_step:
            sync(device)
        dt = time.time() - t_step
        win["time"] += dt
        if steps_this_run > 2:  # the first steps include CUDA / allocator warm-up
            total_train_time += dt
            total_train_tokens += tok_step
        est["step"] = dt if est["step"] is None or steps_this_run <= 3 else max(dt, 0.8 * est["step"] + 0.2 * dt)

        if state["step"] % args.log_every == 0 or state["step"] == end_step:
            tl = float(win["loss"]) / win["n"]
            if not math.isfinite(tl):
                log(f"step {state['step']:6d}  train loss {tl}: stopping without saving (the last checkpoints stay)")
                record({"event": "nonfinite_loss", "step": state["step"], "loss": str(tl)})
                raise SystemExit(1)
            ratio = max_mean = dead = None
            if win["loads"] is not None:
                lo = win["loads"].float()  # [layers, E] tokens routed to each expert over the window
                ratio = float((lo.max(1).values / lo.min(1).values.clamp_min(1)).max())  # worst layer, min >= 1
                max_mean = float((lo.max(1).values / lo.mean(1)).max())  # worst layer
                dead = int((lo == 0).sum())  # (layer, expert) pairs that got no token in the window
            tok_s = win["tokens"] / win["time"]
            mem = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
            rec = {"step": state["step"], "tokens": state["tokens"], "loss": tl, "lr": lr,
                   "grad_norm": float(win["gnorm"]), "tok_s": round(tok_s, 1), "load_max_min": ratio,
                   "load_max_mean": max_mean, "dead_experts": dead,
                   "bias_u": bias_u_at(step, h),
                   "elapsed_s": round(time.time() - t0, 1)}
            record(rec)
            result["losses"][state["step"]] = tl
            log(f"step {state['step']:6d}  tokens {state['tokens']:>12,}  loss {tl:.4f}  lr {lr:.2e}  "
                f"gnorm {float(win['gnorm']):.2f}  {tok_s:,.0f} tok/s  load max/min "
                + (f"{ratio:.1f} max/mean {max_mean:.2f} idle {dead}" if ratio is not None else "-")
                + (f"  mem {mem:.1f} GiB" if device.type == "cuda" else ""))
            win = {"loss": torch.zeros((), device=device), "n": 0, "tokens": 0, "time": 0.0, "loads": None,
                   "gnorm": torch.zeros((), device=device)}
        if not bench and args.eval_every and state["step"] % args.eval_every == 0 and state["step"] < end_step:
            result["valid"][state["step"]] = run_eval()
        if not bench and args.save_every and state["step"] % args.save_every == 0 and state["step"] < end_step:
            save_all()

    if stop is None:
        stop = "bench" if bench else "total_steps"
    tok_s = total_train_tokens / total_train_time if total_train_time > 0 else float("nan")
    log(f"stopped ({stop}) at step {state['step']} of {h['total_steps']}: {steps_this_run} steps this run, "
        f"{tok_s:,.0f} tokens/s after warm-up ({tok_s * 60 / tok_step:,.1f} steps/min), "
        f"elapsed {time.time() - t0:.0f} s")
    if not bench:
        result["valid"][state["step"]] = run_eval()
        record({"event": "stop", "step": state["step"], "reason": stop, "tok_s": round(tok_s, 1)})
        save_all()
        log(f"done at {time.time() - t0:.0f} s of {args.minutes * 60 if args.minutes else float('inf'):.0f} s")
    if loss_file is not None:
        loss_file.close()
    result.update(step=state["step"], stopped=stop, tok_s=tok_s)
    return result


# ----------------------------------------------------------------------------------------------------------------
# Smoke test
# ----------------------------------------------------------------------------------------------------------------


def check_moe_bmm(cfg: k3.K3Config) -> None:
    """The batched MoE forward against k3_torch's loop: outputs and gradients (float64), and router-bias update."""
    torch.manual_seed(0)
    ref = build_model(cfg, 7, "loop").double()
    fast = build_model(cfg, 7, "bmm").double()
    fast.load_state_dict(ref.state_dict())
    for m in list(ref.moe_layers().values()):  # skew the router so expert counts are uneven
        m.gate.e_score_correction_bias.copy_(torch.linspace(-0.05, 0.05, cfg.num_experts))
    for m in list(fast.moe_layers().values()):
        m.gate.e_score_correction_bias.copy_(torch.linspace(-0.05, 0.05, cfg.num_experts))
    ids = torch.randint(0, cfg.vocab_size, (2, 40))
    outs = []
    for mdl in (ref, fast):
        logits = mdl(ids)
        logits.square().mean().backward()
        outs.append((logits.detach(), {n: p.grad.clone() for n, p in mdl.named_parameters() if p.grad is not None},
                     {i: m.expert_load.clone() for i, m in mdl.moe_layers().items()}))
    (lr_, gr, ldr), (lf, gf, ldf) = outs
    rel = float((lf - lr_).abs().max() / lr_.abs().max())
    grel = max(float((gf[n] - gr[n]).abs().max() / gr[n].abs().max().clamp_min(1e-30)) for n in gr)
    # experts that got no token have no gradient in the loop, a zero one in the batched form
    same_keys = set(gr) <= set(gf) and all(not gf[n].any() for n in set(gf) - set(gr))
    same_load = all(torch.equal(ldr[i], ldf[i]) for i in ldr)
    ok = rel < 1e-12 and grel < 1e-9 and same_keys and same_load
    log(f"smoke: batched MoE vs k3_torch loop (float64): logits rel {rel:.1e}, worst gradient rel {grel:.1e}, "
        f"{len(gr)} gradients ({len(gf) - len(gr)} more, all zero, for idle experts), expert loads {'equal' if same_load else 'DIFFER'}: {'ok' if ok else 'FAIL'}")
    if not ok:
        raise SystemExit("smoke: batched MoE disagrees with the loop")

    # QAT: the batched forward with fake MXFP4 equals the loop on MXFP4-round-tripped expert weights
    refq = build_model(cfg, 7, "loop").double()
    sd = {n: (k3.mxfp4_dequantize(*k3.mxfp4_quantize(t)).double() if is_expert(n) else t)
          for n, t in fast.state_dict().items()}
    refq.load_state_dict(sd)
    set_qat(fast, True)
    fast.zero_grad()
    lq = fast(ids)
    lq.square().mean().backward()
    lrq = refq(ids)
    relq = float((lq.detach() - lrq.detach()).abs().max() / lrq.detach().abs().max())
    has_grad = all(p.grad is not None and p.grad.any() for n, p in fast.named_parameters()
                   if is_expert(n) and n in gr)
    set_qat(fast, False)
    log(f"smoke: QAT forward vs the loop on MXFP4 round-tripped experts (float64): rel {relq:.1e}, "
        f"straight-through gradients reach the experts: {has_grad}")
    if not (relq < 1e-12 and has_grad):
        raise SystemExit("smoke: QAT forward wrong")


def smoke(args) -> None:
    base = Path(args.out or "/tmp/deltafin-smoke")
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    cfg = smoke_config()
    check_moe_bmm(cfg)

    data = Path(args.data)
    if all((data / n).exists() or (data / (n + ".gz")).exists() for n in ("train.bin", "valid.bin")):
        log(f"smoke: data from {data}")
    else:
        data = base / "data"
        data.mkdir()
        bos = cfg.raw.get("bos_token_id", 7936)
        make_synthetic_tokens(data / "train.bin", 200_000, 1000, bos, seed=1)
        make_synthetic_tokens(data / "valid.bin", 20_000, 1000, bos, seed=2)
        log(f"smoke: {args.data} has no train.bin/valid.bin; synthetic token files in {data}")

    def smoke_args(**kw):
        a = copy.copy(args)
        a.smoke = False
        a.smoke_model = True
        a.data = str(data)
        a.device = "cpu"
        a.amp = "none"
        a.moe_impl = kw.pop("moe_impl", "bmm")
        a.seq = 128  # two KDA chunks
        a.batch = 4
        a.micro_batch = 2  # and gradient accumulation
        a.total_steps = 6
        a.warmup = 2
        a.rewarmup = 2
        a.lr = 3e-3
        a.qat_from = 4  # steps 4-6 train the experts through MXFP4 (and resume must reproduce that too)
        a.log_every = 1
        a.eval_every = 3
        a.save_every = 3
        a.eval_windows = 8
        a.keep_full = 0
        a.minutes = 0
        a.resume = None
        a.init_from = None
        a.compact = None
        a.bench_steps = 0
        a.t0 = None
        for k, v in kw.items():
            setattr(a, k, v)
        return a

    log("\n=== smoke A: 6 steps from scratch, checkpoints at 3 and 6 ===")
    t = time.time()
    ra = train(smoke_args(out=str(base / "a")))
    log(f"(run A took {time.time() - t:.1f} s)")
    shutil.copytree(base / "a" / "compact", base / "a-compact-6")

    log("\n=== smoke B: --resume from A's step-3 full checkpoint, steps 4-6 ===")
    shutil.copytree(base / "a", base / "b", ignore=shutil.ignore_patterns("ckpt-0000006.pt", "compact"))
    rb = train(smoke_args(out=str(base / "b"), resume=str(base / "b" / "ckpt-0000003.pt")))
    diffs = {s: (ra["losses"][s], rb["losses"][s]) for s in (4, 5, 6)}
    exact = all(a == b for a, b in diffs.values()) and ra["valid"][6] == rb["valid"][6]
    for s, (a, b) in diffs.items():
        log(f"  step {s}: A {a!r}  B {b!r}  {'identical' if a == b else 'DIFFERENT'}")
    log(f"  valid at 6: A {ra['valid'][6]!r}  B {rb['valid'][6]!r}")
    sa = torch.load(base / "a" / "ckpt-0000006.pt", weights_only=False)
    sb = torch.load(base / "b" / "ckpt-0000006.pt", weights_only=False)
    same_w = all(torch.equal(sa["model"][n], sb["model"][n]) for n in sa["model"])
    def losses(lg):
        return [(r["step"], r.get("loss"), r.get("valid_loss")) for r in lg if "loss" in r or "valid_loss" in r]
    same_log = losses(sa["loss_log"]) == losses(sb["loss_log"])
    log(f"  step-6 weights and router biases bit-identical: {same_w}; loss logs (train and valid) equal: {same_log}")
    if not (exact and same_w and same_log):
        raise SystemExit("smoke: resume did not reproduce run A")

    log("\n=== smoke C: --init-from the compact checkpoint of step 3 (weights only), steps 4-6 ===")
    # A's compact folder holds step 6 now; rebuild the step-3 one from B's copy of A's loss log and step-3 weights.
    full3 = torch.load(base / "a" / "ckpt-0000003.pt", weights_only=False)
    m3 = build_model(k3.K3Config.from_dict(full3["config"]), 0, "loop")
    m3.load_state_dict(full3["model"])
    save_compact(base / "compact-3", m3, full3["state"], full3["hparams"], full3["loss_log"])
    rc = train(smoke_args(out=str(base / "c"), init_from=str(base / "compact-3")))
    for s in (4, 5, 6):
        log(f"  step {s}: A {ra['losses'][s]:.5f}  C {rc['losses'][s]:.5f}")
    log("  (C differs from A by design: fresh AdamW moments, bf16-rounded weights, LR re-warm-up)")

    log("\n=== smoke D: --minutes time box (a 1000-step schedule in 0.35 minutes) ===")
    t = time.time()
    rd = train(smoke_args(out=str(base / "d"), total_steps=1000, minutes=0.35, t0=t, eval_every=0, save_every=0,
                          log_every=5))
    log(f"  the piece took {time.time() - t:.1f} s of its {0.35 * 60:.0f} s")
    el = json.loads((base / "d" / "compact" / "state.json").read_text())["state"]
    log(f"  stopped: {rd['stopped']} at step {rd['step']}; compact state step {el['step']}; "
        f"files {sorted(p.name for p in (base / 'd').iterdir())}")
    if rd["stopped"] != "time" or el["step"] != rd["step"]:
        raise SystemExit("smoke: time box did not stop cleanly")

    log(f"\nsmoke: all ok (outputs in {base}); CPU tokens/s at smoke scale: run A {ra['tok_s']:,.0f}, "
        f"run D {rd['tok_s']:,.0f}")


# ----------------------------------------------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(HERE / "demo_config.json"), help="model config (fresh runs)")
    ap.add_argument("--data", default=str(REPO / "target/demo/tokenizer"), help="folder with train.bin, valid.bin")
    ap.add_argument("--out", help="run folder: full checkpoints ckpt-SSSSSSS.pt and loss.jsonl")
    ap.add_argument("--compact", help="compact checkpoint folder (default OUT/compact)")
    ap.add_argument("--resume", help="full checkpoint file, or a run folder (its latest ckpt-*.pt)")
    ap.add_argument("--init-from", help="compact checkpoint folder: weights only, fresh optimizer moments")
    ap.add_argument("--init-hf", help="fine-tune: a Hugging Face export's weights, a new schedule from step 0")
    ap.add_argument("--chat-data", help="folder with chat_data.py's chat-{train,valid}.bin and .idx.npy")
    ap.add_argument("--chat-frac", type=float, help="share of each batch's windows taken from --chat-data (default 0)")
    ap.add_argument("--minutes", type=float, default=0, help="stop cleanly (and save) before M minutes of wall time")
    # schedule-defining (default: SCHEDULE_DEFAULTS, or the checkpoint's when resuming)
    ap.add_argument("--total-steps", type=int, help="optimizer steps of the whole run (fixes the LR schedule)")
    ap.add_argument("--seq", type=int, help="sequence length (default 512)")
    ap.add_argument("--batch", type=int, help="sequences per optimizer step (default 64)")
    ap.add_argument("--lr", type=float, help="peak learning rate (default 2e-3)")
    ap.add_argument("--min-lr-ratio", type=float, help="final LR / peak (default 0.1)")
    ap.add_argument("--warmup", type=int, help="warm-up steps (default 100)")
    ap.add_argument("--rewarmup", type=int, help="LR re-warm-up steps after --init-from (default 50)")
    ap.add_argument("--weight-decay", type=float, help="AdamW weight decay on matrices (default 0.1)")
    ap.add_argument("--beta1", type=float, help="default 0.9")
    ap.add_argument("--beta2", type=float, help="default 0.95")
    ap.add_argument("--grad-clip", type=float, help="default 1.0")
    ap.add_argument("--bias-u", type=float, help="router-bias update rate u (default 1e-3)")
    ap.add_argument("--bias-u-start", type=float, help="u at step 0, decaying linearly to --bias-u (default 1e-2)")
    ap.add_argument("--bias-u-decay", type=int, help="steps over which u decays to --bias-u (default: --total-steps)")
    ap.add_argument("--seed", type=int, help="initialisation and data order (default 1234)")
    ap.add_argument("--qat-from", type=int, help="from this step on, train the routed experts through MXFP4 fake "
                    "quantisation (straight-through), so the export's MXFP4 experts are what was trained (default off)")
    # runtime
    ap.add_argument("--micro-batch", type=int, default=0, help="sequences per forward (gradient accumulation)")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--eval-every", type=int, default=200, help="validation every K steps (0: only at the end)")
    ap.add_argument("--eval-windows", type=int, default=128, help="fixed validation windows of --seq tokens")
    ap.add_argument("--save-every", type=int, default=0, help="full + compact checkpoints every N steps")
    ap.add_argument("--keep-full", type=int, default=2, help="full checkpoints kept in OUT (0: all)")
    ap.add_argument("--device", help="cuda or cpu (default: cuda if available)")
    ap.add_argument("--amp", choices=["bf16", "none"], help="autocast (default bf16 on CUDA, none on CPU)")
    ap.add_argument("--moe-impl", choices=["bmm", "loop"], help="batched experts or k3_torch's loop (default bmm "
                    "on CUDA, loop on CPU)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--dry-run", action="store_true", help="print the model's parameter counts and sizes, exit")
    ap.add_argument("--smoke", action="store_true", help="tiny CPU run: loop, exact resume, init-from, time box")
    ap.add_argument("--smoke-model", action="store_true", help="train the tiny smoke config instead of --config")
    ap.add_argument("--bench-steps", type=int, default=0, help="time N steps (after 2 warm-up) and exit, no saving")
    args = ap.parse_args()

    if args.dry_run:
        cfg = smoke_config() if args.smoke_model else load_config(args.config)
        describe(build_model(cfg, 0, "loop"))
        return
    if args.smoke:
        smoke(args)
        return
    if args.bench_steps and args.total_steps is None:
        args.total_steps = 10**6
    train(args)


if __name__ == "__main__":
    main()
