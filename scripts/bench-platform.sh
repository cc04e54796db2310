#!/usr/bin/env bash
# Measure Deltafin on your machine and write one JSON file to attach to a report: a Mac, a Linux
# box, or Windows from Git Bash (which ships with Git for Windows; Rust from rustup).
#
#   bash scripts/bench-platform.sh [--yes] [--dir DIR] [--size SIZE]
#
# It:
#   1. builds the release binary;
#   2. runs the kernel benchmarks (`deltafin bench --kernels`: GFLOP/s and GB/s against this
#      machine's FMA and memory roofs), and the GPU's (`--device gpu`) where it has one;
#   3. writes a synthetic store with Kimi K3's real geometry (`deltafin synth --spine real`:
#      K3's per-layer spine, 896 routed experts of 17.5 MB per layer; fewer experts in two
#      layers for a small size) sized to 1.25x this machine's memory, so that no cache can hold
#      it. That is tens of GB: it asks first, unless --yes; --size (for example 40G) picks
#      another size;
#   4. measures decode with the default memory budget (what the platform reports), three fresh
#      processes, each with the project's own drive probe (raw O_DIRECT / F_NOCACHE /
#      FILE_FLAG_NO_BUFFERING reads at the same queue depth), and a 1,000-token prompt once; with
#      a GPU, decode again with the routed experts on it;
#   5. writes bench-results/platform-<host>-<date>.json with the machine, the drive, every run
#      and the plan, and says where the store is (delete it when done; it is not needed again).
#
# Nothing leaves the machine: there is no upload.
set -euo pipefail
cd "$(dirname "$0")/.."
yes=""
dir="${BENCH_DIR:-$HOME/deltafin-bench}"
size=""
while [ $# -gt 0 ]; do
  case "$1" in
    --yes) yes=1 ;;
    --dir) dir="$2"; shift ;;
    --size) size="$2"; shift ;;
    -h|--help) sed -n 2,24p "$0"; exit 0 ;;
    *) echo "unknown argument $1 (try --help)" >&2; exit 2 ;;
  esac
  shift
done

# Bytes of memory, whatever the system.
ram_bytes() {
  case "$(uname -s)" in
    Darwin) sysctl -n hw.memsize ;;
    Linux) awk '/^MemTotal:/ { printf "%.0f\n", $2 * 1024 }' /proc/meminfo ;;
    MINGW*|MSYS*|CYGWIN*) powershell.exe -NoProfile -Command "(Get-CimInstance Win32_ComputerSystem).TotalPhysicalMemory" | tr -d '\r' ;;
    *) echo 0 ;;
  esac
}
# Bytes free on the drive holding $1.
free_bytes() { df -Pk "$1" | awk 'NR == 2 { printf "%.0f\n", $4 * 1024 }'; }
# "40G", "512M" or bytes -> bytes.
to_bytes() {
  awk -v s="$1" 'BEGIN { n = s + 0; u = toupper(substr(s, length(s)));
    if (u == "G") n *= 1073741824; else if (u == "M") n *= 1048576; else if (u == "T") n *= 1099511627776;
    printf "%.0f\n", n }'
}

command -v cargo >/dev/null || { echo "Rust is needed: install it from rustup.rs, then run this again" >&2; exit 1; }
echo "1/5 building the release binary (the first build takes a few minutes)" >&2
cargo build --release --locked
bin=target/release/deltafin
[ -x "$bin" ] || bin=target/release/deltafin.exe

