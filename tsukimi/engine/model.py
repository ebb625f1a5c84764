"""The Llama-family decoder in torch, without a KV cache.

This module owns the model's arithmetic: `ModelConfig` (shapes, RoPE, special tokens, and the
`identity` under which KV is exchanged), `LlamaModel` (HF LlamaForCausalLM parameter names,
so a Hugging Face state dict loads after dropping its "model." prefix), rotary embedding in the
HF "rotate_half" layout, and a slow reference greedy loop that the paged engine is tested
against. Weights come from weights.py; the parameters of a fresh `LlamaModel` are uninitialised.

The model owns no KV. Each layer hands its post-RoPE q, k and v to an `Attend` callable, which
stores k/v wherever it likes (the paged cache) and returns the attention output::

    token_ids[T] -> embed -> [ RMSNorm -> q,k,v -> rope(q,k) -> attend(layer,q,k,v) -> o -> +res
                               RMSNorm -> down(silu(gate(x)) * up(x)) -> +res ] x num_layers
             -> RMSNorm -> hidden[T, hidden_size] (float32);   logits(hidden) -> [N, vocab]
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention.bias import causal_lower_right

from tsukimi.config import DTYPE_NAMES, DTypeName
from tsukimi.errors import ConfigError, InvalidArgument

logger = logging.getLogger(__name__)

DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_NAMES}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shapes and constants of a Llama-family model.

    source: where the weights came from ("random_tiny:seed=0", "gguf:NAME:blake2b=..."); part
        of `identity`, so two models of equal shape but different weights never share KV.
    dtype: the parameters' and activations' dtype (logits and returned hidden are float32).
    """

    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position: int = 4096
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: DTypeName = "float32"
    source: str = ""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"model.{name} must be > 0, got {getattr(self, name)}")
        if self.head_dim <= 0 or self.head_dim % 2:
            raise ConfigError(f"model.head_dim must be even and > 0 (RoPE rotates pairs), got {self.head_dim}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"model.num_heads ({self.num_heads}) must be a multiple of num_kv_heads")
        if self.rope_theta <= 0 or self.rms_norm_eps <= 0 or self.max_position <= 0:
            raise ConfigError("model.rope_theta, rms_norm_eps and max_position must be > 0")
        if self.dtype not in DTYPES:
            raise ConfigError(f"model.dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        special = [*self.eos_token_ids, *([] if self.bos_token_id is None else [self.bos_token_id])]
        if not all(0 <= token < self.vocab_size for token in special):
            raise ConfigError(f"model special token ids {special} must be in 0..{self.vocab_size - 1}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V per token over all layers, in the model's dtype."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.torch_dtype.itemsize

    @property
    def identity(self) -> str:
        """A stable hex digest of every field (source included): equal across processes and
        machines exactly when the configs are equal. KV carries it and refuses a mismatch."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        blob = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.blake2b(blob, digest_size=16).hexdigest()


class Attend(Protocol):
    """Stores one layer's new k/v and returns attention of q over the cached and new keys.

    Shapes: q [T, num_heads, head_dim], k and v [T, num_kv_heads, head_dim], result like q.
    q and k are already rotated (RoPE at each token's position).
    """

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor: ...


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool) -> Tensor:
    """Scaled dot-product attention of one sequence's queries over its keys, through torch's
    fused kernels.

    Args:
        q: [T, num_heads, head_dim]; k, v: [S, num_kv_heads, head_dim] (grouped-query heads
            are shared: num_heads is a multiple of num_kv_heads).
        mask: bool [T, S] (True: may attend), a `CausalBias` (`end_aligned_causal`), or None.
        causal: query i sees keys 0..i (top-left aligned: only meaningful when S == T).

    Returns:
        [T, num_heads, head_dim]. Pure.
    """
    # NOTE: 4-D [batch, heads, tokens, dim] with the KV heads expanded: 3-D inputs with
    # enable_gqa fell back to SDPA's math kernel on CUDA (16k tokens of a Llama-3-8B shape: 6.8 s
    # vs 0.535 s with flash; /work/shared/GPU.md). The expansion is a copy; the kernel is worth it.
    groups = q.shape[1] // k.shape[1]
    keys, values = k.transpose(0, 1), v.transpose(0, 1)
    if groups > 1:
        keys, values = keys.repeat_interleave(groups, dim=0), values.repeat_interleave(groups, dim=0)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], keys[None], values[None], attn_mask=mask, is_causal=causal
    )
    return out[0].transpose(0, 1)


def causal_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Scaled dot-product attention of one sequence's queries over its keys, causal.

    Args:
        q: [T, num_heads, head_dim], the last T tokens of the sequence.
        k, v: [S, num_kv_heads, head_dim] with S >= T, the whole sequence; query i sits at
            position S - T + i and sees keys 0..S - T + i (grouped-query heads are shared).

    Returns:
        [T, num_heads, head_dim]. Pure.
    """
    num_new, num_keys = q.shape[0], k.shape[0]
    if num_keys < num_new:
        raise InvalidArgument(f"{num_new} queries but only {num_keys} keys")
    mask = None
    if num_new > 1 and num_keys > num_new:  # causal, aligned to the end of the keys
        mask = end_aligned_causal(num_new, num_keys)
    return attention(q, k, v, mask, num_new > 1 and mask is None)


def end_aligned_causal(num_queries: int, num_keys: int) -> Tensor:
    """The causal mask of the last `num_queries` positions over `num_keys` keys: query i sees
    keys 0..num_keys - num_queries + i (pure).

    NOTE: torch's bottom-right `CausalBias`, not a materialized [T, S] bool tensor: SDPA runs it
    on CUDA's flash kernel (any mask tensor rules flash out; mem-efficient then pads it), and on
    the CPU it materializes the same bool mask, so the CPU's floats are unchanged.
    """
    return causal_lower_right(num_queries, num_keys)


class DenseAttend:
    """`Attend` for ONE sequence run whole (no history, nothing stored): plain causal attention."""

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return causal_attention(q, k, v)


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos and sin tables [T, 1, head_dim] (float32) for `positions` (HF rotate_half layout)."""
    steps = torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device)
    inv_freq = 1.0 / (theta ** (steps.float() / head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    return emb.cos(), emb.sin()


def _apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


def rope(x: Tensor, positions: Tensor, theta: float) -> Tensor:
    """Rotary position embedding of x [T, heads, head_dim] at `positions` [T]. Pure.

    Dimension i pairs with i + head_dim/2 ("rotate_half", as in HF transformers).
    """
    cos, sin = rope_cos_sin(positions, x.shape[-1], theta)
    return _apply_rope(x, cos, sin)


class _Linear(nn.Module):
    """A bias-free linear layer whose weight [out, in] starts uninitialised (loaders fill it)."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight)


class _Embedding(nn.Module):
    """Token embedding [vocab, hidden], uninitialised (loaders fill it)."""

    def __init__(self, num_embeddings: int, size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, size, dtype=dtype), requires_grad=False)

    def forward(self, token_ids: Tensor) -> Tensor:
        return F.embedding(token_ids, self.weight)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 (as HF does) and returned in x's dtype."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, dim, dtype = config.hidden_size, config.head_dim, config.torch_dtype
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, dim
        self.q_proj = _Linear(hidden, config.num_heads * dim, dtype)
        self.k_proj = _Linear(hidden, config.num_kv_heads * dim, dtype)
        self.v_proj = _Linear(hidden, config.num_kv_heads * dim, dtype)
        self.o_proj = _Linear(config.num_heads * dim, hidden, dtype)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attend: Attend, layer: int) -> Tensor:
        num_tokens = x.shape[0]
        q = _apply_rope(self.q_proj(x).view(num_tokens, self.num_heads, self.head_dim), cos, sin)
        k = _apply_rope(self.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim), cos, sin)
        v = self.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        out = attend(layer, q, k, v)
        projected: Tensor = self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))
        return projected


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, inner, dtype = config.hidden_size, config.intermediate_size, config.torch_dtype
        self.gate_proj = _Linear(hidden, inner, dtype)
        self.up_proj = _Linear(hidden, inner, dtype)
        self.down_proj = _Linear(inner, hidden, dtype)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.torch_dtype)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.torch_dtype)
        self.mlp = LlamaMLP(config)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attend: Attend, layer: int) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attend, layer)
        out: Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return out


