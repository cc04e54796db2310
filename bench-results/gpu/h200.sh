#!/usr/bin/env bash
# Issue 28 on the lent H200 (device tool): the GPU kernels' rooflines and their parity with the
# CPU's scalar twin. Carries .gl (the Vulkan loader's Debian packages, see the device README) and
# .devbin (stripped, gzipped release builds of deltafin and of crates/gpu's test binaries).
set -uo pipefail
for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
mkdir -p /tmp/bin && for b in deltafin gpu-tests-mxfp4 gpu-tests-int8; do gunzip -c .devbin/$b.gz > /tmp/bin/$b && chmod +x /tmp/bin/$b; done
if ! ls /usr/share/vulkan/icd.d/nvidia* /etc/vulkan/icd.d/nvidia* >/dev/null 2>&1; then
  export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
fi
export XDG_RUNTIME_DIR=/tmp
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem,driver_version --format=csv > "$OUT/nvidia-smi.csv" 2>&1
for t in mxfp4 int8; do
  DELTAFIN_REQUIRE_GPU=1 DELTAFIN_GPU_ADAPTER=${ADAPTER:-NVIDIA} /tmp/bin/gpu-tests-$t --test-threads 1 >> "$OUT/gpu-tests.log" 2>&1
  echo "gpu tests ($t) rc=$?" >> "$OUT/gpu-tests.log"
done
for r in 1 2 3; do
  /tmp/bin/deltafin bench --kernels --device gpu --kernel-seconds 1 --json > "$OUT/gpu-kernels-run$r.json" 2> "$OUT/gpu-kernels-run$r.log"
  echo "bench rc=$?" >> "$OUT/gpu-kernels-run$r.log"
done
cat "$OUT/nvidia-smi.csv" "$OUT/gpu-tests.log" "$OUT"/gpu-kernels-run*.log
