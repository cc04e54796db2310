#!/usr/bin/env python3
"""PyTorch port of the Kimi K3 text model, numerically as mlx-lm 0.32.2 defines it (mlx_lm/models/kimi_k3.py and
what it imports: gated_delta.py, kimi_linear.ShortConv1d, mla.MultiLinear, switch_layers.SwitchGLU).

Written for training a small demo model (teacher forcing, causal, no KV cache) and for checking it against the
mlx-lm reference outputs in fixtures/*/reference.json (tools/demo/check_parity.py). Ported from the files of the
mlx-lm 0.32.2 wheel on PyPI.

Module tree and parameter names are the Hugging Face checkpoint's own (`language_model.model.layers.N.self_attn.
q_proj.weight`, `...block_sparse_moe.gate.e_score_correction_bias`, ...), so `load_hf` maps safetensors straight
onto `state_dict()` keys. Two things differ from the raw files, both undone by `save_hf`:
  * routed experts are float `experts.E.wN.weight` here; the release stores them MXFP4 (compressed-tensors
    `weight_packed` / `weight_scale`), which `load_hf` dequantises and `save_hf` re-quantises;
  * `A_log` is `[num_heads]` here; the release pads it to a longer vector of which only the first num_heads
    entries matter (mlx-lm's sanitize slices it the same way).

The mlx-lm pieces and where they live below:
  KimiK3DeltaAttention + gated_delta_update -> KimiDeltaAttention, kda_recurrent, kda_chunk
  KimiK3MLAAttention (NoPE MLA, output gate)  -> MLAAttention
  KimiK3SparseMoE + _group_expert_select       -> LatentMoE, select_experts
  KimiK3MLP + _situ                            -> GatedMLP, situ
  ResidualBlocks + _attn_res_combine           -> attn_res_mix (blocks kept as a Python list)
  KimiK3DecoderLayer / KimiK3TextModel         -> DecoderLayer / K3TextModel
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

# ----------------------------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class K3Config:
    """`text_config` of a K3 checkpoint; defaults are mlx-lm's TextArgs defaults."""

    vocab_size: int = 163840
    hidden_size: int = 7168
    num_hidden_layers: int = 93
    num_attention_heads: int = 96
    intermediate_size: int = 33792
    rms_norm_eps: float = 1e-5
    linear_attn_config: Optional[Dict[str, Any]] = None
    hidden_act: str = "situ"
    activation_situ_beta: Optional[float] = None
    activation_situ_linear_beta: Optional[float] = None
    attn_res_block_size: Optional[int] = None
    q_lora_rank: Optional[int] = None
    kv_lora_rank: Optional[int] = None
    qk_nope_head_dim: Optional[int] = None
    qk_rope_head_dim: Optional[int] = None
    v_head_dim: Optional[int] = None
    mla_use_nope: bool = True
    mla_use_output_gate: bool = False
    num_experts: Optional[int] = None
    num_experts_per_token: int = 16
    num_shared_experts: int = 0
    moe_intermediate_size: Optional[int] = None
    moe_router_activation_func: str = "sigmoid"
    moe_renormalize: bool = True
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    use_grouped_topk: bool = True
    num_expert_group: int = 1
    topk_group: int = 1
    routed_expert_hidden_size: Optional[int] = None
    latent_moe_use_norm: bool = False
    tie_word_embeddings: bool = False
    # every key of the source dict, unknown ones included, so save_hf writes back what it read
    raw: Dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "K3Config":
        """Accepts a whole config.json (uses its text_config) or a text_config itself."""
        text = d.get("text_config", d)
        known = {f.name for f in fields(cls)} - {"raw"}
        cfg = cls(**{k: v for k, v in text.items() if k in known}, raw=dict(text))
        if cfg.hidden_act != "situ":
            raise ValueError(f"unsupported activation {cfg.hidden_act!r} (mlx-lm accepts only situ)")
        if cfg.moe_router_activation_func != "sigmoid":
            raise ValueError(f"unsupported router activation {cfg.moe_router_activation_func!r}")
        if not cfg.mla_use_nope:
            raise ValueError("only NoPE MLA is supported (mla_use_nope=True), as in mlx-lm")
        return cfg

    def to_text_dict(self) -> Dict[str, Any]:
        d = dict(self.raw)
        for f in fields(self):
            if f.name != "raw":
                d[f.name] = getattr(self, f.name)
        d.setdefault("model_type", "kimi_linear")
        d.pop("quantization_config", None)  # save_hf decides that
        return d

    @property
    def situ_beta(self) -> float:
        return self.activation_situ_beta or 1.0  # mlx-lm: `args.activation_situ_beta or 1.0`

    def is_kda(self, i: int) -> bool:
        return (i + 1) in self.linear_attn_config["kda_layers"]  # kda_layers are 1-based

    def is_moe(self, i: int) -> bool:
        return (self.num_experts or 0) > 0 and i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0


# ----------------------------------------------------------------------------------------------------------------
# Small pieces
# ----------------------------------------------------------------------------------------------------------------


def f32(t: torch.Tensor) -> torch.Tensor:
    """At least float32: bf16/f16 are upcast, float64 stays (so a float64 model computes in float64 throughout,
    which is how check_parity separates the reference's own rounding from a real mismatch)."""
    return t if t.dtype == torch.float64 else t.float()


def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    """mx.fast.rms_norm: x * rsqrt(mean(x^2) + eps) * weight, accumulated in float32 whatever x's dtype."""
    xf = f32(x)  # [..., D]
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # [..., D]
    if weight is not None:
        y = y * f32(weight)  # [..., D]
    return y.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))  # [D]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)  # [..., D]


def situ(x: torch.Tensor, gate: torch.Tensor, beta: float, linear_beta: Optional[float]) -> torch.Tensor:
    """mlx-lm _situ: (beta * tanh(gate/beta) * sigmoid(gate)) * (linear_beta * tanh(x/linear_beta)), in float32.
    x is the up projection, gate the gate projection (SwitchGLU calls activation(x_up, x_gate))."""
    g = f32(gate)  # [..., I]
    xf = f32(x)  # [..., I]
    a = beta * torch.tanh(g / beta) * torch.sigmoid(g)  # [..., I] soft-capped SiLU of the gate
    if linear_beta is not None:
        xf = linear_beta * torch.tanh(xf / linear_beta)  # [..., I] soft cap on the linear branch
    return (a * xf).to(x.dtype)