class LlamaModel(nn.Module):
    """Llama decoder with HF parameter names (embed_tokens, layers.N.self_attn.q_proj, ..., norm,
    lm_head); no lm_head parameter when the embeddings are tied. Parameters start uninitialised
    and never require grad; call under `torch.inference_mode()` for speed."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        dtype = config.torch_dtype
        self.embed_tokens = _Embedding(config.vocab_size, config.hidden_size, dtype)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.lm_head = None if config.tie_word_embeddings else _Linear(config.hidden_size, config.vocab_size, dtype)

    @property
    def device(self) -> torch.device:
        """Where the parameters live (build the model under `with torch.device(...)` to choose)."""
        return self.embed_tokens.weight.device

    def forward(self, token_ids: Tensor, positions: Tensor, attend: Attend) -> Tensor:
        """Runs T tokens (of one or several sequences, concatenated) through every layer.

        Args:
            token_ids: int64 [T], each in 0..vocab_size-1.
            positions: int64 [T], each token's position in its own sequence.
            attend: stores each layer's k/v and attends (see `Attend`); called once per layer.

        Returns:
            float32 [T, hidden_size]: final-normed hidden states (feed rows to `logits`).

        Raises:
            InvalidArgument: shapes or token ids out of range.
        """
        if token_ids.ndim != 1 or positions.shape != token_ids.shape:
            raise InvalidArgument(f"token_ids {tuple(token_ids.shape)} and positions must be equal 1-d shapes")
        if token_ids.numel() == 0:
            raise InvalidArgument("forward needs at least one token")
        if int(token_ids.min()) < 0 or int(token_ids.max()) >= self.config.vocab_size:
            raise InvalidArgument(f"token ids must be in 0..{self.config.vocab_size - 1}")
        x = self.embed_tokens(token_ids)
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta)
        for index, layer in enumerate(self.layers):
            x = layer(x, cos, sin, attend, index)
        hidden: Tensor = self.norm(x)
        return hidden.float()

    def logits(self, hidden: Tensor) -> Tensor:
        """float32 logits [N, vocab_size] of hidden states [N, hidden_size] (as `forward` returns). Pure."""
        weight = (self.embed_tokens if self.lm_head is None else self.lm_head).weight
        return F.linear(hidden.to(weight.dtype), weight).float()


@torch.inference_mode()
def generate_greedy_reference(
    model: LlamaModel, prompt_ids: Sequence[int], max_new_tokens: int, stop_token_ids: Collection[int] = ()
) -> list[int]:
    """Greedy decoding the slow, obviously correct way: re-run the whole sequence every step.

    Args:
        model: the model (not mutated).
        prompt_ids: the prompt's token ids (at least one).
        max_new_tokens: how many tokens to generate at most.
        stop_token_ids: generation ends after emitting one of these (it is included).

    Returns:
        The generated token ids (without the prompt).
    """
    tokens, generated = list(prompt_ids), []
    for _ in range(max_new_tokens):
        ids = torch.tensor(tokens, dtype=torch.int64, device=model.device)
        hidden = model(ids, torch.arange(len(tokens), device=model.device), DenseAttend())
        token = int(model.logits(hidden[-1:]).argmax(dim=-1))
        tokens.append(token)
        generated.append(token)
        if token in stop_token_ids:
            break
    return generated
