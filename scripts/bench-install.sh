#!/usr/bin/env bash
# Time to first token from nothing: `deltafin install --mode stream` (headers and spine, then each
# routed expert fetched on first use) against `--mode full` (everything, sha256-verified, then
# offline), over a loopback test origin limited to a link's bandwidth.
#
#   bash scripts/bench-install.sh                 # 3 runs of each mode at 200 MB/s
#   RUNS=5 RATE=100000000 bash scripts/bench-install.sh
#
# Environment (defaults in brackets):
#   RUNS [3]            runs of each mode, interleaved (stream full, full stream, ...)
#   RATE [200000000]    the origin's bandwidth in bytes/s (decimal MB: 200 MB/s, a fast home/lab link)
#   PROMPT [hi]         the prompt of both generates (one token generated: time to first token)
#   BENCH_DATA [/work/bench-data]  where the bench checkpoint is made (python tools/make_fixtures.py
#                       --only k3-bench --no-reference), and the stores (one at a time)
#   PYTHON [/work/.venv-bench/bin/python]  numpy + safetensors, as in tools/requirements-fixtures.txt
#   OUT [bench-results/install-stream-vs-full]  raw JSON of every step, and summary.txt
#   GEN_FLAGS []        extra flags of the stream generates (e.g. --fetch-ahead)
#   MAX_TOKENS [1]      tokens each generate makes (1: time to first token; more: decode too)
#   MODES [stream full] which modes to run
#   CARGO_TARGET_DIR [target]
#
# Per run and mode, with a fresh store and the page cache dropped before each step where this
# user may (it says so when it may not; expert reads use O_DIRECT either way):
#   stream: install (wall, bytes), generate #1 (cold: fetches its experts), generate #2 (warm:
#           fetches nothing), then `install --upgrade-to-full` of that store (bytes);
#   full:   install (wall, bytes), generate --offline.
# Limits measured in the same run: the origin's delivered bandwidth (curl of the largest shard to
# /dev/null, through the Hub's redirect to its CDN), and the store drive's O_DIRECT read
# bandwidth at the expert record size (`deltafin probe-disk`, queue depth 8).
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${RUNS:-3}
rate=${RATE:-200000000}
prompt=${PROMPT:-hi}
data=${BENCH_DATA:-/work/bench-data}
python=${PYTHON:-/work/.venv-bench/bin/python}
out=${OUT:-bench-results/install-stream-vs-full}
target=${CARGO_TARGET_DIR:-target}
repo=deltafin/k3-bench
ckpt=$data/k3-bench/hf
store=$data/store
bin=$target/release/deltafin
origin_bin=$target/release/deltafin-test-origin

CARGO_TARGET_DIR=$target nice cargo build --release -q -p deltafin -p deltafin-test-origin
if [ ! -f "$ckpt/model.safetensors.index.json" ]; then
  echo "making the bench checkpoint in $ckpt" >&2
  "$python" tools/make_fixtures.py --only k3-bench --no-reference --out "$data"
fi
mkdir -p "$out"
rm -f "$out"/*.json "$out"/*.log "$out/summary.txt"
results=$out/steps.jsonl
: > "$results"

# The origin, its URLs from its first line (it hashes the checkpoint first).
"$origin_bin" --repo "$repo=$ckpt" --rate "$rate" > "$out/origin.log" 2>&1 &
origin_pid=$!
trap 'kill "$origin_pid" 2>/dev/null || true; rm -rf "$store"' EXIT
for _ in $(seq 600); do
  grep -q '^endpoint=' "$out/origin.log" 2>/dev/null && break
  kill -0 "$origin_pid" 2>/dev/null || { cat "$out/origin.log" >&2; exit 1; }
  sleep 0.2
done
endpoint=$(sed -n 's/^endpoint=\([^ ]*\) .*/\1/p' "$out/origin.log")
[ -n "$endpoint" ] || { echo "the origin did not start" >&2; exit 1; }
echo "origin $endpoint at $rate bytes/s" >&2