class GatedMLP(nn.Module):
    """KimiK3MLP: down(situ(up(x), gate(x))). Also the shared experts (width moe_intermediate * num_shared)."""

    def __init__(self, dim: int, hidden: int, beta: float, linear_beta: Optional[float]):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)  # weight [I, H]
        self.up_proj = nn.Linear(dim, hidden, bias=False)  # weight [I, H]
        self.down_proj = nn.Linear(hidden, dim, bias=False)  # weight [H, I]
        self.beta, self.linear_beta = beta, linear_beta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = situ(self.up_proj(x), self.gate_proj(x), self.beta, self.linear_beta)  # [..., I]
        return self.down_proj(h)  # [..., H]


def _no_autocast(device: torch.device):
    """The KDA recurrence and the router must run in float32 even inside a bf16 autocast region."""
    return torch.autocast(device_type=device.type, enabled=False)


# ----------------------------------------------------------------------------------------------------------------
# KDA: the gated delta rule with per-key-channel decay
# ----------------------------------------------------------------------------------------------------------------
#
# Per head, with the state S [Dv, Dk] (mlx-lm's layout) and per token t:
#     S <- S * g_t[None, :]                      decay, one factor per key channel
#     S <- S + (beta_t * (v_t - S k_t)) k_t^T    delta-rule write with the decayed state
#     o_t = S q_t                                read after the write
# q, k come in L2-normalised (q also scaled by 1/sqrt(Dk)); g = exp(log_g), log_g <= 0; beta in (0, 1).


