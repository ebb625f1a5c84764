"""The raw reference model of `tsukimi bench gpu`: a minimal Llama-shaped decoder in plain torch,
random weights, no tokenizer, nothing from tsukimi.engine. It is what the hardware gives, the
row tsukimi's engine is measured against (issue 23), so it stays independent of the engine.

    shape = SHAPES["llama3-8b"]              32 layers, hidden 4096, GQA 32/8, head dim 128
    model = RawDecoder(shape, device, dtype)  random weights made on the device (no CPU init)
    logits, kv = model.forward(tokens, past=None, keep_kv=False)        prefill
    logits, _ = model.forward(new_tokens, past=prefix_kv)                reuse: prefix KV given

Attention is `F.scaled_dot_product_attention` on 4-D inputs `[1, heads, tokens, head_dim]` with
the KV heads expanded (`repeat_interleave`): with 3-D inputs and `enable_gqa` torch fell back to
its math kernel on an H200 (16k tokens 6.8 s instead of 0.535 s; docs: shared GPU.md). New
tokens after a prefix use a lower-right causal mask, which the flash kernel supports.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right

from tsukimi.errors import ConfigError

LayerKV = tuple[torch.Tensor, torch.Tensor]  # K and V of one layer: [tokens, kv_heads, head_dim] each


@dataclass(frozen=True, slots=True)
class RawShape:
    """A Llama-style decoder's sizes (untied embedding and LM head, SwiGLU MLP, RMSNorm, RoPE)."""

    name: str
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads or self.head_dim % 2:
            raise ConfigError(f"{self.name}: heads must be a multiple of KV heads and head_dim even")

    @property
    def num_params(self) -> int:
        """Parameters of the model this shape builds (embedding and LM head counted apart). Pure."""
        qkv = self.hidden * (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        out = self.num_heads * self.head_dim * self.hidden
        mlp = 3 * self.hidden * self.intermediate
        per_layer = qkv + out + mlp + 2 * self.hidden
        return self.num_layers * per_layer + 2 * self.vocab * self.hidden + self.hidden

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """K and V of every layer for one token, in bytes (Llama-3-8B in bf16: 128 KiB). Pure."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype.itemsize


SHAPES = {
    s.name: s
    for s in (
        RawShape("llama3-8b", 32, 4096, 32, 8, 128, 14336, 128256),
        RawShape("smollm2-135m", 30, 576, 9, 3, 64, 1536, 49152),
        RawShape("tiny", 2, 64, 4, 2, 16, 128, 256),
    )
}


def _weight(rows: int, cols: int, device: torch.device, dtype: torch.dtype) -> nn.Parameter:
    # NOTE: made and filled on the device: nn.Linear's CPU init of 8B parameters takes minutes
    data = torch.empty(rows, cols, device=device, dtype=dtype).normal_(std=0.02)
    return nn.Parameter(data, requires_grad=False)


def _norm(size: int, device: torch.device, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.ones(size, device=device, dtype=dtype), requires_grad=False)


class RawLayer(nn.Module):
    """One decoder layer: fused QKV, attention, output projection, fused gate/up SwiGLU."""

    def __init__(self, shape: RawShape, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.shape = shape
        qkv_rows = (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim
        self.attn_norm = _norm(shape.hidden, device, dtype)
        self.qkv = _weight(qkv_rows, shape.hidden, device, dtype)
        self.out = _weight(shape.hidden, shape.num_heads * shape.head_dim, device, dtype)
        self.mlp_norm = _norm(shape.hidden, device, dtype)
        self.gate_up = _weight(2 * shape.intermediate, shape.hidden, device, dtype)
        self.down = _weight(shape.hidden, shape.intermediate, device, dtype)

    def forward(self, x: torch.Tensor, rope: LayerKV, past: LayerKV | None) -> tuple[torch.Tensor, LayerKV]:
        """x [tokens, hidden] -> (x after the layer, this call's K and V). Pure."""
        s = self.shape
        tokens = x.shape[0]
        h = F.rms_norm(x, (s.hidden,), self.attn_norm)
        sizes = [s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim, s.num_kv_heads * s.head_dim]
        q, k, v = torch.split(h @ self.qkv.T, sizes, dim=-1)
        q = _rotate(q.view(tokens, s.num_heads, s.head_dim), rope)
        k = _rotate(k.view(tokens, s.num_kv_heads, s.head_dim), rope)
        v = v.view(tokens, s.num_kv_heads, s.head_dim)
        k_all, v_all = (k, v) if past is None else (torch.cat([past[0], k]), torch.cat([past[1], v]))
        group = s.num_heads // s.num_kv_heads
        q4 = q.transpose(0, 1).unsqueeze(0)  # [1, heads, tokens, head_dim]
        k4 = k_all.transpose(0, 1).repeat_interleave(group, dim=0).unsqueeze(0)
        v4 = v_all.transpose(0, 1).repeat_interleave(group, dim=0).unsqueeze(0)
        if past is None:
            attn = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True)
        else:
            mask = causal_lower_right(tokens, k_all.shape[0])  # new tokens see the whole prefix
            attn = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask)
        x = x + attn.squeeze(0).transpose(0, 1).reshape(tokens, -1) @ self.out.T
        gate, up = (F.rms_norm(x, (s.hidden,), self.mlp_norm) @ self.gate_up.T).chunk(2, dim=-1)
        return x + (F.silu(gate) * up) @ self.down.T, (k, v)


class RawDecoder(nn.Module):
    """The whole model: embedding, `num_layers` RawLayers, final norm, LM head (last token only)."""

    def __init__(self, shape: RawShape, device: torch.device | str, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        device = torch.device(device)
        self.shape = shape
        self.embed = _weight(shape.vocab, shape.hidden, device, dtype)
        self.layers = nn.ModuleList(RawLayer(shape, device, dtype) for _ in range(shape.num_layers))
        self.final_norm = _norm(shape.hidden, device, dtype)
        self.lm_head = _weight(shape.vocab, shape.hidden, device, dtype)
        half = shape.head_dim // 2
        self.inv_freq = 500_000.0 ** (-torch.arange(half, device=device, dtype=torch.float32) / half)

    @torch.inference_mode()
    def forward(
        self, tokens: torch.Tensor, past: list[LayerKV] | None = None, keep_kv: bool = False
    ) -> tuple[torch.Tensor, list[LayerKV]]:
        """Runs `tokens` [n] (token ids on the model's device) after `past` (each layer's K and
        V of the tokens before them, or None: a prefill).

        Returns:
            the last token's logits [vocab], and each layer's K and V of `tokens` when
            `keep_kv` (else an empty list: a timed prefill keeps nothing).
        """
        start = 0 if past is None else past[0][0].shape[0]
        positions = torch.arange(start, start + tokens.shape[0], device=tokens.device, dtype=torch.float32)
        angles = positions[:, None] * self.inv_freq[None, :]
        x = self.embed[tokens]
        rope = (angles.cos().to(x.dtype), angles.sin().to(x.dtype))
        kept: list[LayerKV] = []
        for index, layer in enumerate(self.layers):
            x, kv = layer(x, rope, None if past is None else past[index])
            if keep_kv:
                kept.append(kv)
        last = F.rms_norm(x[-1], (self.shape.hidden,), self.final_norm)
        return self.lm_head @ last, kept


def _rotate(x: torch.Tensor, rope: LayerKV) -> torch.Tensor:
    """RoPE (rotate-half form) on x [tokens, heads, head_dim] with cos/sin [tokens, head_dim / 2]."""
    cos, sin = rope[0][:, None, :], rope[1][:, None, :]
    first, second = x.chunk(2, dim=-1)
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)