mkdir -p "$dir" bench-results
ram=$(ram_bytes)
target=${size:+$(to_bytes "$size")}
target=${target:-$(awk -v r="$ram" 'BEGIN { printf "%.0f\n", r * 1.25 }')}
# The store's bytes: K3's embeddings and head (about 2.4 GB), then per layer its spine (about
# 0.65 GB) and E routed experts of 17,547,264 bytes (896 in K3). Full layers when the target
# allows two or more; else two layers of fewer experts (at least 64).
record=17547264
fixed=2400000000
per_spine=650000000
layer=$((896 * record + per_spine))
plan_store() { # target bytes -> "layers experts bytes"
  awk -v t="$1" -v f="$fixed" -v l="$layer" -v s="$per_spine" -v r="$record" 'BEGIN {
    n = int((t - f + l - 1) / l); e = 896
    if (n < 2) { n = 2; e = int((t - f - 2 * s) / (2 * r)); if (e > 896) e = 896; if (e < 64) e = 64 }
    printf "%d %d %.0f\n", n, e, f + n * (s + e * r) }'
}
read -r layers experts need <<< "$(plan_store "$target")"
free=$(free_bytes "$dir")
if [ "$need" -gt $((free / 10 * 9)) ]; then
  read -r layers experts need <<< "$(plan_store $((free / 10 * 9)))"
  if [ "$need" -gt $((free / 10 * 9)) ]; then
    echo "$dir has $((free >> 30)) GiB free; the smallest store needs $((need >> 30)) GiB. Free some space or pass --dir." >&2
    exit 1
  fi
  echo "note: $dir has room for $((need >> 30)) GiB only, less than 1.25x this machine's memory: the system may cache part of the store" >&2
fi
store="$dir/k3-synth-${layers}x$experts"

echo "2/5 kernel benchmarks" >&2
kernels=$("$bin" bench --kernels --json)
# The GPU's kernels beside its own roofs, where the machine has a GPU wgpu can use (Metal on a
# Mac, Vulkan or DirectX 12 on a PC); `null` in the report where none opens.
gpu_kernels=$("$bin" bench --kernels --device gpu --json 2>/dev/null) || gpu_kernels=null
[ -n "$gpu_kernels" ] || gpu_kernels=null

if [ ! -f "$store/manifest.json" ]; then
  echo "3/5 the store: $layers layers of $experts experts with Kimi K3's geometry, about $((need >> 30)) GiB, in $store" >&2
  if [ -z "$yes" ]; then
    printf "write %s GiB to %s? [y/N] " "$((need >> 30))" "$dir" >&2
    read -r answer
    case "$answer" in y|Y|yes) ;; *) echo "stopped; nothing written" >&2; exit 1 ;; esac
  fi
  "$bin" synth --preset kimi-k3 --layers "$layers" --experts "$experts" --spine real --out "$store"
else
  echo "3/5 reusing the store in $store" >&2
fi

echo "4/5 decode, 3 fresh processes, default budget (each probes the drive first)" >&2
decode=$("$bin" bench --model "$store" --runs 3 --max-tokens 8 --json)
echo "    a 1,000-token prompt, once" >&2
prompt=$("$bin" bench --model "$store" --runs 1 --max-tokens 3 --prompt-length 1000 --json)
gpu_decode=null
if [ "$gpu_kernels" != null ]; then
  echo "    decode again with the routed experts on the GPU (--device gpu)" >&2
  gpu_decode=$("$bin" bench --model "$store" --runs 3 --max-tokens 8 --device gpu --json) || gpu_decode=null
fi

host=$(hostname 2>/dev/null | tr -c 'A-Za-z0-9._-\n' '_' || echo host)
out="bench-results/platform-$host-$(date +%Y%m%d-%H%M%S).json"
{
  printf '{\n"script": "scripts/bench-platform.sh",\n"commit": "%s",\n' "$(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  printf '"uname": "%s",\n"store_layers": %s,\n"store_experts": %s,\n"store_bytes": %s,\n' "$(uname -a | tr -d '"\\')" "$layers" "$experts" "$need"
  printf '"kernels": %s,\n"gpu_kernels": %s,\n"decode": %s,\n"gpu_decode": %s,\n"prompt_1000": %s\n}\n' "$kernels" "$gpu_kernels" "$decode" "$gpu_decode" "$prompt"
} > "$out"
echo "5/5 wrote $out: attach it to your report. The store ($((need >> 30)) GiB) is in $store; delete it when done." >&2
