#!/usr/bin/env bash
# Issue 28 on the lent GPU machine (device tool): the GPU kernels' rooflines and their parity with
# the CPU's scalar twin, the model with its routed experts on the GPU, and a disk-bound decode.
# Carries .gl (the Vulkan loader's Debian packages, see the device README) and .devbin (stripped,
# xz-compressed release builds of deltafin, optionally deltafin-base, and of crates/gpu's test
# binaries). Everything but the two logs comes back in one tar ($OUT/results.tar): at most 8
# files come back from a call.
#   ROUNDS   kernel benches per build (default 2)     SECS  seconds per kernel (default 0.5)
#   MODEL=1  k3-real4 (KDA x3 + MLA, 64 experts, K3's real spine): decode at a context of 1,000
#            (warm) and a PROMPT_LEN-token prompt (default 512), on the CPU's cores and on the GPU
#   DISK=1   k3-2r (2 MoE layers x 896 experts, 31 GB of experts): cold decode through O_DIRECT
#            beside the bench's own disk floor, experts on the CPU and on the GPU
#   TESTS=0  skip crates/gpu's tests     PROMPT_LEN=0  no prompt runs
#   GPU_MEMORY  --gpu-memory for the GPU runs (e.g. 16G: k3-real4's spine and all its experts)
#   BASE_MODEL=1  the model runs with deltafin-base too (A/B on one machine)
#   DEVICES  the MODEL runs' devices (default "cpu gpu")
#   KERNEL_BINS  whose kernels the ROUNDS measure (default: every carried build)
#   DECODE=0  no decode runs in MODEL
set -uo pipefail
for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
unxz() { if command -v xz >/dev/null; then xz -dc "$1"; else python3 -c 'import lzma, sys; sys.stdout.buffer.write(lzma.open(sys.argv[1]).read())' "$1"; fi; }
mkdir -p /tmp/bin && for b in deltafin deltafin-base gpu-tests-mxfp4 gpu-tests-int8 gpu-tests-expert gpu-tests-dense_ops gpu-tests-spine gpu-tests-attention gpu-tests-kda; do
  [ -f .devbin/$b.xz ] && unxz .devbin/$b.xz > /tmp/bin/$b && chmod +x /tmp/bin/$b
done
if ! ls /usr/share/vulkan/icd.d/nvidia* /etc/vulkan/icd.d/nvidia* >/dev/null 2>&1; then
  export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
fi
export XDG_RUNTIME_DIR=/tmp
R=/tmp/results; mkdir -p $R
save() { (cd /tmp && tar cf "$OUT/results.tar" results); }
trap save EXIT
{ nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem,driver_version --format=csv; nproc; free -g; df -h /tmp; } > "$OUT/gpu-tests.log" 2>&1
for t in $([ "${TESTS:-1}" = 1 ] && echo mxfp4 int8 expert dense_ops spine attention kda); do
  [ -x /tmp/bin/gpu-tests-$t ] || continue
  DELTAFIN_REQUIRE_GPU=1 DELTAFIN_GPU_ADAPTER=${ADAPTER:-NVIDIA} /tmp/bin/gpu-tests-$t --test-threads 1 >> "$OUT/gpu-tests.log" 2>&1
  echo "gpu tests ($t) rc=$?" >> "$OUT/gpu-tests.log"
done
bins=(deltafin); [ -x /tmp/bin/deltafin-base ] && bins=(deltafin-base deltafin)
log() { echo "== $(date +%T) $*" >> "$OUT/bench.log"; }
for r in $(seq 1 "${ROUNDS:-2}"); do
  for b in ${KERNEL_BINS:-${bins[@]}}; do
    log "$b kernels, run $r"
    /tmp/bin/$b bench --kernels --device gpu --kernel-seconds ${SECS:-0.5} --json > "$R/kernels-$b-run$r.json" 2>> "$OUT/bench.log"
    echo "bench rc=$?" >> "$OUT/bench.log"; save
  done
done
mbins=(deltafin); [ "${BASE_MODEL:-0}" = 1 ] && mbins=("${bins[@]}")
if [ "${MODEL:-0}" = 1 ]; then
  log synth k3-real4
  /tmp/bin/deltafin synth --preset kimi-k3 --layers 4 --experts 64 --spine real --out /tmp/k3-real4 >> "$OUT/bench.log" 2>&1
  for dev in ${DEVICES:-cpu gpu}; do for b in "${mbins[@]}"; do
    [ $dev = cpu ] && [ $b = deltafin-base ] && continue
    gm=(); [ $dev = gpu ] && [ -n "${GPU_MEMORY:-}" ] && gm=(--gpu-memory "$GPU_MEMORY")
    if [ "${DECODE:-1}" = 1 ]; then
    log "$b k3-real4 decode, experts on $dev ${gm[*]}"
    /tmp/bin/$b bench --model /tmp/k3-real4 --memory-budget 60G --runs ${MODEL_RUNS:-2} --context-fill 1000 --warm --max-tokens 8 --device $dev "${gm[@]}" --json > "$R/decode-$b-$dev.json" 2>> "$OUT/bench.log"
    echo "bench rc=$?" >> "$OUT/bench.log"
    fi
    [ "${PROMPT_LEN:-512}" = 0 ] && continue
    log "$b k3-real4 prompt ${PROMPT_LEN:-512}, experts (and chunks' spine) on $dev"
    /tmp/bin/$b bench --model /tmp/k3-real4 --memory-budget 60G --runs ${MODEL_RUNS:-2} --prompt-length ${PROMPT_LEN:-512} --context $(( ${PROMPT_LEN:-512} + 64 )) --max-tokens 3 --device $dev "${gm[@]}" --json > "$R/prompt-$b-$dev.json" 2>> "$OUT/bench.log"
    echo "bench rc=$?" >> "$OUT/bench.log"; save
  done; done
  rm -rf /tmp/k3-real4
fi
if [ "${DISK:-0}" = 1 ]; then
  log synth k3-2r
  /tmp/bin/deltafin synth --preset kimi-k3 --layers 2 --experts 896 --spine real --out /tmp/k3-2r >> "$OUT/bench.log" 2>&1
  for dev in cpu gpu; do for b in "${mbins[@]}"; do
    [ $dev = cpu ] && [ $b = deltafin-base ] && continue
    log "$b k3-2r cold decode, experts on $dev"
    /tmp/bin/$b bench --model /tmp/k3-2r --memory-budget 6G --runs ${DISK_RUNS:-2} --max-tokens 8 --device $dev --json > "$R/disk-$b-$dev.json" 2>> "$OUT/bench.log"
    echo "bench rc=$?" >> "$OUT/bench.log"; save
  done; done
fi
cat "$OUT/gpu-tests.log" "$OUT/bench.log"
