#!/usr/bin/env python3
"""Build tiny random Kimi K3 checkpoints in the real Hugging Face layout and record mlx-lm reference outputs.

    python tools/make_fixtures.py                 # both fixtures into fixtures/
    python tools/make_fixtures.py --only k3-tiny  # one of them

Environment: tools/requirements-fixtures.txt (mlx[cpu] 0.32.4, mlx-lm 0.32.2, ...). Everything is seeded, so a
re-run rewrites byte-identical checkpoints and (on the same mlx build) the same reference numbers.

Per fixture NAME the output is
    fixtures/NAME/hf/                  config.json, generation_config.json, tokenizer_config.json, tiktoken.model,
                                       model-0000i-of-0000NN.safetensors, model.safetensors.index.json
    fixtures/NAME/reference.json       logits / greedy continuations from mlx-lm (f32 on CPU)
    fixtures/NAME/tokenizer_check.json texts and their ids per the `tiktoken` package

    python tools/make_fixtures.py --only k3-bench --no-reference --out /work/bench-data
                                                  # the bench checkpoint alone (numpy + safetensors only)

With --no-reference only NAME/hf/ is written (the spec's first seed, no mlx, no reference.json, no tokenizer check;
the BPE ranks are trained with a plain stdlib pre-tokeniser instead of K3's regex). k3-bench is built only that way.

What the two fixtures exercise beyond size:
  k3-tiny   gate_lower_bound (KDA gate = exp(lb * sigmoid(exp(A_log) * (a + dt_bias)))), routed_scaling_factor 1,
            shard data in the order the real release uses (safetensors' own order: dtype size descending, then
            name), so one expert's six U8 tensors are contiguous.
  k3-small  no gate_lower_bound (gate = exp(-exp(A_log) * softplus(a + dt_bias))), routed_scaling_factor 2.5,
            expert tensors deliberately SCATTERED in the shard data (all w1.weight_packed, then all
            w1.weight_scale, ...) and the JSON header written in name order rather than data order: a reader
            must go by data_offsets, never by position.
"""

import argparse
import base64
import collections
import json
import math
import struct
import zlib
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent

# --------------------------------------------------------------------------------------------------------------
# Fixture specifications
# --------------------------------------------------------------------------------------------------------------

SPECS = {
    "k3-tiny": dict(
        hidden=64, layers=8, kda_layers=[1, 2, 3, 5, 6, 7], full_attn_layers=[4, 8],
        kda_heads=4, kda_head_dim=16, mla_heads=4, q_lora=32, kv_lora=16, nope=8, rope=4, v=8,
        latent=32, moe_inter=32, inter=96, experts=16, top_k=4, attn_res_block=3,
        gate_lower_bound=-5.0, routed_scaling_factor=1.0, n_ranks=300, max_pos=4096,
        shard_layout="release", seed=27,
    ),
    "k3-small": dict(
        hidden=128, layers=10, kda_layers=[1, 2, 3, 5, 6, 7, 9], full_attn_layers=[4, 8, 10],
        kda_heads=4, kda_head_dim=32, mla_heads=4, q_lora=64, kv_lora=32, nope=16, rope=8, v=16,
        latent=64, moe_inter=64, inter=192, experts=32, top_k=6, attn_res_block=4,
        gate_lower_bound=None, routed_scaling_factor=2.5, n_ranks=500, max_pos=8192,
        shard_layout="scattered", seed=14,
    ),
    # Not a reference fixture: a bench checkpoint (about 3.6 GB) with Kimi K3's real routed-expert geometry
    # (latent 3584, moe_intermediate 3072: 17,547,264-byte MXFP4 records) and few layers and experts, for
    # `scripts/bench-install.sh`. Built with --no-reference (no mlx): 4 MoE layers x 48 experts, top-8.
    "k3-bench": dict(
        hidden=1024, layers=5, kda_layers=[1, 2, 3, 5], full_attn_layers=[4],
        kda_heads=8, kda_head_dim=64, mla_heads=8, q_lora=256, kv_lora=128, nope=64, rope=32, v=64,
        latent=3584, moe_inter=3072, inter=2048, experts=48, top_k=8, attn_res_block=3,
        gate_lower_bound=-5.0, routed_scaling_factor=2.5, n_ranks=500, max_pos=8192,
        shard_layout="release", seed=31, reference=False,
    ),
}

PROMPT_LENGTHS = [1, 5, 17, 40]
GREEDY_STEPS = 12
SHORT_CONV = 4
RMS_EPS = 1e-5
MXFP4_GROUP = 32

# A candidate seed is accepted only if the reference is robust to tiny numeric differences (a Rust f32 forward
# differs from mlx by ~1e-6 relative): every greedy pick wins by GREEDY_MIN_MARGIN logits, and every router
# decision separates the k-th from the (k+1)-th biased score by ROUTER_MIN_MARGIN. Otherwise the next seed is tried.
GREEDY_MIN_MARGIN = 1e-2
ROUTER_MIN_MARGIN = 1e-4
MAX_SEED_TRIES = 40

# --------------------------------------------------------------------------------------------------------------
# Tokenizer: a tiny byte-level BPE in tiktoken format
# --------------------------------------------------------------------------------------------------------------

