#!/usr/bin/env bash
# A Vulkan device for the GPU backend's tests (crates/gpu/tests): Mesa's software driver,
# llvmpipe (Debian's mesa-vulkan-drivers, with the loader libvulkan1), so that every WGSL shader
# is checked against its CPU scalar twin on every submission without a GPU. Installed when no
# Vulkan loader and llvmpipe are found; where they then are, the tests are told that a GPU adapter
# must open (DELTAFIN_REQUIRE_GPU=1), so a GPU test that would skip fails instead. Where apt
# cannot be used, says so: the GPU tests then report SKIPPED. Sourced by test.sh.
set -euo pipefail
have_lvp() {
  ldconfig -p 2>/dev/null | grep -q 'libvulkan\.so\.1' && ls /usr/share/vulkan/icd.d/lvp_icd*.json >/dev/null 2>&1
}
if ! have_lvp && command -v apt-get >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  { $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq mesa-vulkan-drivers libvulkan1; } >/dev/null 2>&1 || true
fi
if have_lvp; then
  export DELTAFIN_REQUIRE_GPU=1
  # Mesa's window-system layer looks for a display session and complains without one; compute
  # needs none.
  export XDG_RUNTIME_DIR=${XDG_RUNTIME_DIR:-/tmp}
  echo "vulkan: Mesa's llvmpipe installed: a GPU adapter is required of the tests"
else
  export DELTAFIN_REQUIRE_GPU=0
  echo "vulkan: no Vulkan driver here: the GPU tests report SKIPPED"
fi
