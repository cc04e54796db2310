#!/usr/bin/env bash
# Issue 28 on the lent H200 (device tool): the GPU kernels' rooflines and their parity with the
# CPU's scalar twin. Carries .gl (the Vulkan loader's Debian packages, see the device README) and
# .devbin (stripped, xz-compressed release builds of deltafin and of crates/gpu's test binaries).
set -uo pipefail
for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
unxz() { if command -v xz >/dev/null; then xz -dc "$1"; else python3 -c 'import lzma, sys; sys.stdout.buffer.write(lzma.open(sys.argv[1]).read())' "$1"; fi; }
# deltafin-base (optional): an earlier build, run in turn with this one (A/B on one machine).
mkdir -p /tmp/bin && for b in deltafin deltafin-base gpu-tests-mxfp4 gpu-tests-int8 gpu-tests-expert gpu-tests-dense_ops; do
  [ -f .devbin/$b.xz ] && unxz .devbin/$b.xz > /tmp/bin/$b && chmod +x /tmp/bin/$b
done
if ! ls /usr/share/vulkan/icd.d/nvidia* /etc/vulkan/icd.d/nvidia* >/dev/null 2>&1; then
  export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
fi
export XDG_RUNTIME_DIR=/tmp
# At most 8 files come back: the JSONs, one log of the tests (with nvidia-smi) and one of the benches.
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem,driver_version --format=csv > "$OUT/gpu-tests.log" 2>&1
for t in mxfp4 int8 expert dense_ops; do
  DELTAFIN_REQUIRE_GPU=1 DELTAFIN_GPU_ADAPTER=${ADAPTER:-NVIDIA} /tmp/bin/gpu-tests-$t --test-threads 1 >> "$OUT/gpu-tests.log" 2>&1
  echo "gpu tests ($t) rc=$?" >> "$OUT/gpu-tests.log"
done
bins=(deltafin); [ -x /tmp/bin/deltafin-base ] && bins=(deltafin-base deltafin)
for r in $(seq 1 "${ROUNDS:-3}"); do
  for b in "${bins[@]}"; do
    echo "== $b, run $r" >> "$OUT/bench.log"
    /tmp/bin/$b bench --kernels --device gpu --kernel-seconds ${SECS:-1} --json > "$OUT/$b-run$r.json" 2>> "$OUT/bench.log"
    echo "bench rc=$?" >> "$OUT/bench.log"
  done
done
# MODEL=1: the model on a store made here (k3-real4: KDA x3 + MLA, 64 experts of 17.5 MB, K3's
# real spine), its routed experts on the CPU's cores and on the GPU: decode at a context of 1,000
# (warm: experts cached) and a 512-token prompt (cold). With ROUNDS=1 the files fit the 8 that
# come back.
if [ "${MODEL:-0}" = 1 ]; then
  /tmp/bin/deltafin synth --preset kimi-k3 --layers 4 --experts 64 --spine real --out /tmp/k3-real4 >> "$OUT/bench.log" 2>&1
  for dev in cpu gpu; do
    echo "== model, experts on $dev: decode" >> "$OUT/bench.log"
    /tmp/bin/deltafin bench --model /tmp/k3-real4 --memory-budget 60G --runs ${MODEL_RUNS:-2} --context-fill 1000 --warm --max-tokens 8 --device $dev --json > "$OUT/decode-$dev.json" 2>> "$OUT/bench.log"
    echo "bench rc=$?" >> "$OUT/bench.log"
    echo "== model, experts on $dev: prompt" >> "$OUT/bench.log"
    /tmp/bin/deltafin bench --model /tmp/k3-real4 --memory-budget 60G --runs ${MODEL_RUNS:-2} --prompt-length 512 --max-tokens 3 --device $dev --json > "$OUT/prompt-$dev.json" 2>> "$OUT/bench.log"
    echo "bench rc=$?" >> "$OUT/bench.log"
  done
fi
cat "$OUT/gpu-tests.log" "$OUT/bench.log"