def kda_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token recurrence, the same operations in the same order as mlx-lm's gated_delta_ops.
    q, k, log_g [B, T, H, Dk]; v [B, T, H, Dv]; beta [B, T, H]; state [B, H, Dv, Dk].
    Returns o [B, T, H, Dv] (in q's dtype) and the final state [B, H, Dv, Dk] (float32)."""
    with _no_autocast(q.device):
        out_dtype = q.dtype
        B, T, H, Dk = q.shape
        Dv = v.shape[-1]
        q, k, v, beta = f32(q), f32(k), f32(v), f32(beta)  # [B, T, H, Dk] x2, [B, T, H, Dv], [B, T, H]
        g = torch.exp(f32(log_g))  # [B, T, H, Dk] mlx-lm hands the recurrence g, not log g
        S = (
            f32(initial_state)
            if initial_state is not None
            else q.new_zeros(B, H, Dv, Dk)
        )  # [B, H, Dv, Dk]
        outs = []  # T x [B, H, Dv]
        for t in range(T):
            S = S * g[:, t, :, None, :]  # [B, H, Dv, Dk]
            kv_mem = (S * k[:, t, :, None, :]).sum(-1)  # [B, H, Dv] what the state predicts for k_t
            delta = (v[:, t] - kv_mem) * beta[:, t, :, None]  # [B, H, Dv]
            S = S + k[:, t, :, None, :] * delta[..., None]  # [B, H, Dv, Dk]
            outs.append((S * q[:, t, :, None, :]).sum(-1))  # [B, H, Dv]
        o = torch.stack(outs, dim=1)  # [B, T, H, Dv]
    return o.to(out_dtype), S


def _intra_chunk_scores(
    q: torch.Tensor, k: torch.Tensor, G: torch.Tensor, sub: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The two decayed score matrices of a chunk, sharing their exponentials:
        Akk[t, i] = sum_d k[t, d] k[i, d] exp(G[t, d] - G[i, d])   for i < t, else 0
        Aqk[t, i] = sum_d q[t, d] k[i, d] exp(G[t, d] - G[i, d])   for i <= t, else 0
    where G is the within-chunk cumulative log decay (non-increasing along the chunk, so every kept exponent is
    <= 0).

    exp(G_t - G_i) cannot be factored as exp(G_t) * exp(-G_i) over a whole chunk: exp(-G_i) overflows float32 once a
    chunk's decay passes e^-88 (64 tokens of a gate_lower_bound of -5 reach e^-320). So the chunk is cut into
    sub-chunks of `sub` tokens. For i in an earlier sub-chunk than t, with r the first token of t's sub-chunk,
    exp(G_t - G_i) = exp(G_t - G_r) * exp(G_r - G_i) and both factors are <= 1 (i < r <= t): plain matmuls.
    Within a sub-chunk the exponent is formed pairwise ([sub, sub, D] per sub-chunk).

    Entries that are masked away are masked by position, and their exponent is zeroed BEFORE exp: an exponent of
    the wrong sign could overflow, and inf * 0 = NaN in the backward. Masking by value instead (a clamp at 0)
    would be wrong where a token barely decays: G is then exactly flat, the clamp sits on its kink and its
    backward drops the gradient of log_g. (A cumsum of non-positive floats never rises, so the kept exponents
    are <= 0 exactly.)

    q, k, G [..., C, D] -> Akk, Aqk [..., C, C]."""
    C, D = q.shape[-2], q.shape[-1]
    ns = C // sub
    lead = q.shape[:-2]
    qs = q.reshape(*lead, ns, sub, D)  # [..., ns, sub, D]
    ks = k.reshape(*lead, ns, sub, D)  # [..., ns, sub, D]
    Gs = G.reshape(*lead, ns, sub, D)  # [..., ns, sub, D]

    # Diagonal sub-blocks, pairwise: KE[t, i] = k_i exp(G_t - G_i) for i <= t.
    incl = torch.tril(torch.ones(sub, sub, dtype=torch.bool, device=q.device))  # [sub(t), sub(i)]
    strict = torch.tril(incl, diagonal=-1)  # [sub, sub]
    diff = Gs[..., :, None, :] - Gs[..., None, :, :]  # [..., ns, sub(t), sub(i), D]
    KE = ks[..., None, :, :] * torch.exp(diff.masked_fill(~incl[:, :, None], 0.0))  # [..., ns, sub, sub, D]
    dqk = (qs[..., :, None, :] * KE).sum(-1).masked_fill(~incl, 0.0)  # [..., ns, sub, sub]
    dkk = (ks[..., :, None, :] * KE).sum(-1).masked_fill(~strict, 0.0)  # [..., ns, sub, sub]

    # Off-diagonal sub-blocks through the reference point r = first token of each sub-chunk.
    col = torch.arange(C, device=q.device)  # [C]
    start = torch.arange(ns, device=q.device) * sub  # [ns]
    before = col[None, :] < start[:, None]  # [ns, C] column i lies in an earlier sub-chunk than the row block
    Gr = Gs[..., :, :1, :]  # [..., ns, 1, D] G at each sub-chunk's first token
    e_left = torch.exp(Gs - Gr)  # [..., ns, sub, D] exp(G_t - G_r) <= 1
    e_right = (Gr - G[..., None, :, :]).masked_fill(~before[:, :, None], 0.0)  # [..., ns(block of t), C(i), D]
    right_t = (k[..., None, :, :] * torch.exp(e_right)).transpose(-1, -2)  # [..., ns, D, C] exp(G_r - G_i) <= 1

    eye = torch.eye(ns, dtype=torch.bool, device=q.device)  # [ns, ns]

    def assemble(x_s: torch.Tensor, diag: torch.Tensor) -> torch.Tensor:
        off = (x_s * e_left) @ right_t  # [..., ns, sub, C]
        off = off.masked_fill(~before[:, None, :], 0.0)  # [..., ns, sub, C]
        off = off.reshape(*lead, ns, sub, ns, sub)  # [..., ns, sub, ns, sub]
        A = torch.where(eye[:, None, :, None], diag[..., :, :, None, :], off)  # [..., ns, sub, ns, sub]
        return A.reshape(*lead, C, C)

    return assemble(ks, dkk), assemble(qs, dqk)


def kda_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: Optional[torch.Tensor] = None,
    chunk: int = 64,
    sub: int = 16,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Chunk-parallel form of kda_recurrent (same arguments and results), for training on long sequences.

    WY / UT-transform algorithm, in float32. Transposing the state to S [Dk, Dv], within a chunk with start state
    S0 and G_t = cumulative log decay from the chunk start through t (a Dk vector):
        S_t = Diag(e^G_t) (S0 + sum_{i<=t} (k_i e^-G_i) u_i^T)           (u_i: the chunk's "pseudo-values")
        u_t = beta_t (v_t - S0^T (k_t e^G_t) - sum_{i<t} A_ti u_i),   A_ti = sum_d k_t k_i e^(G_t - G_i)
    so (I + Diag(beta) A) U = Diag(beta) (V - K~ S0), K~_t = k_t e^G_t. With T = (I + Diag(beta) A)^-1 (unit lower
    triangular: one batched triangular solve), W = T Diag(beta) K~ and U~ = T Diag(beta) V, U = U~ - W S0, and
        O = Q~ S0 + (Aqk (.) causal) U,      Q~_t = q_t e^G_t,  Aqk_ti = sum_d q_t k_i e^(G_t - G_i)
        S_end = Diag(e^G_C) S0 + (K e^(G_C - G))^T U.
    Everything except the S0 terms is computed for all chunks at once; only the state hand-over runs over chunks.
    Every exponential taken is of a non-positive number (see _intra_chunk_scores)."""
    assert chunk % sub == 0
    with _no_autocast(q.device):
        out_dtype = q.dtype
        B, T, H, Dk = q.shape
        Dv = v.shape[-1]
        pad = (-T) % chunk
        q, k, v, log_g, beta = (f32(t) for t in (q, k, v, log_g, beta))  # shapes as given, float32
        if pad:
            # Trailing padding cannot reach earlier outputs: k = 0 and beta = 0 write nothing, log_g = 0 keeps S.
            q = F.pad(q, (0, 0, 0, 0, 0, pad))  # [B, Tp, H, Dk]
            k = F.pad(k, (0, 0, 0, 0, 0, pad))  # [B, Tp, H, Dk]
            v = F.pad(v, (0, 0, 0, 0, 0, pad))  # [B, Tp, H, Dv]
            log_g = F.pad(log_g, (0, 0, 0, 0, 0, pad))  # [B, Tp, H, Dk]
            beta = F.pad(beta, (0, 0, 0, pad))  # [B, Tp, H]
        N = (T + pad) // chunk

        def chunks(t: torch.Tensor) -> torch.Tensor:  # [B, Tp, H, X] -> [B, H, N, C, X]
            return t.transpose(1, 2).reshape(B, H, N, chunk, t.shape[-1])

        q, k, v, log_g = chunks(q), chunks(k), chunks(v), chunks(log_g)  # [B, H, N, C, D*]
        beta = beta.transpose(1, 2).reshape(B, H, N, chunk, 1)  # [B, H, N, C, 1]

        G = log_g.cumsum(dim=-2)  # [B, H, N, C, Dk] cumulative log decay within the chunk, inclusive
        Akk, Aqk = _intra_chunk_scores(q, k, G, sub)  # [B, H, N, C, C] each: strictly lower, lower

        eye = torch.eye(chunk, dtype=q.dtype, device=q.device)  # [C, C]
        L = eye + beta * Akk  # [B, H, N, C, C] unit lower triangular
        eG = torch.exp(G)  # [B, H, N, C, Dk] decay from the chunk start, <= 1
        rhs = torch.cat([beta * k * eG, beta * v], dim=-1)  # [B, H, N, C, Dk + Dv]
        sol = torch.linalg.solve_triangular(L, rhs, upper=False, unitriangular=True)  # [B, H, N, C, Dk + Dv]
        W, U0 = sol[..., :Dk], sol[..., Dk:]  # [B, H, N, C, Dk], [B, H, N, C, Dv]

        q_dec = q * eG  # [B, H, N, C, Dk]
        k_tail = k * torch.exp(G[..., -1:, :] - G)  # [B, H, N, C, Dk] decay from each token to the chunk end
        g_end = torch.exp(G[..., -1, :])  # [B, H, N, Dk] decay over the whole chunk

        S = (
            f32(initial_state).transpose(-1, -2)
            if initial_state is not None
            else q.new_zeros(B, H, Dk, Dv)
        )  # [B, H, Dk, Dv]
        outs = []  # N x [B, H, C, Dv]
        for n in range(N):
            U = U0[:, :, n] - W[:, :, n] @ S  # [B, H, C, Dv]
            outs.append(q_dec[:, :, n] @ S + Aqk[:, :, n] @ U)  # [B, H, C, Dv]
            S = g_end[:, :, n, :, None] * S + k_tail[:, :, n].transpose(-1, -2) @ U  # [B, H, Dk, Dv]
        o = torch.stack(outs, dim=2)  # [B, H, N, C, Dv]
        o = o.reshape(B, H, N * chunk, Dv)[:, :, :T].transpose(1, 2)  # [B, T, H, Dv]
    return o.to(out_dtype), S.transpose(-1, -2)


class KimiDeltaAttention(nn.Module):
    """KimiK3DeltaAttention. HF names: q/k/v_proj, q/k/v_conv1d, f_a/f_b_proj, b_proj, g_proj (or g_a/g_b_proj),
    A_log, dt_bias, o_norm, o_proj. (mlx-lm fuses q/k/v into qkv_proj/qkv_conv at load; the maths is per part.)"""

    def __init__(self, cfg: K3Config):
        super().__init__()
        lac = cfg.linear_attn_config
        self.num_heads = H = lac["num_heads"]
        self.head_dim = D = lac["head_dim"]
        self.conv_kernel = K = lac["short_conv_kernel_size"]
        self.lower_bound = lac.get("gate_lower_bound", None)
        self.use_full_rank_gate = lac.get("use_full_rank_gate", False)
        P = H * D
        hidden = cfg.hidden_size
        self.q_proj = nn.Linear(hidden, P, bias=False)  # weight [P, H]
        self.k_proj = nn.Linear(hidden, P, bias=False)  # weight [P, H]
        self.v_proj = nn.Linear(hidden, P, bias=False)  # weight [P, H]
        # depthwise causal convs; torch's depthwise weight [P, 1, K] is the checkpoint's layout as stored
        self.q_conv1d = nn.Conv1d(P, P, K, groups=P, bias=False)  # weight [P, 1, K]
        self.k_conv1d = nn.Conv1d(P, P, K, groups=P, bias=False)  # weight [P, 1, K]
        self.v_conv1d = nn.Conv1d(P, P, K, groups=P, bias=False)  # weight [P, 1, K]
        self.f_a_proj = nn.Linear(hidden, D, bias=False)  # weight [D, H] low-rank decay logits
        self.f_b_proj = nn.Linear(D, P, bias=False)  # weight [P, D]
        self.b_proj = nn.Linear(hidden, H, bias=False)  # weight [heads, H] beta logits
        if self.use_full_rank_gate:
            self.g_proj = nn.Linear(hidden, P, bias=False)  # weight [P, H] output gate
        else:
            self.g_a_proj = nn.Linear(hidden, D, bias=False)  # weight [D, H]
            self.g_b_proj = nn.Linear(D, P, bias=False)  # weight [P, D]
        self.A_log = nn.Parameter(torch.log(torch.empty(H).uniform_(1.0, 16.0)))  # [heads] mlx-lm's init
        self.dt_bias = nn.Parameter(torch.zeros(P))  # [P]
        self.o_norm = RMSNorm(D, cfg.rms_norm_eps)  # weight [D], shared by the heads
        self.o_proj = nn.Linear(P, hidden, bias=False)  # weight [H, P]
        self.mode = "chunk"  # "chunk" (training) or "recurrent" (reference); set by K3ForCausalLM.set_kda_mode

    def _short_conv(self, conv: nn.Conv1d, x: torch.Tensor) -> torch.Tensor:
        """ShortConv1d from a zero state: SiLU of the causal depthwise conv over (K-1 zeros, x)."""
        xt = F.pad(x.transpose(1, 2), (self.conv_kernel - 1, 0))  # [B, P, T + K - 1]
        return F.silu(conv(xt)).transpose(1, 2)  # [B, T, P]

    def log_decay(self, a: torch.Tensor) -> torch.Tensor:
        """log g from the decay logits a [B, T, heads, D] (gated_delta.compute_g / compute_lower_bound_g, taken in
        log space: the chunked form needs log g, and the recurrent one exponentiates it exactly as mlx-lm does)."""
        H, D = self.num_heads, self.head_dim
        A = torch.exp(f32(self.A_log)).view(H, 1)  # [heads, 1]
        z = f32(a) + f32(self.dt_bias).view(H, D)  # [B, T, heads, D]
        if self.lower_bound is None:
            return -A * F.softplus(z)  # [B, T, heads, D] g = exp(-exp(A_log) softplus(a + dt_bias))
        return self.lower_bound * torch.sigmoid(A * z)  # [B, T, heads, D] g = exp(lb sigmoid(exp(A_log)(a + dt)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        H, D = self.num_heads, self.head_dim
        q = self._short_conv(self.q_conv1d, self.q_proj(x)).reshape(B, T, H, D)  # [B, T, heads, D]
        k = self._short_conv(self.k_conv1d, self.k_proj(x)).reshape(B, T, H, D)  # [B, T, heads, D]
        v = self._short_conv(self.v_conv1d, self.v_proj(x)).reshape(B, T, H, D)  # [B, T, heads, D]
        # gated_delta.normalize_qk(eps=1e-6): q = scale^2 * rms_norm(q, eps=1e-6/D), k = scale * rms_norm(k, same),
        # scale = D^-1/2; i.e. both L2-normalised with 1e-6 added to the sum of squares, and q also scaled by D^-1/2
        # (the readout scale). Kept in float32 from here on (under bf16 autocast too): they feed the recurrence.
        scale = float(D) ** -0.5
        eps = 1e-6 / D
        q = (scale**2) * rms_norm(f32(q), None, eps)  # [B, T, heads, D]
        k = scale * rms_norm(f32(k), None, eps)  # [B, T, heads, D]
        a = self.f_b_proj(self.f_a_proj(x)).reshape(B, T, H, D)  # [B, T, heads, D]
        beta = torch.sigmoid(f32(self.b_proj(x)))  # [B, T, heads]
        log_g = self.log_decay(a)  # [B, T, heads, D]
        core = kda_chunk if self.mode == "chunk" else kda_recurrent
        o, _ = core(q, k, v, log_g, beta)  # [B, T, heads, D]
        if self.use_full_rank_gate:
            gate = self.g_proj(x)  # [B, T, P]
        else:
            gate = self.g_b_proj(self.g_a_proj(x))  # [B, T, P]
        gate = gate.reshape(B, T, H, D)  # [B, T, heads, D]
        o = self.o_norm(o.to(x.dtype)) * torch.sigmoid(gate)  # [B, T, heads, D]
        return self.o_proj(o.reshape(B, T, H * D))  # [B, T, H]


# ----------------------------------------------------------------------------------------------------------------
# NoPE MLA
# ----------------------------------------------------------------------------------------------------------------


class MLAAttention(nn.Module):
    """KimiK3MLAAttention with mla_use_nope: DeepSeek-style MLA with no rotary embedding at all. The "rope" part of
    q and the shared k_pe still exist and still add q_pe . k_pe to the scores, just unrotated, so the score is
    scale * [q_nope, q_pe] . [k_nope, k_pe] with scale = (nope + rope)^-1/2: one ordinary causal attention.
    mlx-lm keeps kv_b_proj split per head (embed_q / unembed_out, absorbed into q for single-token decode); it is
    the same product, kept here as the checkpoint's kv_b_proj."""

    def __init__(self, cfg: K3Config):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.nope = cfg.qk_nope_head_dim
        self.rope = cfg.qk_rope_head_dim
        self.v_dim = cfg.v_head_dim
        self.q_lora_rank = cfg.q_lora_rank
        self.kv_lora_rank = cfg.kv_lora_rank
        self.use_gate = cfg.mla_use_output_gate
        self.scale = (self.nope + self.rope) ** -0.5
        nh, hidden = self.num_heads, cfg.hidden_size
        if self.q_lora_rank is not None:
            self.q_a_proj = nn.Linear(hidden, self.q_lora_rank, bias=False)  # weight [q_lora, H]
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, eps=1e-6)  # mlx-lm hard-codes 1e-6 here
            self.q_b_proj = nn.Linear(self.q_lora_rank, nh * (self.nope + self.rope), bias=False)
        else:
            self.q_proj = nn.Linear(hidden, nh * (self.nope + self.rope), bias=False)  # weight [nh*(n+r), H]
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.kv_lora_rank + self.rope, bias=False)  # [kvl + r, H]
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, eps=1e-6)  # mlx-lm hard-codes 1e-6 here
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, nh * (self.nope + self.v_dim), bias=False)  # [nh*(n+v), kvl]
        self.o_proj = nn.Linear(nh * self.v_dim, hidden, bias=False)  # weight [H, nh*v]
        if self.use_gate:
            self.g_proj = nn.Linear(hidden, nh * self.v_dim, bias=False)  # weight [nh*v, H]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        nh, nope, rope, vd = self.num_heads, self.nope, self.rope, self.v_dim
        if self.q_lora_rank is not None:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))  # [B, T, nh*(nope+rope)]
        else:
            q = self.q_proj(x)  # [B, T, nh*(nope+rope)]
        q = q.reshape(B, T, nh, nope + rope).transpose(1, 2)  # [B, nh, T, nope+rope] = [q_nope | q_pe]
        ckv = self.kv_a_proj_with_mqa(x)  # [B, T, kvl + rope]
        latent, k_pe = ckv.split([self.kv_lora_rank, rope], dim=-1)  # [B, T, kvl], [B, T, rope]
        kv = self.kv_b_proj(self.kv_a_layernorm(latent))  # [B, T, nh*(nope+v)]
        kv = kv.reshape(B, T, nh, nope + vd).transpose(1, 2)  # [B, nh, T, nope+v]
        k_nope, v = kv.split([nope, vd], dim=-1)  # [B, nh, T, nope], [B, nh, T, v]
        k_pe = k_pe[:, None].expand(B, nh, T, rope)  # [B, nh, T, rope] one k_pe shared by all heads (MQA)
        k = torch.cat([k_nope, k_pe], dim=-1)  # [B, nh, T, nope+rope]
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)  # [B, nh, T, v]
        o = o.transpose(1, 2).reshape(B, T, nh * vd)  # [B, T, nh*v]
        if self.use_gate:
            o = o * torch.sigmoid(self.g_proj(x))  # [B, T, nh*v]
        return self.o_proj(o)  # [B, T, H]


