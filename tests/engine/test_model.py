"""LlamaModel on the random tiny weights: config checks, identity, determinism across processes,
GQA shapes, RoPE, the Attend protocol (a prompt in pieces through a cache equals the prompt whole,
several sequences in one forward), and the reference greedy loop."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
import sys

import pytest
import torch

from tsukimi.engine.model import (
    DenseAttend,
    LlamaModel,
    causal_attention,
    generate_greedy_reference,
    rope,
)
from tsukimi.engine.tokenizer import ByteTokenizer
from tsukimi.engine.weights import TINY_CONFIG, LoadedModel, random_tiny
from tsukimi.errors import ConfigError, InvalidArgument

torch.set_num_threads(1)

PROMPT = [1, 76, 105, 112, 112, 115, 36, 123, 115, 118, 112, 104, 4, 40, 41]


def hidden_of(model: LlamaModel, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor(tokens), torch.arange(len(tokens)), DenseAttend())


class ListCache:
    """A minimal test KV cache for one sequence: each layer's keys and values, appended per forward."""

    def __init__(self, num_layers: int) -> None:
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        old_k, old_v = self.k[layer], self.v[layer]
        self.k[layer] = k if old_k is None else torch.cat([old_k, k])
        self.v[layer] = v if old_v is None else torch.cat([old_v, v])
        return causal_attention(q, self.k[layer], self.v[layer])  # type: ignore[arg-type]


def test_config_rejects_bad_values() -> None:
    with pytest.raises(ConfigError, match="head_dim"):
        dataclasses.replace(TINY_CONFIG, head_dim=33)
    with pytest.raises(ConfigError, match="multiple of num_kv_heads"):
        dataclasses.replace(TINY_CONFIG, num_kv_heads=3)
    with pytest.raises(ConfigError, match="float32, bfloat16, float16"):
        dataclasses.replace(TINY_CONFIG, dtype="float64")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="special token"):
        dataclasses.replace(TINY_CONFIG, eos_token_ids=(32000,))
    with pytest.raises(ConfigError, match="num_layers"):
        dataclasses.replace(TINY_CONFIG, num_layers=0)


def test_identity_covers_every_field() -> None:
    base = TINY_CONFIG.identity
    assert len(base) == 32 and base == dataclasses.replace(TINY_CONFIG).identity
    assert dataclasses.replace(TINY_CONFIG, source="other").identity != base
    assert dataclasses.replace(TINY_CONFIG, rope_theta=10000.5).identity != base
    assert dataclasses.replace(TINY_CONFIG, eos_token_ids=(2, 3)).identity != base
    assert TINY_CONFIG.kv_bytes_per_token == 2 * 4 * 2 * 32 * 4


_FINGERPRINT = """
import hashlib, torch
torch.set_num_threads(1)
from tsukimi.engine.model import DenseAttend
from tsukimi.engine.weights import random_tiny
lm = random_tiny(0)
tokens = {tokens}
with torch.inference_mode():
    logits = lm.model.logits(lm.model(torch.tensor(tokens), torch.arange(len(tokens)), DenseAttend()))
print(lm.config.identity, hashlib.sha256(logits.numpy().tobytes()).hexdigest())
"""


def test_tiny_model_is_identical_in_another_process(tiny: LoadedModel) -> None:
    with torch.inference_mode():
        logits = tiny.model.logits(hidden_of(tiny.model, PROMPT))
    here = f"{tiny.config.identity} {hashlib.sha256(logits.numpy().tobytes()).hexdigest()}"
    env = {**os.environ, "PYTHONHASHSEED": "12345", "OMP_NUM_THREADS": "1"}
    code = _FINGERPRINT.format(tokens=PROMPT)
    there = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, check=True
    )
    assert there.stdout.strip() == here


def test_same_seed_same_weights_other_seed_differs(tiny: LoadedModel) -> None:
    again, other = random_tiny(0), random_tiny(1)
    for name, tensor in tiny.model.state_dict().items():
        assert torch.equal(tensor, again.model.state_dict()[name]), name
    assert not torch.equal(tiny.model.layers[0].self_attn.q_proj.weight, other.model.layers[0].self_attn.q_proj.weight)
    assert tiny.config.identity != other.config.identity


def test_greedy_output_depends_on_the_prompt(tiny: LoadedModel) -> None:
    tokenizer = ByteTokenizer()
    prompts = ["Hello", "Hello world", "The capital of France is", "abc", "xbc"]  # abc/xbc: same last token
    outputs = [generate_greedy_reference(tiny.model, tokenizer.encode(p), 6) for p in prompts]
    assert len({tuple(o) for o in outputs}) == len(prompts)
    for output in outputs:
        assert len(output) == 6 and len(set(output)) > 2, output


def test_greedy_reference_stops_at_a_stop_token(tiny: LoadedModel) -> None:
    full = generate_greedy_reference(tiny.model, PROMPT, 5)
    assert generate_greedy_reference(tiny.model, PROMPT, 5, stop_token_ids={full[2]}) == full[:3]


