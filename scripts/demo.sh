#!/usr/bin/env bash
# Set up and run the main job on the bundled demo model: build Deltafin, convert the tiny Kimi K3
# fixture (a random checkpoint in the real Hugging Face layout) into a store, and generate text.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/ensure-toolchain.sh
cargo build --release --locked -q
store=target/demo-store
./target/release/deltafin convert --from fixtures/k3-tiny/hf --to "$store"
./target/release/deltafin generate --model "$store" --prompt "${1:-The lighthouse keeper}" --max-tokens 24 --ignore-eos