if sync && echo 3 > /proc/sys/vm/drop_caches 2>/dev/null; then
  can_drop=1
else
  can_drop=0
  echo "note: cannot drop the page cache here (not permitted); expert reads are O_DIRECT regardless" >&2
fi
drop() { sync; [ "$can_drop" = 1 ] && echo 3 > /proc/sys/vm/drop_caches; true; }
now() { date +%s.%N; }
served() { curl -sf "$endpoint/_origin/stats" | "$python" -c 'import json,sys; print(json.load(sys.stdin)["body_bytes_total"])'; }
# record RUN MODE STEP WALL_S ORIGIN_BYTES JSON_FILE STDERR_FILE
record() {
  "$python" - "$@" >> "$results" <<'EOF'
import json, re, sys
run, mode, step, wall, origin_bytes, jf, ef = sys.argv[1:8]
rep = {}
try:
    text = open(jf).read().strip()
    rep = json.loads(text.splitlines()[-1]) if text else {}
except (OSError, ValueError):
    pass
err = open(ef).read() if ef != "-" else ""
m = re.search(r"streaming store: (\d+) of (\d+) experts on disk", err)
print(json.dumps({"run": int(run), "mode": mode, "step": step, "wall_s": float(wall),
                  "origin_bytes": int(origin_bytes), "report": rep,
                  "experts_on_disk_before": [int(m.group(1)), int(m.group(2))] if m else None}))
EOF
}
# step RUN MODE STEP CMD...: drop caches, run CMD with stdout/stderr in $out, time it, count the
# origin's bytes it caused.
step() {
  local run=$1 mode=$2 name=$3
  shift 3
  local base="$out/run$run-$mode-$name"
  drop
  local b0 t0 t1 b1
  b0=$(served)
  t0=$(now)
  "$@" > "$base.json" 2> "$base.log"
  t1=$(now)
  b1=$(served)
  record "$run" "$mode" "$name" "$(echo "$t1 - $t0" | bc -l)" "$((b1 - b0))" "$base.json" "$base.log"
}