# K3's pre-tokenisation regex, verbatim from MODELS.md. tiktoken (fancy-regex) accepts it as is; the Python
# `regex` module needs V1 mode for the `&&` class intersection.
K3_PAT = (
    r"[\p{Han}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

TRAINING_TEXT = """\
The lighthouse keeper's daughter walked down to the harbour every morning before the fishing boats went out.
She counted the boats, she counted the gulls, and she counted the waves that broke against the stone wall,
because her father had told her that a keeper who cannot count cannot keep anything at all. The harbour was
small and the town was smaller, but the light was the brightest on the whole northern coast, and ships that
had never seen the town still knew its light. In the winter the storms came from the west, and the keeper
climbed the tower twice every night to trim the wick and polish the glass. His daughter climbed with him,
carrying the oil can, and she learned the names of the stars that showed between the clouds. When she was
twelve years old her father fell ill, and for three weeks she kept the light alone. She slept in the
afternoons, she woke before the sun went down, and she did not miss a single night. The fishermen said
nothing, but every morning there was fresh bread on the step of the keeper's house, and once there was a
small wooden boat, carved by hand, with her name painted on the side. Years later, when the old light was
replaced by an electric lamp that needed no keeper, she still walked down to the harbour every morning. She
still counted the boats and the gulls and the waves, and she still told the children of the town that a
person who cannot count cannot keep anything at all. The children laughed, because they did not understand,
and then they grew up, and some of them went to sea, and some of them understood. In the spring of the year
the new lamp was lit, a ship lost its way in the fog and turned toward the shore, where the rocks were
waiting under the water. The new lamp was bright, but the fog was thick, and the ship could not see it. The
keeper's daughter heard the engines from her kitchen and knew at once that they were too close. She ran to
the old tower, climbed the stairs she had climbed a thousand times, and lit the old lamp with the last of the
oil she had kept for twenty years. The light was weak, and yellow, and it flickered, but it was low over the
water, under the fog, where the ship could see it. The captain turned away from the rocks, and in the morning
he walked up from the harbour to thank her. She gave him a cup of tea and told him that she had only counted
the seconds between the sound of his engines and the sound of the waves on the rocks, and that the numbers
had not been good. He said that he would remember to count, and she said that everyone says that.
"""

# tiktoken-style byte order: printable bytes first (so rank 0 is "!", as in K3), the rest after. rank != byte.
def _byte_order():
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    rest = [b for b in range(256) if b not in set(printable)]
    return printable + rest


def _pieces(text):
    import regex

    return regex.compile(K3_PAT, flags=regex.V1).findall(text)


# Without the `regex` package (--no-reference builds need only numpy and safetensors): a plain pre-tokeniser for
# the BPE training text. Any byte-level rank table is a valid tiktoken file; K3's own regex still splits text at
# run time. Used for every --no-reference build, so the output does not depend on what is installed.
PLAIN_PAT = r"[^\r\n\w]?[A-Za-z]+(?:'s|'t|'re|'ve|'m|'ll|'d)?|\d{1,3}| ?[^\s\w]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"


def _pieces_plain(text):
    import re

    return re.findall(PLAIN_PAT, text)


def train_bpe(text, n_ranks, pieces=_pieces):
    """Plain byte-level BPE: ranks 0..255 are single bytes (non-identity order), then merges in training order.
    Ties in pair frequency break on the byte strings, so the result is deterministic."""
    ranks = {bytes([b]): r for r, b in enumerate(_byte_order())}
    words = collections.Counter(tuple(bytes([b]) for b in p.encode("utf-8")) for p in pieces(text))
    while len(ranks) < n_ranks:
        pairs = collections.Counter()
        for w, c in words.items():
            for a, b in zip(w, w[1:]):
                pairs[(a, b)] += c
        if not pairs:
            raise RuntimeError(f"training text too short for {n_ranks} ranks (got {len(ranks)})")
        (a, b), _ = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))
        merged = a + b
        if merged not in ranks:  # the same bytes can arise from two different splits: keep the first rank
            ranks[merged] = len(ranks)
        new_words = collections.Counter()
        for w, c in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and w[i] == a and w[i + 1] == b:
                    out.append(merged)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            new_words[tuple(out)] += c
        words = new_words
    return ranks


def bpe_encode_reference(text, ranks):
    """Independent re-implementation of tiktoken's encoding (lowest-rank pair first), to check the file."""
    ids = []
    for piece in _pieces(text):
        data = piece.encode("utf-8")
        if data in ranks:
            ids.append(ranks[data])
            continue
        parts = [bytes([b]) for b in data]
        while True:
            best = None
            for i in range(len(parts) - 1):
                r = ranks.get(parts[i] + parts[i + 1])
                if r is not None and (best is None or r < best[0]):
                    best = (r, i)
            if best is None:
                break
            i = best[1]
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        ids.extend(ranks[p] for p in parts)
    return ids