def test_gqa_shapes_and_dtypes(tiny: LoadedModel) -> None:
    seen: list[tuple[int, tuple[int, ...], tuple[int, ...], tuple[int, ...]]] = []
    dense = DenseAttend()

    def recording(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        seen.append((layer, tuple(q.shape), tuple(k.shape), tuple(v.shape)))
        return dense(layer, q, k, v)

    with torch.inference_mode():
        hidden = tiny.model(torch.tensor(PROMPT[:5]), torch.arange(5), recording)
        logits = tiny.model.logits(hidden[-2:])
    assert seen == [(layer, (5, 8, 32), (5, 2, 32), (5, 2, 32)) for layer in range(4)]
    assert hidden.shape == (5, 256) and hidden.dtype == torch.float32
    assert logits.shape == (2, 32000) and logits.dtype == torch.float32


def test_rope_depends_only_on_relative_position() -> None:
    generator = torch.Generator().manual_seed(3)
    q, k = torch.randn(1, 1, 64, generator=generator), torch.randn(1, 1, 64, generator=generator)

    def score(m: int, n: int) -> float:
        rq, rk = rope(q, torch.tensor([m]), 10000.0), rope(k, torch.tensor([n]), 10000.0)
        return float((rq * rk).sum())

    for m, n in [(5, 2), (2, 5), (0, 0), (7, 7)]:
        for shift in (1, 100, 3000):
            assert score(m + shift, n + shift) == pytest.approx(score(m, n), abs=1e-3)
    assert score(5, 2) != pytest.approx(score(5, 3), abs=1e-3)
    assert torch.allclose(rope(q, torch.tensor([0]), 10000.0), q)
    assert torch.allclose(rope(q, torch.tensor([1234]), 10000.0).norm(), q.norm())


def test_rope_rotates_halves_like_hf() -> None:
    """Dimension i pairs with i + D/2 and turns by position * theta^(-2i/D)."""
    x = torch.randn(3, 2, 8, generator=torch.Generator().manual_seed(4))
    positions = torch.tensor([0, 3, 17])
    angle = positions[:, None, None].float() * 10000.0 ** (-torch.arange(4).float() * 2 / 8)
    as_complex = torch.complex(x[..., :4], x[..., 4:]) * torch.polar(torch.ones_like(angle), angle)
    expected = torch.cat([as_complex.real, as_complex.imag], dim=-1)
    assert torch.allclose(rope(x, positions, 10000.0), expected, atol=1e-5)


def test_prompt_in_pieces_through_a_cache_equals_whole(tiny: LoadedModel) -> None:
    whole = hidden_of(tiny.model, PROMPT)
    cache, pieces = ListCache(tiny.config.num_layers), []
    with torch.inference_mode():
        for start, stop in [(0, 9), (9, 13), (13, 14), (14, 15)]:  # two chunks, then decode steps
            pieces.append(tiny.model(torch.tensor(PROMPT[start:stop]), torch.arange(start, stop), cache))
    assert torch.allclose(torch.cat(pieces), whole, atol=1e-5)


def test_several_sequences_in_one_forward(tiny: LoadedModel) -> None:
    """Two sequences concatenated (a new prompt, and one decode step of a cached sequence)."""
    first, second = PROMPT[:6], PROMPT[3:12]
    cache = ListCache(tiny.config.num_layers)
    with torch.inference_mode():
        tiny.model(torch.tensor(second[:-1]), torch.arange(len(second) - 1), cache)

    def batched(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        n = len(first)
        return torch.cat([causal_attention(q[:n], k[:n], v[:n]), cache(layer, q[n:], k[n:], v[n:])])

    tokens = torch.tensor([*first, second[-1]])
    positions = torch.tensor([*range(len(first)), len(second) - 1])
    with torch.inference_mode():
        hidden = tiny.model(tokens, positions, batched)
    assert torch.allclose(hidden[: len(first)], hidden_of(tiny.model, first), atol=1e-5)
    assert torch.allclose(hidden[-1], hidden_of(tiny.model, second)[-1], atol=1e-5)


def test_causal_attention_aligns_queries_to_the_end() -> None:
    generator = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(7, heads, 16, generator=generator) for heads in (4, 2, 2))
    full = causal_attention(q, k, v)
    assert torch.allclose(causal_attention(q[4:], k, v), full[4:], atol=1e-6)
    assert torch.allclose(causal_attention(q[6:], k, v), full[6:], atol=1e-6)
    with pytest.raises(InvalidArgument):
        causal_attention(q, k[:3], v[:3])


def test_forward_rejects_bad_inputs(tiny: LoadedModel) -> None:
    model, attend = tiny.model, DenseAttend()
    with pytest.raises(InvalidArgument, match=r"0\.\.31999"):
        model(torch.tensor([1, 32000]), torch.arange(2), attend)
    with pytest.raises(InvalidArgument, match="1-d"):
        model(torch.tensor([1, 2]), torch.arange(3), attend)
    with pytest.raises(InvalidArgument, match="at least one"):
        model(torch.tensor([], dtype=torch.int64), torch.arange(0), attend)


def test_bfloat16_model_is_close_to_float32(tiny: LoadedModel) -> None:
    half = random_tiny(0, dtype="bfloat16")
    assert half.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    assert half.config.identity != tiny.config.identity
    hidden = hidden_of(half.model, PROMPT)
    with torch.inference_mode():
        logits, reference = half.model.logits(hidden), tiny.model.logits(hidden_of(tiny.model, PROMPT))
    assert hidden.dtype == logits.dtype == torch.float32
    assert torch.corrcoef(torch.stack([logits.flatten(), reference.flatten()]))[0, 1] > 0.99
