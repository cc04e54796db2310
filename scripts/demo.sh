#!/usr/bin/env bash
# Set up and run the main job on the bundled demo model: build Deltafin, convert models/k3-demo (a
# tiny model with Kimi K3's architecture, trained for minutes on Python and Rust documentation and
# code, in the real Hugging Face layout; models/k3-demo/README.md says what it is) into a store,
# continue a prompt with it, and ask it a question in Kimi K3's chat format.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/ensure-toolchain.sh
cargo build --release --locked  # cargo shows its progress: the first build takes minutes
store=target/demo-store
./target/release/deltafin convert --from models/k3-demo/hf --to "$store"
echo "== a continuation of a prompt:"
./target/release/deltafin generate --model "$store" --prompt "${1:-To read a file in Python,}" --max-tokens 40 --ignore-eos
echo "== a chat question, in Kimi K3's chat format (what \`deltafin serve\` renders for a chat request):"
./target/release/deltafin generate --model "$store" --chat "${2:-What is \`Vec::push\` used for in Rust?}" --max-tokens 200
