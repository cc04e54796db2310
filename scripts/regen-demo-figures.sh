#!/usr/bin/env bash
# Regenerate every figure published on the demo model (models/k3-demo) with the scripts that made
# them, after the bundle changes: the router traces and their statistics, the spine-precision
# fidelity tables (schemes, ablation, mixes, single classes, latent cache), the rounding study,
# and the spine-dtype decode timing (last, alone, since it is a timing).
#   PY        a Python with tools/demo/requirements.txt (torch, numpy, safetensors) and tiktoken
#             (default .venv-demo/bin/python)
#   DATA      tools/demo/chat_data.py --plain's folder (train.bin for GPTQ's calibration,
#             chat-valid.jsonl for the chat trace; default target/demo/data)
#   CORPUS    tools/demo/corpus.py's folder (default target/demo/corpus)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv-demo/bin/python}
DATA=${DATA:-target/demo/data}
CORPUS=${CORPUS:-target/demo/corpus}
bin=${DELTAFIN_BIN:-target/release/deltafin}
[ -n "${DELTAFIN_BIN:-}" ] || cargo build --release --locked -q
export DELTAFIN_BIN=$bin
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
step() { echo "== $(date +%T) $*" >&2; }

step "router traces (models/k3-demo/traces) and their statistics"
$PY tools/demo/traces.py --bin "$bin" --corpus "$CORPUS" --chat-data "$DATA" --out models/k3-demo/traces
$bin trace stats models/k3-demo/traces/*.jsonl > bench-results/demo-trace-stats.txt

step "PyTorch's reference log-probabilities"
$PY tools/demo/quant_study.py --save-ref "$tmp/torch-ref.npy" --no-schemes
step "fidelity: storage schemes"
$PY tools/demo/fidelity.py --bin "$bin" --n 4096 --torch-ref "$tmp/torch-ref.npy" --out bench-results/demo-fidelity.json
step "fidelity: one class of matrices in bf16 at a time"
$PY tools/demo/fidelity.py --bin "$bin" --n 4096 --ablation --out bench-results/demo-fidelity-ablation.json
step "fidelity: int8 mixes"
g32="--spine int8 --int8-group 32"
$PY tools/demo/fidelity.py --bin "$bin" --n 4096 --out bench-results/demo-fidelity-mixes.json \
  --config "$g32 --router-f32 --keep embed_tokens=bf16" \
  --config "$g32 --router-f32 --keep embed_tokens=bf16 --keep lm_head=bf16" \
  --config "$g32 --router-f32 --keep embed_tokens=bf16 --keep self_attn.q_proj=bf16 --keep self_attn.k_proj=bf16 --keep self_attn.v_proj=bf16 --keep self_attn.o_proj=bf16" \
  --config "$g32 --router-f32 --keep embed_tokens=bf16 --keep self_attn=bf16" \
  --config "$g32 --keep self_attn=bf16 --keep embed_tokens=bf16 --keep lm_head=bf16 --keep block_sparse_moe.gate=f32 --keep routed_expert_=bf16"
step "fidelity: a bf16 spine with one class in int8"
$PY tools/demo/fidelity.py --bin "$bin" --n 4096 --out bench-results/demo-fidelity-single.json \
  --config "--spine bf16 --keep lm_head=int8" --config "--spine bf16 --keep shared_experts=int8" \
  --config "--spine bf16 --keep layers.7.=int8"
step "fidelity: the bf16 latent cache"
$PY tools/demo/fidelity.py --bin "$bin" --n 4096 --latent-cache --out bench-results/demo-fidelity-latent-cache.json
step "rounding study (PyTorch, CPU)"
$PY tools/demo/quant_study.py --train "$DATA/train.bin" --out bench-results/demo-quant-study.json
step "spine dtype decode timing"
bash scripts/bench-spine-dtype.sh
step "done"