largest=$(ls -S "$ckpt"/*.safetensors | head -1)
limits() {
  local run=$1
  drop
  local r
  r=$(curl -sf -L -o /dev/null -w '%{size_download} %{time_total}' "$endpoint/$repo/resolve/main/$(basename "$largest")")
  echo "{\"run\": $run, \"mode\": \"limit\", \"step\": \"origin\", \"bytes\": ${r% *}, \"seconds\": ${r#* }}" >> "$results"
}
disk() {
  local run=$1
  "$bin" probe-disk --model "$store" --queue-depth 8 --reads 64 > "$out/run$run-probe-disk.json"
  "$python" -c 'import json,sys; r=json.load(open(sys.argv[2])); print(json.dumps({"run": int(sys.argv[1]), "mode": "limit", "step": "disk", "report": r}))' \
    "$run" "$out/run$run-probe-disk.json" >> "$results"
}

gen_flags=${GEN_FLAGS:-}
modes=${MODES:-stream full}
# shellcheck disable=SC2086 # GEN_FLAGS is a list of flags
max_tokens=${MAX_TOKENS:-1}
gen() { "$bin" generate --model "$store" --prompt "$prompt" --max-tokens "$max_tokens" --ignore-eos --json $gen_flags "$@"; }
stream_run() {
  local run=$1
  rm -rf "$store"
  step "$run" stream install "$bin" install "$repo" --to "$store" --mode stream --spine int8 --endpoint "$endpoint" --no-hub-cache --json
  step "$run" stream gen1 gen
  step "$run" stream gen2 gen
  step "$run" stream upgrade "$bin" install --upgrade-to-full "$store" --endpoint "$endpoint" --json
  rm -rf "$store"
}
full_run() {
  local run=$1
  rm -rf "$store"
  step "$run" full install "$bin" install "$repo" --to "$store" --mode full --spine int8 --endpoint "$endpoint" --no-hub-cache --json
  step "$run" full gen1 gen --offline
  disk "$run"
  rm -rf "$store"
}

for run in $(seq "$runs"); do
  echo "run $run of $runs" >&2
  limits "$run"
  case " $modes " in
    *" stream "*" full "* | *" full "*" stream "*)
      if [ $((run % 2)) = 1 ]; then stream_run "$run"; full_run "$run"; else full_run "$run"; stream_run "$run"; fi ;;
    *" stream "*) stream_run "$run" ;;
    *) full_run "$run" ;;
  esac
done

{
  echo "commit $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- crates || echo ' (modified)'); rate $rate bytes/s; prompt '$prompt'; generate flags '$gen_flags'; max tokens $max_tokens; modes '$modes'; runs $runs; page cache dropped: $([ $can_drop = 1 ] && echo yes || echo 'no (not permitted)')"
  echo "machine: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $(nproc) cores, $(free -g | awk '/Mem:/{print $2}') GiB RAM; $(uname -r); store on $(df --output=source "$data" | tail -1)"
  "$python" - "$results" <<'EOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
def med(vals, fmt):
    if not vals:
        return "-"
    s = sorted(vals)
    return f"{fmt(statistics.median(s))} [{fmt(s[0])}-{fmt(s[-1])}]"
secs = lambda v: f"{v:.2f}"
mb = lambda v: f"{v / 1e6:.1f}"
gbps = lambda v: f"{v:.3f}"
def get(mode, step):
    return sorted((r for r in rows if r["mode"] == mode and r["step"] == step), key=lambda r: r["run"])
origin = [r["bytes"] / r["seconds"] / 1e9 for r in get("limit", "origin")]
disk = [r["report"]["gbps"] for r in get("limit", "disk")]
print(f"limits: origin delivered {med(origin, gbps)} GB/s (curl of the largest shard); "
      f"disk O_DIRECT {med(disk, gbps)} GB/s (probe-disk, record size, QD 8)")
print()
print("| mode | step | wall s | TTFT (prompt_s) s | origin MB | client-reported MB | experts on disk before |")
print("|---|---|---|---|---|---|---|")
for mode, steps in (("stream", ["install", "gen1", "gen2", "upgrade"]), ("full", ["install", "gen1"])):
    for st in steps:
        rs = get(mode, st)
        ttft = [r["report"]["timing"]["prompt_s"] for r in rs if "timing" in r["report"]]
        client = [r["report"]["downloaded"] for r in rs if "downloaded" in r["report"]]
        before = {tuple(r["experts_on_disk_before"]) for r in rs if r["experts_on_disk_before"]}
        print(f"| {mode} | {st} | {med([r['wall_s'] for r in rs], secs)} | {med(ttft, secs)} | "
              f"{med([r['origin_bytes'] for r in rs], mb)} | {med(client, mb)} | "
              f"{', '.join(f'{a}/{b}' for a, b in sorted(before)) or '-'} |")
print()
print("time to first token from nothing (install wall + first generate's wall; and + its prompt_s only):")
for mode in ("stream", "full"):
    ins = {r["run"]: r["wall_s"] for r in get(mode, "install")}
    g = {r["run"]: r for r in get(mode, "gen1")}
    tot = [ins[k] + g[k]["wall_s"] for k in ins if k in g]
    tt = [ins[k] + g[k]["report"]["timing"]["prompt_s"] for k in ins if k in g and "timing" in g[k]["report"]]
    print(f"  {mode}: {med(tot, secs)} s (install + generate process); {med(tt, secs)} s (install + prompt_s)")
g1 = get("stream", "gen1")
if g1 and "prompt_tokens" in g1[0]["report"]:
    print(f"prompt tokens: {len(g1[0]['report']['prompt_tokens'])}")
EOF
} | tee "$out/summary.txt"