# ----------------------------------------------------------------------------------------------------------------
# Latent MoE
# ----------------------------------------------------------------------------------------------------------------


def select_experts(
    logits: torch.Tensor,
    bias: Optional[torch.Tensor],
    top_k: int,
    n_group: int,
    topk_group: int,
    routed_scaling_factor: float,
    renormalize: bool,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """mlx-lm _group_expert_select. logits [N, E] -> (expert ids [N, k], weights [N, k]), float32.
    The bias steers the choice only; the weights are the chosen experts' unbiased sigmoid scores. (Like mlx-lm,
    this ignores config.use_grouped_topk and groups whenever num_expert_group > 1.)"""
    scores = torch.sigmoid(f32(logits))  # [N, E]
    choice = scores + f32(bias) if bias is not None else scores  # [N, E]
    if n_group > 1:
        N, E = choice.shape
        grouped = choice.view(N, n_group, E // n_group)  # [N, groups, E/groups]
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # [N, groups] sum of each group's best two
        drop = group_scores.topk(n_group - topk_group, dim=-1, largest=False).indices  # [N, groups - topk_group]
        # mlx-lm writes 0.0 (not -inf) into the dropped groups' scores; kept as is
        grouped = grouped.scatter(1, drop[..., None].expand(-1, -1, E // n_group), 0.0)  # [N, groups, E/groups]
        choice = grouped.reshape(N, E)  # [N, E]
    idx = choice.topk(top_k, dim=-1).indices  # [N, k]
    w = scores.gather(-1, idx)  # [N, k]
    if top_k > 1 and renormalize:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)  # [N, k]
    return idx, w * routed_scaling_factor


class RouterGate(nn.Module):
    """block_sparse_moe.gate: the router matrix and its selection bias (`gate.e_score_correction_bias` in the
    checkpoint). The bias is a buffer: it is not trained by gradients but by update_router_bias."""

    def __init__(self, hidden: int, experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, hidden))  # [E, H]
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        self.register_buffer("e_score_correction_bias", torch.zeros(experts))  # [E] float32


class Expert(nn.Module):
    """One routed expert, as compressed-tensors names them: w1 = gate, w3 = up, w2 = down (in the latent space)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)  # weight [I, LAT]
        self.w2 = nn.Linear(hidden, dim, bias=False)  # weight [LAT, I]
        self.w3 = nn.Linear(dim, hidden, bias=False)  # weight [I, LAT]


class LatentMoE(nn.Module):
    """KimiK3SparseMoE: y = up(norm(sum_k w_k E_k(down(x)))) + shared(x); the router reads the full hidden x."""

    def __init__(self, cfg: K3Config):
        super().__init__()
        self.cfg = cfg
        hidden, E = cfg.hidden_size, cfg.num_experts
        self.latent = cfg.routed_expert_hidden_size
        expert_dim = self.latent or hidden
        self.gate = RouterGate(hidden, E)
        self.experts = nn.ModuleList(Expert(expert_dim, cfg.moe_intermediate_size) for _ in range(E))
        if self.latent is not None:
            self.routed_expert_down_proj = nn.Linear(hidden, self.latent, bias=False)  # weight [LAT, H]
            self.routed_expert_up_proj = nn.Linear(self.latent, hidden, bias=False)  # weight [H, LAT]
            if cfg.latent_moe_use_norm:
                self.routed_expert_norm = RMSNorm(self.latent, cfg.rms_norm_eps)  # weight [LAT]
        if cfg.num_shared_experts:
            self.shared_experts = GatedMLP(
                hidden, cfg.moe_intermediate_size * cfg.num_shared_experts, cfg.situ_beta,
                cfg.activation_situ_linear_beta,
            )
        # Not state: the last forward's choices (for traces) and the token counts per expert accumulated in
        # training mode since the last update_router_bias.
        self.last_topk: Optional[torch.Tensor] = None  # [B, T, k]
        self.register_buffer("expert_load", torch.zeros(E), persistent=False)  # [E]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        B, T, Hd = x.shape
        xf = x.reshape(B * T, Hd)  # [N, H]
        with _no_autocast(x.device):
            logits = F.linear(f32(xf), f32(self.gate.weight))  # [N, E] the router runs in float32
            idx, w = select_experts(
                logits, self.gate.e_score_correction_bias, cfg.num_experts_per_token, cfg.num_expert_group,
                cfg.topk_group, cfg.routed_scaling_factor, cfg.moe_renormalize,
            )  # [N, k], [N, k]
        k = idx.shape[-1]
        self.last_topk = idx.detach().view(B, T, k)  # [B, T, k]
        if self.training:
            with torch.no_grad():
                self.expert_load += torch.bincount(idx.flatten(), minlength=cfg.num_experts).to(self.expert_load)

        y = self.routed_expert_down_proj(xf) if self.latent is not None else xf  # [N, LAT]
        # Group the (token, slot) pairs by expert and run each expert once on its tokens.
        flat = idx.flatten()  # [N*k]
        order = torch.argsort(flat, stable=True)  # [N*k]
        counts = torch.bincount(flat, minlength=cfg.num_experts).tolist()  # E ints (one host sync)
        tok = order // k  # [N*k] token of each sorted pair
        wts = w.flatten()[order]  # [N*k] its routing weight
        out = torch.zeros(xf.shape[0], y.shape[-1], dtype=wts.dtype, device=x.device)  # [N, LAT] summed in f32
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            t_e = tok[start : start + n]  # [n]
            ex = self.experts[e]
            ye = y[t_e]  # [n, LAT]
            h = ex.w2(situ(ex.w3(ye), ex.w1(ye), cfg.situ_beta, cfg.activation_situ_linear_beta))  # [n, LAT]
            out.index_add_(0, t_e, f32(h) * wts[start : start + n, None])  # [N, LAT]
            start += n
        out = out.to(y.dtype)  # [N, LAT]
        if getattr(self, "routed_expert_norm", None) is not None:
            out = self.routed_expert_norm(out)  # [N, LAT] after the weighted sum (and the scaling factor)
        if self.latent is not None:
            out = self.routed_expert_up_proj(out)  # [N, H]
        if cfg.num_shared_experts:
            out = out + self.shared_experts(xf)  # [N, H]
        return out.reshape(B, T, Hd)


# ----------------------------------------------------------------------------------------------------------------
# Block attention residuals, decoder layer, model
# ----------------------------------------------------------------------------------------------------------------


def attn_res_mix(blocks: List[torch.Tensor], partial: torch.Tensor, w_eff: torch.Tensor, eps: float) -> torch.Tensor:
    """_attn_res_combine: a per-position softmax over the stored block inputs and the running partial sum, with
    logits w_eff . x / rms(x) (w_eff = res_norm.weight * res_proj.weight, i.e. res_proj(res_norm(x))).
    blocks: list of [B, T, H]; partial [B, T, H]; w_eff [H] -> [B, T, H]. With no block yet: partial itself."""
    if not blocks:
        return partial
    cand = torch.stack(blocks + [partial], dim=0)  # [K+1, B, T, H]
    cf = f32(cand)  # [K+1, B, T, H]
    logits = (cf @ w_eff) * torch.rsqrt(cf.pow(2).mean(-1) + eps)  # [K+1, B, T]
    p = torch.softmax(logits, dim=0)  # [K+1, B, T]
    return (p[..., None] * cf).sum(0).to(partial.dtype)  # [B, T, H]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: K3Config, idx: int):
        super().__init__()
        self.idx = idx
        self.eps = cfg.rms_norm_eps
        self.is_linear = cfg.is_kda(idx)
        self.self_attn = KimiDeltaAttention(cfg) if self.is_linear else MLAAttention(cfg)
        if cfg.is_moe(idx):
            self.block_sparse_moe = LatentMoE(cfg)  # the checkpoint's name (mlx-lm renames it to mlp)
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.situ_beta, cfg.activation_situ_linear_beta)
        H = cfg.hidden_size
        self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps)  # weight [H]
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps)  # weight [H]
        self.use_attn_res = cfg.attn_res_block_size is not None
        if self.use_attn_res:
            self.is_block_start = idx % cfg.attn_res_block_size == 0
            self.self_attention_res_proj = nn.Linear(H, 1, bias=False)  # weight [1, H]
            self.self_attention_res_norm = RMSNorm(H, cfg.rms_norm_eps)  # weight [H]
            self.mlp_res_proj = nn.Linear(H, 1, bias=False)  # weight [1, H]
            self.mlp_res_norm = RMSNorm(H, cfg.rms_norm_eps)  # weight [H]

    @property
    def ffn(self) -> nn.Module:
        return self.block_sparse_moe if hasattr(self, "block_sparse_moe") else self.mlp

    def forward(self, x: torch.Tensor, blocks: List[torch.Tensor]) -> torch.Tensor:
        """x [B, T, H] -> [B, T, H]. `blocks` (the stored block inputs, each [B, T, H]) is appended to in place."""
        if not self.use_attn_res:
            h = x + self.self_attn(self.input_layernorm(x))  # [B, T, H]
            return h + self.ffn(self.post_attention_layernorm(h))  # [B, T, H]
        w_attn = f32(self.self_attention_res_norm.weight) * f32(self.self_attention_res_proj.weight).view(-1)  # [H]
        w_mlp = f32(self.mlp_res_norm.weight) * f32(self.mlp_res_proj.weight).view(-1)  # [H]
        partial: Optional[torch.Tensor] = x  # [B, T, H] running sum of the current block's sub-layer outputs
        h = attn_res_mix(blocks, partial, w_attn, self.eps)  # [B, T, H]
        if self.is_block_start:
            # the previous block's sum becomes a stored block; the new block starts from nothing
            blocks.append(partial)
            partial = None
        y = self.self_attn(self.input_layernorm(h))  # [B, T, H]
        partial = y if partial is None else partial + y  # [B, T, H]
        h = attn_res_mix(blocks, partial, w_mlp, self.eps)  # [B, T, H]
        return partial + self.ffn(self.post_attention_layernorm(h))  # [B, T, H]


class K3TextModel(nn.Module):
    """language_model.model: embed_tokens, layers, the output attention-residual mix, norm."""

    def __init__(self, cfg: K3Config):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)  # weight [V, H]
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # weight [H]
        self.use_attn_res = cfg.attn_res_block_size is not None
        if self.use_attn_res:
            self.output_attn_res_proj = nn.Linear(cfg.hidden_size, 1, bias=False)  # weight [1, H]
            self.output_attn_res_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # weight [H]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)  # [B, T, H]
        blocks: List[torch.Tensor] = []  # each [B, T, H]
        for layer in self.layers:
            h = layer(h, blocks)  # [B, T, H]
        if self.use_attn_res:
            w_out = f32(self.output_attn_res_norm.weight) * f32(self.output_attn_res_proj.weight).view(-1)  # [H]
            h = attn_res_mix(blocks, h, w_out, self.cfg.rms_norm_eps)  # [B, T, H]
        return self.norm(h)  # [B, T, H]


class K3LanguageModel(nn.Module):
    def __init__(self, cfg: K3Config):
        super().__init__()
        self.model = K3TextModel(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)  # weight [V, H]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.model(input_ids)  # [B, T, H]
        if hasattr(self, "lm_head"):
            return self.lm_head(h)  # [B, T, V]
        return F.linear(h, self.model.embed_tokens.weight)  # [B, T, V]


class K3ForCausalLM(nn.Module):
    """The text part of KimiK3ForConditionalGeneration; top-level `language_model` as in the checkpoint."""

    def __init__(self, cfg: K3Config):
        super().__init__()
        self.cfg = cfg
        self.language_model = K3LanguageModel(cfg)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [B, T] (int64) -> logits [B, T, V]; position t sees tokens 0..t (teacher forcing)."""
        return self.language_model(input_ids)

    @property
    def layers(self) -> nn.ModuleList:
        return self.language_model.model.layers

    def set_kda_mode(self, mode: str) -> None:
        """'chunk' (chunk-parallel, for training) or 'recurrent' (token by token, the reference)."""
        assert mode in ("chunk", "recurrent")
        for layer in self.layers:
            if layer.is_linear:
                layer.self_attn.mode = mode

    def moe_layers(self) -> Dict[int, LatentMoE]:
        return {i: l.block_sparse_moe for i, l in enumerate(self.layers) if hasattr(l, "block_sparse_moe")}

    def router_choices(self) -> Dict[int, torch.Tensor]:
        """Experts the router chose in the last forward, per MoE layer index: {layer: ids [B, T, k]}."""
        return {i: m.last_topk for i, m in self.moe_layers().items()}

    @torch.no_grad()
    def update_router_bias(self, u: float = 1e-3) -> Dict[int, torch.Tensor]:
        """Auxiliary-loss-free load balancing (DeepSeek-V3 / Kimi): per MoE layer, with `load` the tokens each expert
        received in training-mode forwards since the last call, e_score_correction_bias += u * sign(mean(load) -
        load), then the counts restart. Call it after optimizer.step(). Returns the loads used, {layer: [E]}."""
        loads = {}
        for i, m in self.moe_layers().items():
            load = m.expert_load.clone()  # [E]
            bias = m.gate.e_score_correction_bias  # [E]
            bias += (u * torch.sign(load.mean() - load)).to(bias.dtype)
            m.expert_load.zero_()
            loads[i] = load
        return loads


@torch.no_grad()
def init_weights(model: K3ForCausalLM, std: float = 0.02, seed: Optional[int] = None) -> None:
    """A plain initialisation for training from scratch: matrices and embeddings N(0, std^2) (output projections
    scaled down by sqrt(2 * layers)), norms 1, A_log = log U(1, 16) and dt_bias 0 (mlx-lm's own inits), conv taps
    as torch's default, router bias 0. Not part of mlx-lm; any reasonable choice works."""
    if seed is not None:
        torch.manual_seed(seed)
    n_layers = model.cfg.num_hidden_layers
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.copy_(torch.log(torch.empty_like(p).uniform_(1.0, 16.0)))
        elif name.endswith("dt_bias"):
            p.zero_()
        elif "conv1d" in name:
            nn.init.kaiming_uniform_(p, a=math.sqrt(5))
        elif p.ndim == 1:  # RMSNorm weights
            p.fill_(1.0)
        elif name.endswith(("o_proj.weight", "down_proj.weight", ".w2.weight", "routed_expert_up_proj.weight")):
            p.normal_(0.0, std / math.sqrt(2 * n_layers))
        else:
            p.normal_(0.0, std)
    for m in model.moe_layers().values():
        m.gate.e_score_correction_bias.zero_()
        m.expert_load.zero_()


# ----------------------------------------------------------------------------------------------------------------
# MXFP4 (compressed-tensors "mxfp4-pack-quantized") and Hugging Face checkpoints
# ----------------------------------------------------------------------------------------------------------------

MXFP4_GROUP = 32
# E2M1 code -> value; bit 3 is the sign
E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float32)


def mxfp4_dequantize(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """packed uint8 [R, C/2] (element 2j in the low nibble of byte j), E8M0 scales uint8 [R, C/32] -> float32 [R, C]."""
    R = packed.shape[0]
    p = packed.to(torch.int64)  # [R, C/2]
    nib = torch.stack([p & 0xF, p >> 4], dim=-1).reshape(R, -1)  # [R, C]
    vals = E2M1.to(packed.device)[nib]  # [R, C]
    scale = torch.exp2(scales.to(torch.float32) - 127.0)  # [R, C/32]
    return (vals.view(R, -1, MXFP4_GROUP) * scale[..., None]).reshape(R, -1)  # [R, C]


def mxfp4_scale_exponent(amax: torch.Tensor) -> torch.Tensor:
    """Shared exponent of a group with largest magnitude amax: the smallest e with amax / 2^e <= 6, so nothing
    saturates. (The OCP MX spec's floor(log2(amax)) - 2 lets amax / 2^e reach 8 and clips it to 6: up to two
    scale steps of error on the largest weights.) Both rules give the same values for weights that are already
    MXFP4."""
    e = torch.ceil(torch.log2(amax.clamp_min(1e-38) / 6.0))  # [...]
    e = torch.where(amax > 0, e, torch.full_like(e, -127))  # [...] an all-zero group: any scale
    return e.clamp(-127, 127)  # [...] E8M0 stores e + 127 in 0..254 (255 is NaN)


def mxfp4_quantize(w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """float [R, C] -> (packed uint8 [R, C/2], scales uint8 [R, C/32]): per group of 32 a power-of-two scale
    (mxfp4_scale_exponent), elements rounded to the nearest E2M1 value. A tensor that came from
    mxfp4_dequantize quantises back to the same values."""
    R, C = w.shape
    wf = w.detach().float().reshape(R, C // MXFP4_GROUP, MXFP4_GROUP)  # [R, G, 32]
    e = mxfp4_scale_exponent(wf.abs().amax(-1))  # [R, G]
    x = wf / torch.exp2(e)[..., None]  # [R, G, 32] now |x| <= 6
    mags = E2M1[:8]  # [8]
    mids = (mags[1:] + mags[:-1]) / 2  # [7] decision points between neighbouring magnitudes
    code = torch.bucketize(x.abs().clamp(max=6.0), mids.to(x.device))  # [R, G, 32] 0..7
    code = code + 8 * ((x < 0) & (code > 0)).long()  # [R, G, 32] sign bit (no negative zero)
    code = code.reshape(R, C)  # [R, C]
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).to(torch.uint8)  # [R, C/2]
    return packed, (e + 127).to(torch.uint8)


# Tensors the release stores in float32 (the rest are bfloat16 matrices/norms), by name suffix.
_F32_SUFFIXES = ("A_log", "dt_bias", "conv1d.weight", "o_norm.weight", "e_score_correction_bias")


def _read_safetensors(path: Path) -> Dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    out: Dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


def hf_to_state_dict(raw: Dict[str, torch.Tensor], cfg: K3Config, dtype=torch.float32) -> Dict[str, torch.Tensor]:
    """Checkpoint tensors -> this module's state_dict, doing what mlx-lm's sanitize does that matters here: drop
    vision / projector / MTP tensors and layers past num_hidden_layers, rename `*_res.proj_weight|norm_weight`,
    dequantise MXFP4 experts, flatten and truncate A_log / dt_bias, reshape 2-D conv taps."""
    import re

    H = cfg.linear_attn_config["num_heads"] if cfg.linear_attn_config else 0
    layer_re = re.compile(r"language_model\.model\.layers\.(\d+)\.")
    sd: Dict[str, torch.Tensor] = {}
    for name, t in raw.items():
        if not name.startswith("language_model."):
            continue  # vision_tower.*, mm_projector.*, ...
        if name.startswith(("language_model.model.mtp", "language_model.mtp")):
            continue  # multi-token-prediction head: not part of the text model
        m = layer_re.match(name)
        if m and int(m.group(1)) >= cfg.num_hidden_layers:
            continue
        for src in ("self_attention_res", "mlp_res", "output_attn_res"):
            name = name.replace(f"{src}.proj_weight", f"{src}_proj.weight").replace(
                f"{src}.norm_weight", f"{src}_norm.weight"
            )
        if name.endswith(".weight_scale"):
            continue  # consumed with its weight_packed
        if name.endswith(".weight_packed"):
            base = name[: -len("weight_packed")]
            t = mxfp4_dequantize(t, raw[base + "weight_scale"])
            name = base + "weight"
        elif name.endswith(("A_log", "dt_bias")):
            t = t.reshape(-1)
            if name.endswith("A_log") and t.shape[0] > H:
                t = t[:H]  # the release pads A_log; only the first num_heads entries are real
        elif "conv1d.weight" in name and t.ndim == 2:
            t = t[:, None, :]
        if name == "language_model.lm_head.weight" and cfg.tie_word_embeddings:
            continue
        sd[name] = t.to(dtype)
    return sd


def load_hf(path, dtype=torch.float32, device="cpu") -> K3ForCausalLM:
    """Build the model from a Hugging Face K3 directory (config.json + *.safetensors) and load every tensor
    (strictly: a missing or unexpected key is an error)."""
    path = Path(path)
    cfg = K3Config.from_dict(json.loads((path / "config.json").read_text()))
    with torch.device("meta"):
        model = K3ForCausalLM(cfg)
    sd = hf_to_state_dict(_read_safetensors(path), cfg, dtype)
    model.load_state_dict(sd, strict=True, assign=True)
    # buffers that are not in the checkpoint were left on the meta device
    for m in model.moe_layers().values():
        m.expert_load = torch.zeros(cfg.num_experts)
    return model.to(device)


def hf_state_dict(model: K3ForCausalLM, mxfp4_experts: bool = True, dtype=torch.bfloat16) -> Dict[str, torch.Tensor]:
    """The model's tensors under the checkpoint's names: matrices and norms in `dtype`, the release's float32
    tensors in float32, routed experts as MXFP4 weight_packed / weight_scale (what Deltafin reads) or as float."""
    out: Dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        t = t.detach().cpu()
        if mxfp4_experts and ".experts." in name and name.endswith(".weight"):
            packed, scales = mxfp4_quantize(t)
            base = name[: -len("weight")]
            out[base + "weight_packed"], out[base + "weight_scale"] = packed, scales
        elif name.endswith(_F32_SUFFIXES):
            out[name] = t.float().contiguous()
        else:
            out[name] = t.to(dtype).contiguous()
    return out


def save_hf(model: K3ForCausalLM, out_dir, mxfp4_experts: bool = True, dtype=torch.bfloat16, extra_config=None):
    """Write config.json, one safetensors shard and model.safetensors.index.json in the checkpoint layout."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    sd = hf_state_dict(model, mxfp4_experts, dtype)
    text = model.cfg.to_text_dict()
    text["torch_dtype"] = str(dtype).replace("torch.", "")
    if mxfp4_experts:
        text["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
            "quantization_status": "compressed",
            "config_groups": {"group_0": {
                "format": "mxfp4-pack-quantized", "targets": ["Linear"], "input_activations": None,
                "output_activations": None,
                "weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": MXFP4_GROUP,
                            "symmetric": True, "dynamic": False, "scale_dtype": "torch.uint8"}}},
            # everything but the routed experts stays unquantised
            "ignore": ["lm_head", "re:.*embed_tokens.*", "re:.*self_attn.*", "re:.*shared_experts.*",
                       "re:.*mlp\\.(gate|up|down)_proj.*", "re:.*block_sparse_moe\\.gate$",
                       "re:.*routed_expert_(down|up)_proj.*", "re:.*_res_proj.*"],
        }
    config = {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
              "torch_dtype": text["torch_dtype"], "tie_word_embeddings": model.cfg.tie_word_embeddings,
              "text_config": text}
    if extra_config:
        config.update(extra_config)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    shard = "model-00001-of-000001.safetensors"
    save_file(sd, str(out_dir / shard), metadata={"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in sd.values())
    index = {"metadata": {"total_size": total}, "weight_map": {n: shard for n in sorted(sd)}}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out_dir