def special_tokens(n_ranks):
    """Special ids start right after the BPE ranks, laid out like K3's (offsets from the first special id).
    vocab_size = n_ranks + slots, rounded up to a multiple of 16 with at least 16 slots."""
    vocab = ((n_ranks + 16 + 15) // 16) * 16
    slots = vocab - n_ranks
    named = {0: "[BOS]", 1: "[EOS]", 2: "<|end_of_msg|>", 3: "<|open|>", 4: "<|close|>", 5: "<|sep|>",
             6: "[start_header_id]", 7: "[end_header_id]", 9: "[EOT]",
             10: "<|media_begin|>", 11: "<|media_content|>", 12: "<|media_end|>", 13: "<|media_pad|>",
             slots - 2: "[UNK]", slots - 1: "[PAD]"}
    not_special = {"<|open|>", "<|close|>", "<|sep|>"}  # K3 marks the XTML delimiters special: false
    table = []
    for off in range(slots):
        tid = n_ranks + off
        name = named.get(off, f"<|reserved_token_{tid}|>")
        table.append(dict(id=tid, content=name, named=off in named, special=name not in not_special))
    return vocab, table


def write_tokenizer_configs(hf_dir, specials, max_pos):
    """tokenizer_config.json and generation_config.json as K3's: `specials` is a list of
    dict(id, content, named, special) (see special_tokens); the generation EOS is <|end_of_msg|>.
    Also used by tools/demo/tokenizer.py for the demo model."""
    by_name = {s["content"]: s["id"] for s in specials}
    # Like the real file, added_tokens_decoder lists only the named specials; the rest of the slots are implied
    # reserved tokens `<|reserved_token_ID|>` (K3's tokenization_kimi.py fills them in).
    decoder = {
        str(s["id"]): dict(content=s["content"], lstrip=False, normalized=False, rstrip=False,
                           single_word=False, special=s["special"])
        for s in specials if s["named"]
    }
    tok_cfg = {
        "added_tokens_decoder": decoder,
        "additional_special_tokens": ["<|end_of_msg|>", "<|open|>", "<|close|>", "<|sep|>"],
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "bos_token": "[BOS]",
        "clean_up_tokenization_spaces": False,
        "eos_token": "[EOS]",
        "extra_special_tokens": {},
        "model_max_length": max_pos,
        "pad_token": "[PAD]",
        "tokenizer_class": "TikTokenTokenizer",
        "unk_token": "[UNK]",
    }
    (hf_dir / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    gen_cfg = {"max_length": max_pos, "eos_token_id": by_name["<|end_of_msg|>"]}
    (hf_dir / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")
    return by_name


def write_tokenizer(hf_dir, n_ranks, max_pos, pieces=_pieces):
    ranks = train_bpe(TRAINING_TEXT, n_ranks, pieces)
    with open(hf_dir / "tiktoken.model", "w") as f:
        for tok, r in sorted(ranks.items(), key=lambda kv: kv[1]):
            f.write(f"{base64.b64encode(tok).decode()} {r}\n")
    vocab, specials = special_tokens(n_ranks)
    write_tokenizer_configs(hf_dir, specials, max_pos)
    return ranks, vocab, specials


def check_tokenizer(hf_dir, out_path, ranks, specials):
    """Load tiktoken.model back with the tiktoken package and K3's regex; cross-check with our own encoder."""
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    loaded = load_tiktoken_bpe(str(hf_dir / "tiktoken.model"))
    assert loaded == ranks, "tiktoken.model does not round-trip"
    enc = tiktoken.Encoding(
        name="k3-fixture", pat_str=K3_PAT, mergeable_ranks=loaded,
        special_tokens={s["content"]: s["id"] for s in specials},
    )
    texts = [
        "The lighthouse keeper's daughter counted the boats.",
        "Hello, world! It's 2026 and the year 1234567 has 7 digits.",
        "  leading spaces, trailing spaces   \n\nand blank lines\r\n",
        "HTTPServer DON'T we'll I'M camelCaseWords",
        "Unicode: naïve café, 中文字符, emoji 🚀🔥, tabs\tand\ttabs.",
        "harbour harbour harbour",
    ]
    chat = '<|open|>message role="user"<|sep|>Count the waves.<|close|>message<|sep|><|end_of_msg|>'
    cases = []
    for t in texts + [chat]:
        ids = enc.encode_ordinary(t)
        assert ids == bpe_encode_reference(t, ranks), f"tiktoken and the reference BPE disagree on {t!r}"
        assert enc.decode_bytes(ids) == t.encode("utf-8")
        cases.append({"text": t, "ids": ids})
    # Specials are recognised only when the caller allows them (tiktoken's allowed_special).
    cases.append({"text": chat, "allowed_special": "all", "ids": enc.encode(chat, allowed_special="all")})
    check = {
        "note": "ids from the `tiktoken` package (0.14.0) with K3's pre-tokenisation regex (accepted unchanged); "
                "'ids' = encode_ordinary (special strings are plain text); the last case recognises specials.",
        "pat_str": K3_PAT,
        "n_ranks": len(ranks),
        "first_ranks": [{"rank": r, "bytes_b64": base64.b64encode(t).decode()}
                        for t, r in sorted(ranks.items(), key=lambda kv: kv[1])[:3]],
        "special_tokens": [{"id": s["id"], "content": s["content"], "special": s["special"]} for s in specials],
        "cases": cases,
    }
    out_path.write_text(json.dumps(check, indent=1, ensure_ascii=False) + "\n")
    return enc


# --------------------------------------------------------------------------------------------------------------
# Number formats
# --------------------------------------------------------------------------------------------------------------

def bf16_bits(a):
    """f32 -> bf16 bit patterns, round to nearest even (the values here are finite)."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_to_f32(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)
E2M1_RMS = math.sqrt(float(np.mean(E2M1[:8] ** 2)))  # ~2.93 for uniformly random nibbles


def mxfp4_random(rng, rows, cols):
    """Random MXFP4 weight [rows, cols] as compressed-tensors stores it: packed U8 [rows, cols/2] with element 2j
    in the LOW nibble of byte j, E8M0 scales U8 [rows, cols/32]. The base exponent makes a row-dot-product with an
    O(1) input O(1); each group then gets 2^-2..2^0 of that, so groups differ."""
    nib = rng.integers(0, 16, size=(rows, cols), dtype=np.uint8)
    packed = (nib[:, 0::2] | (nib[:, 1::2] << 4)).astype(np.uint8)
    base = 127 + round(math.log2(1.0 / (E2M1_RMS * math.sqrt(cols))))
    scales = (base + rng.integers(-2, 1, size=(rows, cols // MXFP4_GROUP))).astype(np.uint8)
    assert scales.max() < 255  # 0xFF is NaN in E8M0
    return packed, scales


def mxfp4_decode(packed, scales):
    """Numpy MXFP4 decoder, independent of mlx: E2M1 magnitudes 0,.5,1,1.5,2,3,4,6, sign bit 3, scale 2^(e-127)."""
    rows = packed.shape[0]
    nib = np.empty((rows, packed.shape[1] * 2), dtype=np.uint8)
    nib[:, 0::2] = packed & 0x0F
    nib[:, 1::2] = packed >> 4
    vals = E2M1[nib]
    scale = np.exp2(scales.astype(np.float32) - 127.0)
    return (vals.reshape(rows, -1, MXFP4_GROUP) * scale[:, :, None]).reshape(rows, -1).astype(np.float32)


# --------------------------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------------------------

def make_config(s, vocab, specials):
    by_name = {t["content"]: t["id"] for t in specials}
    lac = {
        "kda_layers": s["kda_layers"],
        "full_attn_layers": s["full_attn_layers"],
        "num_heads": s["kda_heads"],
        "head_dim": s["kda_head_dim"],
        "short_conv_kernel_size": SHORT_CONV,
        "use_full_rank_gate": True,
    }
    if s["gate_lower_bound"] is not None:  # k3-small omits the key on purpose (the softplus gate path)
        lac["gate_lower_bound"] = s["gate_lower_bound"]
    quant = {
        "config_groups": {
            "group_0": {
                "format": "mxfp4-pack-quantized",
                "input_activations": None,
                "output_activations": None,
                "targets": ["Linear"],
                "weights": {
                    "actorder": None, "block_structure": None, "dynamic": False, "group_size": MXFP4_GROUP,
                    "num_bits": 4, "observer": "minmax", "observer_kwargs": {}, "scale_dtype": "torch.uint8",
                    "strategy": "group", "symmetric": True, "type": "float", "zp_dtype": None,
                },
            }
        },
        "format": "mxfp4-pack-quantized",
        "global_compression_ratio": None,
        # everything but the routed experts stays BF16/F32
        "ignore": [
            "lm_head",
            "re:.*embed_tokens.*",
            "re:.*self_attn.*",
            "re:.*shared_experts.*",
            "re:.*mlp\\.(gate|up|down)_proj.*",
            "re:.*block_sparse_moe\\.gate$",
            "re:.*routed_expert_(down|up)_proj.*",
            "re:.*_res_proj.*",
            "re:mm_projector.*",
            "re:vision_tower.*",
        ],
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "version": "0.12.2",
    }
    text = {
        "model_type": "kimi_linear",
        "vocab_size": vocab,
        "hidden_size": s["hidden"],
        "num_hidden_layers": s["layers"],
        "num_attention_heads": s["mla_heads"],
        "num_key_value_heads": s["mla_heads"],
        "intermediate_size": s["inter"],
        "rms_norm_eps": RMS_EPS,
        "max_position_embeddings": s["max_pos"],
        "linear_attn_config": lac,
        "hidden_act": "situ",
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        "attn_res_block_size": s["attn_res_block"],
        "q_lora_rank": s["q_lora"],
        "kv_lora_rank": s["kv_lora"],
        "qk_nope_head_dim": s["nope"],
        "qk_rope_head_dim": s["rope"],
        "v_head_dim": s["v"],
        "mla_use_nope": True,
        "mla_use_output_gate": True,
        "num_experts": s["experts"],
        "num_experts_per_token": s["top_k"],
        "num_shared_experts": 2,
        "moe_intermediate_size": s["moe_inter"],
        "moe_router_activation_func": "sigmoid",
        "moe_renormalize": True,
        "routed_scaling_factor": s["routed_scaling_factor"],
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
        "routed_expert_hidden_size": s["latent"],
        "latent_moe_use_norm": True,
        "tie_word_embeddings": False,
        "bos_token_id": by_name["[BOS]"],
        "eos_token_id": by_name["[EOS]"],
        "torch_dtype": "bfloat16",
        "quantization_config": quant,
    }
    vision = {  # a stub: the runtime is text-only; shapes match the stub tensors below
        "model_type": "moonvit",
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "patch_size": 2,
        "num_channels": 3,
        "mm_hidden_size": 16,
        "text_hidden_size": s["hidden"],
    }
    return {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
        "torch_dtype": "bfloat16",
        "transformers_version": "4.57.1",
        "tie_word_embeddings": False,
        "text_config": text,
        "vision_config": vision,
    }


# --------------------------------------------------------------------------------------------------------------
# Random weights
# --------------------------------------------------------------------------------------------------------------

class Weights:
    """name -> (safetensors dtype, numpy array). F32/BF16 arrays are held as f32 already rounded to what the file
    stores; U8 arrays as uint8. Each tensor draws from its own generator seeded by (seed, crc32(name)), so adding
    or reordering tensors never changes the others."""

    def __init__(self, seed):
        self.seed = seed
        self.t = {}

    def rng(self, name):
        return np.random.default_rng([self.seed, zlib.crc32(name.encode())])

    def bf16(self, name, a):
        self.t[name] = ("BF16", bf16_to_f32(bf16_bits(a)).reshape(a.shape))

    def f32(self, name, a):
        self.t[name] = ("F32", np.asarray(a, dtype=np.float32))

    def u8(self, name, a):
        self.t[name] = ("U8", np.asarray(a, dtype=np.uint8))

    # matrices ~ N(0, gain^2 / fan_in): an O(1) input gives an O(1) output
    def matrix(self, name, rows, cols, gain=1.0):
        self.bf16(name, self.rng(name).normal(0.0, gain / math.sqrt(cols), size=(rows, cols)))

    # norm weights ~ 1 + small noise (BF16 unless f32=True)
    def norm(self, name, n, f32=False):
        a = 1.0 + 0.1 * self.rng(name).normal(size=n)
        (self.f32 if f32 else self.bf16)(name, a)


def make_weights(s, vocab, seed):
    H, L, E = s["hidden"], s["layers"], s["experts"]
    heads, D = s["kda_heads"], s["kda_head_dim"]
    P = heads * D
    LAT, I = s["latent"], s["moe_inter"]
    nh, nope, rope, vd = s["mla_heads"], s["nope"], s["rope"], s["v"]
    w = Weights(seed)
    top = "language_model.model."

    for i in range(L):
        p = f"{top}layers.{i}."
        for n in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm", "mlp_res_norm"):
            w.norm(p + n + ".weight", H)
        # attention-residual projections: logit = proj . (norm * x / rms(x)); gain 1.5 gives logits of std ~1.5,
        # so the softmax over earlier blocks is clearly non-uniform
        w.matrix(p + "self_attention_res_proj.weight", 1, H, gain=1.5)
        w.matrix(p + "mlp_res_proj.weight", 1, H, gain=1.5)

        a = p + "self_attn."
        if (i + 1) in s["kda_layers"]:
            for n in ("q_proj", "k_proj", "v_proj", "g_proj"):
                w.matrix(a + n + ".weight", P, H)
            for n in ("q_conv1d", "k_conv1d", "v_conv1d"):
                w.f32(a + n + ".weight", 0.5 * w.rng(a + n).normal(size=(P, 1, SHORT_CONV)))
            w.matrix(a + "f_a_proj.weight", D, H)
            w.matrix(a + "f_b_proj.weight", P, D)
            w.matrix(a + "b_proj.weight", heads, H)
            w.norm(a + "o_norm.weight", D, f32=True)
            w.matrix(a + "o_proj.weight", H, P)
            w.f32(a + "dt_bias", 0.1 * w.rng(a + "dt_bias").normal(size=P))
            # A_log is stored [head_dim] long like the release; only the first num_heads entries are real
            a_log = np.zeros(D, dtype=np.float32)
            a_log[:heads] = np.log(w.rng(a + "A_log").uniform(1.0, 16.0, size=heads))
            w.f32(a + "A_log", a_log)
        else:
            w.matrix(a + "q_a_proj.weight", s["q_lora"], H)
            w.norm(a + "q_a_layernorm.weight", s["q_lora"])
            w.matrix(a + "q_b_proj.weight", nh * (nope + rope), s["q_lora"])
            w.matrix(a + "kv_a_proj_with_mqa.weight", s["kv_lora"] + rope, H)
            w.norm(a + "kv_a_layernorm.weight", s["kv_lora"])
            w.matrix(a + "kv_b_proj.weight", nh * (nope + vd), s["kv_lora"])
            w.matrix(a + "g_proj.weight", nh * vd, H)
            w.matrix(a + "o_proj.weight", H, nh * vd)

        if i == 0:  # first_k_dense_replace = 1
            w.matrix(p + "mlp.gate_proj.weight", s["inter"], H)
            w.matrix(p + "mlp.up_proj.weight", s["inter"], H)
            w.matrix(p + "mlp.down_proj.weight", H, s["inter"])
        else:
            m = p + "block_sparse_moe."
            w.matrix(m + "gate.weight", E, H, gain=1.5)
            w.f32(m + "gate.e_score_correction_bias", 0.05 * w.rng(m + "bias").normal(size=E))
            w.matrix(m + "routed_expert_down_proj.weight", LAT, H)
            w.norm(m + "routed_expert_norm.weight", LAT)
            w.matrix(m + "routed_expert_up_proj.weight", H, LAT)
            w.matrix(m + "shared_experts.gate_proj.weight", 2 * I, H)
            w.matrix(m + "shared_experts.up_proj.weight", 2 * I, H)
            w.matrix(m + "shared_experts.down_proj.weight", H, 2 * I)
            for e in range(E):
                for proj, rows, cols in (("w1", I, LAT), ("w2", LAT, I), ("w3", I, LAT)):
                    n = f"{m}experts.{e}.{proj}."
                    packed, scales = mxfp4_random(w.rng(n), rows, cols)
                    w.u8(n + "weight_packed", packed)
                    w.u8(n + "weight_scale", scales)

    w.bf16(top + "embed_tokens.weight", w.rng("embed").normal(size=(vocab, H)))
    w.norm(top + "norm.weight", H)
    w.norm(top + "output_attn_res_norm.weight", H)
    w.matrix(top + "output_attn_res_proj.weight", 1, H, gain=1.5)
    # gain 3: final logits with std ~3, so greedy picks are well separated
    w.matrix("language_model.lm_head.weight", vocab, H, gain=3.0)

    # Vision stubs, top-level names as in the release: mlx-lm's Model.sanitize drops keys starting with
    # "vision_tower" / "mm_projector" BEFORE it strips "language_model.", so they must not carry that prefix.
    w.norm("mm_projector.pre_norm.weight", 16)
    w.matrix("mm_projector.proj.0.weight", 32, 16)
    w.bf16("mm_projector.proj.0.bias", np.zeros(32))
    w.matrix("mm_projector.proj.2.weight", H, 32)
    w.bf16("mm_projector.proj.2.bias", np.zeros(H))
    w.bf16("vision_tower.patch_embed.proj.weight", 0.1 * w.rng("patch").normal(size=(16, 3, 2, 2)))
    w.bf16("vision_tower.patch_embed.proj.bias", np.zeros(16))
    w.norm("vision_tower.encoder.blocks.0.norm0.weight", 16)
    w.matrix("vision_tower.encoder.blocks.0.mlp.fc0.weight", 32, 16)
    return w.t


# --------------------------------------------------------------------------------------------------------------
# safetensors writer (own writer, so the data order is ours to choose)
# --------------------------------------------------------------------------------------------------------------

DTYPE_SIZE = {"F32": 4, "BF16": 2, "U8": 1}


def tensor_bytes(dtype, a):
    if dtype == "BF16":
        return bf16_bits(a).astype("<u2").tobytes()
    if dtype == "F32":
        return a.astype("<f4").tobytes()
    return a.astype(np.uint8).tobytes()


EXPERT_KIND_ORDER = ["w1.weight_packed", "w1.weight_scale", "w2.weight_packed", "w2.weight_scale",
                     "w3.weight_packed", "w3.weight_scale"]


def data_order(names, tensors, layout):
    """'release': safetensors' own order (dtype size descending, then name), which puts an expert's six U8
    tensors next to each other (experts in name order 0,1,10,11,...,2,...). 'scattered': the same for everything
    but the expert tensors, which go kind by kind (every expert's w1.weight_packed, then every w1.weight_scale,
    ...), so no expert is one contiguous range."""
    release = sorted(names, key=lambda n: (-DTYPE_SIZE[tensors[n][0]], n))
    if layout == "release":
        return release
    experts = [n for n in release if ".experts." in n]
    rest = [n for n in release if ".experts." not in n]

    def kind_key(n):
        e, kind = n.split(".experts.")[1].split(".", 1)
        return (EXPERT_KIND_ORDER.index(kind), int(e))

    return rest + sorted(experts, key=kind_key)


def write_safetensors(path, names, tensors, layout):
    order = data_order(names, tensors, layout)
    entries, blobs, off = {}, [], 0
    for n in order:
        dtype, a = tensors[n]
        b = tensor_bytes(dtype, a)
        entries[n] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    header = {"__metadata__": {"format": "pt"}}
    # release: header entries in data order (as the safetensors library writes them); scattered: in name order
    for n in (order if layout == "release" else sorted(order)):
        header[n] = entries[n]
    hjson = json.dumps(header, separators=(",", ":")).encode()
    hjson += b" " * ((8 - len(hjson) % 8) % 8)  # the library pads the header with spaces to 8-byte alignment
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hjson)))
        f.write(hjson)
        for b in blobs:
            f.write(b)
    return off


def shard_groups(s, tensors):
    """One decoder layer per shard, then the head/embeddings/final norms, then mm_projector, then vision_tower."""
    groups = [[] for _ in range(s["layers"] + 3)]
    for n in tensors:
        if n.startswith("language_model.model.layers."):
            groups[int(n.split(".")[3])].append(n)
        elif n.startswith("language_model."):
            groups[s["layers"]].append(n)
        elif n.startswith("mm_projector."):
            groups[s["layers"] + 1].append(n)
        elif n.startswith("vision_tower."):
            groups[s["layers"] + 2].append(n)
        else:
            raise ValueError(n)
    return groups


def write_checkpoint(hf_dir, s, tensors):
    for old in hf_dir.glob("model*.safetensors"):
        old.unlink()
    groups = shard_groups(s, tensors)
    total, weight_map = 0, {}
    for k, names in enumerate(groups):
        fname = f"model-{k + 1:05d}-of-{len(groups):06d}.safetensors"
        total += write_safetensors(hf_dir / fname, names, tensors, s["shard_layout"])
        for n in names:
            weight_map[n] = fname
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (hf_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return total


def verify_shards(hf_dir, tensors):
    """Re-open every shard with the `safetensors` package and compare every tensor bit for bit.
    safe_open(framework="numpy"/"mlx") cannot materialise BF16 (numpy has no bfloat16), so the tensors come
    from safetensors.deserialize, the same Rust parser (it validates the header and the offsets) handing back
    raw bytes; safe_open still checks the metadata and the key set."""
    from safetensors import deserialize, safe_open

    seen = 0
    for f in sorted(hf_dir.glob("model-*.safetensors")):
        with safe_open(str(f), framework="numpy") as st:
            assert st.metadata() == {"format": "pt"}
            keys = set(st.keys())
        parsed = deserialize(f.read_bytes())
        assert {n for n, _ in parsed} == keys
        for n, t in parsed:
            dtype, want = tensors[n]
            assert t["dtype"] == dtype and list(t["shape"]) == list(want.shape), n
            assert bytes(t["data"]) == tensor_bytes(dtype, want), n
            seen += 1
    assert seen == len(tensors), (seen, len(tensors))
    return seen


# --------------------------------------------------------------------------------------------------------------
# Reference outputs from mlx-lm
# --------------------------------------------------------------------------------------------------------------

def load_reference_model(hf_dir, s, tensors):
    import mlx.core as mx
    from mlx_lm.models import kimi_k3
    from mlx_lm.utils import load_model

    mx.set_default_device(mx.cpu)
    model, _ = load_model(hf_dir, strict=True)  # strict: every parameter present, nothing left over
    lm = model.language_model.model
    notes = {}

    # What the loader made of the checkpoint, before the cast: matrices stay BF16 as stored, the F32 tensors stay
    # F32, routed experts become mxfp4 QuantizedSwitchLinear (packed bytes viewed as uint32, scales uint8).
    kda = next(l for l in lm.layers if l.is_linear)
    moe = lm.layers[1].mlp
    assert isinstance(moe, kimi_k3.KimiK3SparseMoE)
    notes["loaded_dtypes"] = {
        "embed_tokens": str(lm.embed_tokens.weight.dtype),
        "kda.qkv_proj": str(kda.self_attn.qkv_proj.weight.dtype),
        "kda.qkv_conv.conv.weight": f"{kda.self_attn.qkv_conv.conv.weight.dtype} {kda.self_attn.qkv_conv.conv.weight.shape}",
        "kda.A_log": f"{kda.self_attn.A_log.dtype} {kda.self_attn.A_log.shape}",
        "kda.dt_bias": f"{kda.self_attn.dt_bias.dtype} {kda.self_attn.dt_bias.shape}",
        "kda.o_norm": str(kda.self_attn.o_norm.weight.dtype),
        "moe.e_score_correction_bias": str(moe.e_score_correction_bias.dtype),
        "moe.switch_mlp.gate_proj": f"{type(moe.switch_mlp.gate_proj).__name__} mode={moe.switch_mlp.gate_proj.mode} "
                                    f"weight {moe.switch_mlp.gate_proj.weight.dtype} {moe.switch_mlp.gate_proj.weight.shape} "
                                    f"scales {moe.switch_mlp.gate_proj.scales.dtype} {moe.switch_mlp.gate_proj.scales.shape}",
    }

    model.set_dtype(mx.float32)  # casts floating parameters only (default predicate mx.floating)
    for l in lm.layers:
        if l.is_linear:
            assert l.self_attn.A_log.dtype == mx.float32 and l.self_attn.dt_bias.dtype == mx.float32
            assert l.self_attn.A_log.shape == (s["kda_heads"],)  # sanitize dropped the zero padding
        if isinstance(l.mlp, kimi_k3.KimiK3SparseMoE):
            assert l.mlp.e_score_correction_bias.dtype == mx.float32
            for proj in (l.mlp.switch_mlp.gate_proj, l.mlp.switch_mlp.up_proj, l.mlp.switch_mlp.down_proj):
                assert proj.weight.dtype == mx.uint32 and proj.scales.dtype == mx.uint8
    assert lm.embed_tokens.weight.dtype == mx.float32

    # The loaded float values must be exactly the BF16/F32 values we wrote (bf16 -> f32 is exact).
    a = kda.self_attn
    li = lm.layers.index(kda)
    pre = f"language_model.model.layers.{li}.self_attn."
    want_qkv = np.concatenate([tensors[pre + n + ".weight"][1] for n in ("q_proj", "k_proj", "v_proj")])
    assert np.array_equal(np.array(a.qkv_proj.weight), want_qkv)
    want_conv = np.concatenate([tensors[pre + n + ".weight"][1] for n in ("q_conv1d", "k_conv1d", "v_conv1d")])
    assert np.array_equal(np.array(a.qkv_conv.conv.weight), np.moveaxis(want_conv, 2, 1))  # [3P,K,1]
    return model, notes


def check_mxfp4(model, s, tensors):
    """mlx's mxfp4 dequantisation of every expert must equal our numpy decoding of the packed nibbles, and
    w1 -> switch_mlp.gate_proj, w3 -> up_proj, w2 -> down_proj."""
    import mlx.core as mx

    checked = 0
    for i in range(1, s["layers"]):
        sw = model.language_model.model.layers[i].mlp.switch_mlp
        for proj, mod in (("w1", sw.gate_proj), ("w2", sw.down_proj), ("w3", sw.up_proj)):
            deq = np.array(mx.dequantize(mod.weight, mod.scales, group_size=MXFP4_GROUP, bits=4, mode="mxfp4",
                                         dtype=mx.float32))
            for e in range(s["experts"]):
                n = f"language_model.model.layers.{i}.block_sparse_moe.experts.{e}.{proj}."
                ours = mxfp4_decode(tensors[n + "weight_packed"][1], tensors[n + "weight_scale"][1])
                assert np.array_equal(deq[e], ours), f"mxfp4 mismatch at {n}"
                checked += 1
    return checked


class RouterProbe:
    """Records, for every token of every MoE call, the gap between the k-th and (k+1)-th biased router score
    (sigmoid(gate(x)) + e_score_correction_bias), i.e. how close the top-k selection is to flipping."""

    def __init__(self, top_k):
        self.top_k = top_k
        self.margins = []

    def install(self):
        import mlx.core as mx
        from mlx_lm.models import kimi_k3

        probe = self
        orig = kimi_k3.KimiK3SparseMoE.__call__
        if getattr(orig, "_probe", None) is not None:
            orig = orig._orig

        def call(self_, x):
            scores = mx.sigmoid(self_.gate(x).astype(mx.float32)) + self_.e_score_correction_bias
            srt = -np.sort(-np.array(scores).reshape(-1, scores.shape[-1]), axis=1)
            probe.margins.append(srt[:, probe.top_k - 1] - srt[:, probe.top_k])
            return orig(self_, x)

        call._probe, call._orig = probe, orig
        kimi_k3.KimiK3SparseMoE.__call__ = call

    def min_margin(self):
        return float(min(m.min() for m in self.margins))


def forward(model, ids, cache):
    import mlx.core as mx

    logits = model(mx.array([ids], dtype=mx.int32), cache=cache)
    mx.eval(logits)
    return np.array(logits[0], dtype=np.float32)  # [T, vocab]


def top2_margin(row):
    a = np.sort(row)
    return float(a[-1] - a[-2])


def run_reference(model, s, seed):
    n_ranks = s["n_ranks"]
    prompts, greedy_margins = [], []
    all17 = None
    batched5 = None
    for L in PROMPT_LENGTHS:
        ids = [int(t) for t in np.random.default_rng([seed, 7, L]).integers(0, n_ranks, size=L)]
        cache = model.make_cache()
        logits = forward(model, ids, cache)
        assert np.isfinite(logits).all()
        if L == 17:
            all17 = logits
        if L == 5:
            batched5 = logits[-1]
        last = logits[-1]
        # greedy continuation, one token at a time through the cache; EOS does not stop it
        greedy, margins, row = [], [], last
        for step in range(GREEDY_STEPS):
            tok = int(np.argmax(row))
            greedy.append(tok)
            margins.append(top2_margin(row))
            if step + 1 < GREEDY_STEPS:
                row = forward(model, [tok], cache)[-1]
                assert np.isfinite(row).all()
        greedy_margins.extend(margins)
        prompts.append({"tokens": ids, "last_logits": last, "greedy": greedy, "greedy_top2_margins": margins})

    # the 5-token prompt again, one token at a time through a fresh cache
    ids5 = prompts[PROMPT_LENGTHS.index(5)]["tokens"]
    cache = model.make_cache()
    for t in ids5:
        step_last = forward(model, [t], cache)[-1]
    rel = float(np.abs(step_last - batched5).max() / np.abs(batched5).max())
    return {"prompts": prompts, "all17": all17, "step5": step_last, "step5_rel": rel,
            "min_greedy_margin": float(min(greedy_margins))}


# --------------------------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------------------------

def f32_list(a):
    # 9 significant digits round-trip any float32
    return [float(f"{float(x):.9g}") for x in np.asarray(a, dtype=np.float32).ravel()]


def build_fixture(name, out_root):
    s = SPECS[name]
    fdir = out_root / name
    hf_dir = fdir / "hf"
    hf_dir.mkdir(parents=True, exist_ok=True)

    ranks, vocab, specials = write_tokenizer(hf_dir, s["n_ranks"], s["max_pos"])
    check_tokenizer(hf_dir, fdir / "tokenizer_check.json", ranks, specials)
    config = make_config(s, vocab, specials)
    (hf_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    probe = RouterProbe(s["top_k"])
    probe.install()
    tried = []
    for seed in range(s["seed"], s["seed"] + MAX_SEED_TRIES):
        tensors = make_weights(s, vocab, seed)
        total = write_checkpoint(hf_dir, s, tensors)
        model, notes = load_reference_model(hf_dir, s, tensors)
        n_mx = check_mxfp4(model, s, tensors)  # before trusting any output: mlx's MXFP4 == our decoding
        probe.margins = []
        ref = run_reference(model, s, seed)
        rmin = probe.min_margin()
        tried.append((seed, ref["min_greedy_margin"], rmin))
        print(f"  {name} seed {seed}: min greedy top-2 margin {ref['min_greedy_margin']:.4g}, "
              f"min router k/k+1 margin {rmin:.3g}")
        if ref["min_greedy_margin"] >= GREEDY_MIN_MARGIN and rmin >= ROUTER_MIN_MARGIN:
            break
    else:
        raise RuntimeError(f"no seed met the margin thresholds: {tried}")

    assert ref["step5_rel"] < 1e-4, ref["step5_rel"]
    n_tensors = verify_shards(hf_dir, tensors)

    reference = {
        "generator": "mlx-lm 0.32.2 kimi_k3.py, f32 on CPU",
        "fixture": name,
        "seed": seed,
        "greedy_steps": GREEDY_STEPS,
        "prompts": [
            {"tokens": p["tokens"], "last_logits": f32_list(p["last_logits"]), "greedy": p["greedy"],
             "greedy_top2_margins": [round(m, 6) for m in p["greedy_top2_margins"]]}
            for p in ref["prompts"]
        ],
        "all_logits_17": [f32_list(r) for r in ref["all17"]],
        "stepwise_5": {
            "note": "the 5-token prompt fed one token at a time through a fresh cache; rel_diff = "
                    "max|stepwise - batched| / max|batched| over the last-position logits",
            "tokens": ref["prompts"][1]["tokens"],
            "last_logits": f32_list(ref["step5"]),
            "rel_diff": ref["step5_rel"],
        },
        "router_min_margin": rmin,
        "loaded_dtypes": notes["loaded_dtypes"],
    }
    (fdir / "reference.json").write_text(json.dumps(reference, separators=(",", ":")) + "\n")

    files = sorted(p for p in fdir.rglob("*") if p.is_file())
    all_logits = np.concatenate([np.ravel(p["last_logits"]) for p in ref["prompts"]] + [ref["all17"].ravel()])
    print(f"{name}: seed {seed}, {n_tensors} tensors, tensor bytes {total}, "
          f"files {sum(p.stat().st_size for p in files)} bytes in {len(files)} files")
    print(f"  vocab {vocab} (ranks {s['n_ranks']}), logits range [{all_logits.min():.4f}, {all_logits.max():.4f}], "
          f"std {all_logits.std():.3f}")
    print(f"  mxfp4: {n_mx} expert matrices, mlx dequantize == numpy decode (exact)")
    print(f"  stepwise-vs-batched (5 tokens) rel diff {ref['step5_rel']:.3e}; router min margin {rmin:.3g}")
    for p in ref["prompts"]:
        print(f"  prompt len {len(p['tokens']):2d}: greedy {p['greedy']}")
        print(f"      top-2 margins {[round(m, 4) for m in p['greedy_top2_margins']]}")
    return reference


def build_checkpoint_only(name, out_root):
    """--no-reference: the HF checkpoint alone (config, tokenizer files, shards, index) from the spec's first seed,
    with no mlx model, no reference outputs and no tokenizer check (numpy and safetensors only)."""
    s = SPECS[name]
    hf_dir = out_root / name / "hf"
    hf_dir.mkdir(parents=True, exist_ok=True)
    ranks, vocab, specials = write_tokenizer(hf_dir, s["n_ranks"], s["max_pos"], pieces=_pieces_plain)
    config = make_config(s, vocab, specials)
    (hf_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tensors = make_weights(s, vocab, s["seed"])
    total = write_checkpoint(hf_dir, s, tensors)
    n_tensors = verify_shards(hf_dir, tensors)
    record = 0
    if s["layers"] > 1:
        pre = "language_model.model.layers.1.block_sparse_moe.experts.0."
        record = sum(tensors[pre + k][1].nbytes for k in EXPERT_KIND_ORDER)
    files = sorted(p for p in hf_dir.iterdir() if p.is_file())
    print(f"{name}: seed {s['seed']}, {n_tensors} tensors, tensor bytes {total}, expert record {record} bytes, "
          f"{s['layers'] - 1} MoE layers x {s['experts']} experts (top-{s['top_k']}), vocab {vocab}; "
          f"{sum(p.stat().st_size for p in files)} bytes in {len(files)} files under {hf_dir}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO / "fixtures")
    ap.add_argument("--only", choices=sorted(SPECS), action="append")
    ap.add_argument("--no-reference", action="store_true",
                    help="write only the HF checkpoint (no mlx, no reference outputs): needs numpy and safetensors")
    args = ap.parse_args()
    names = args.only or sorted(n for n in SPECS if SPECS[n].get("reference", True))
    for name in names:
        if args.no_reference:
            build_checkpoint_only(name, args.out)
        elif not SPECS[name].get("reference", True):
            ap.error(f"{name} has no reference outputs (it is too large for mlx here): add --no-reference")
        else:
            build_fixture(name, args.out)


if __name__ == "__main__":
    main()
