#!/usr/bin/env python3
"""llama.cpp's own converter (convert_hf_to_gguf.py of the llama-cpp-python 0.3.36 sdist, its Kimi K3 support) on
the k3-arch checkpoint of tools/k3_arch_checkpoint.py, with one change: the vocabulary. The checkpoint's tokenizer
is a tiny BPE (the benchmarks feed token ids), which K3's converter path cannot load without Moonshot's
tokenization_kimi.py, so this writes a plain SentencePiece-style table of vocab_size entries (256 byte tokens,
the rest placeholders) instead. Every tensor goes through the converter untouched: routed experts repacked to
ggml MXFP4, the rest Q8_0 with --outtype q8_0.

    LLAMA=.../llama_cpp_python-0.3.36/vendor/llama.cpp python convert_gguf.py HF_DIR --outtype q8_0 --outfile X.gguf
"""
import os
import runpy
import sys
from pathlib import Path

llama = Path(os.environ["LLAMA"])
sys.path.insert(0, str(llama))
sys.path.insert(1, str(llama / "gguf-py"))
import gguf  # noqa: E402
import conversion.kimi_k3 as k3  # noqa: E402


def set_vocab(self):
    n = self.hparams["vocab_size"]
    tokens = [f"<0x{i:02X}>" for i in range(256)] + [f"[PAD{i}]" for i in range(256, n)]
    types = [gguf.TokenType.BYTE] * 256 + [gguf.TokenType.NORMAL] * (n - 256)
    types[256] = types[257] = gguf.TokenType.CONTROL
    w = self.gguf_writer
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * n)
    w.add_token_types(types)
    w.add_bos_token_id(256)
    w.add_eos_token_id(257)


k3.KimiK3Model.set_vocab = set_vocab
sys.argv = [str(llama / "convert_hf_to_gguf.py")] + sys.argv[1:]
runpy.run_path(str(llama / "convert_hf_to_gguf.py"), run_name="__main__")
