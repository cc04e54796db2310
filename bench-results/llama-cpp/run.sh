#!/usr/bin/env bash
# Issue 23's side by side with llama.cpp, on ONE model: tools/k3_arch_checkpoint.py's Kimi-K3-architecture
# checkpoint at real dimensions (4 MoE layers: KDA KDA KDA MLA, 64 MXFP4 experts, top-16, vocab 163,840),
# converted by each engine's own converter with an 8-bit spine:
#   python3 tools/k3_arch_checkpoint.py --out $STORES/k3-arch4-hf
#   deltafin convert --from $STORES/k3-arch4-hf --to $STORES/k3-arch4 --spine int8
#   LLAMA=<sdist>/vendor/llama.cpp python bench-results/llama-cpp/convert_gguf.py $STORES/k3-arch4-hf \
#       --outtype q8_0 --outfile $STORES/k3-arch4-q8_0.gguf
# llama-bench from the llama-cpp-python 0.3.36 sdist (vendor/llama.cpp), built with cmake + ninja from PyPI:
#   cmake -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF && cmake --build build --target llama-bench
# Everything in memory, 2 threads each, fresh processes, the engines interleaved (A B A B).
# Usage: BIN=target/release/deltafin LLAMA_BENCH=.../build/bin/llama-bench STORES=/work/bench \
#        OUT=bench-results/llama-cpp RUNS=2 bash bench-results/llama-cpp/run.sh prompt 2000 | decode 2000
set -euo pipefail
BIN=${BIN:-target/release/deltafin}
STORES=${STORES:-/work/bench}
OUT=${OUT:-bench-results/llama-cpp}
RUNS=${RUNS:-2}
mode=$1
n=$2
common=(--model "$STORES/k3-arch4" --memory-budget 12G --runs 1 --no-prefetch --probe-reads 64 --threads 2 --json)
for r in $(seq 1 "$RUNS"); do
  case $mode in
    prompt)
      "$LLAMA_BENCH" -m "$STORES/k3-arch4-q8_0.gguf" -t 2 -p "$n" -n 0 -r 1 -o json > "$OUT/llama-prompt-$n-run$r.json"
      "$BIN" bench "${common[@]}" --prompt-length "$n" --max-tokens 4 > "$OUT/deltafin-prompt-$n-run$r.json"
      "$BIN" bench "${common[@]}" --prompt-length "$n" --max-tokens 4 --approx > "$OUT/deltafin-approx-prompt-$n-run$r.json"
      ;;
    decode)
      "$LLAMA_BENCH" -m "$STORES/k3-arch4-q8_0.gguf" -t 2 -p 0 -n 16 -d "$n" -r 1 -o json > "$OUT/llama-decode-$n-run$r.json"
      "$BIN" bench "${common[@]}" --context-fill "$n" --warm --max-tokens 16 > "$OUT/deltafin-decode-$n-run$r.json"
      "$BIN" bench "${common[@]}" --context-fill "$n" --warm --max-tokens 16 --approx > "$OUT/deltafin-approx-decode-$n-run$r.json"
      ;;
  esac
  python3 "$(dirname "$0")/summarize.py" "$OUT"
done
