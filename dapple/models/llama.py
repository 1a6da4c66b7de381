"""A Llama-style decoder (RMSNorm, rotary embeddings, grouped-query attention, SwiGLU) that torch.fx can trace, with
the ``state_dict`` names of transformers' ``LlamaForCausalLM``, so its checkpoints load by name."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class LlamaConfig:
    """Defaults: TinyLlama-1.1B's shape (1.1B parameters)."""

    vocab_size: int = 32000
    hidden_size: int = 2048
    intermediate_size: int = 5632
    num_hidden_layers: int = 22
    num_attention_heads: int = 32
    num_key_value_heads: int = 4
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., C) -> same
        h = x.to(torch.promote_types(x.dtype, torch.float32))  # half precision: normalised in float32
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


@torch.fx.wrap
def _positions(length: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """0 .. length-1, (T,): one fx call, as torch < 2.9's fx cannot trace arange of a traced size."""
    return torch.arange(length, device=device, dtype=dtype)


class RotaryEmbedding(nn.Module):
    """cos and sin of the rotary angles, (T, head_dim) each; ``inv_freq`` is computed at construction (a
    non-persistent buffer, as transformers has it) and again by ``reset_parameters``."""

    inv_freq: torch.Tensor  # a buffer (register_buffer)

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        self.head_dim, self.theta = head_dim, theta
        self.register_buffer("inv_freq", self.frequencies(), persistent=False)

    def frequencies(self, device: torch.device | None = None) -> torch.Tensor:
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=device).float() / self.head_dim
        return 1.0 / (self.theta ** exponents)  # (head_dim / 2,)

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.inv_freq.copy_(self.frequencies(self.inv_freq.device))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        positions = _positions(x.size(1), x.device, self.inv_freq.dtype)  # (T,): from sizes alone
        angles = torch.outer(positions, self.inv_freq)  # (T, head_dim / 2)
        emb = torch.cat((angles, angles), dim=-1)  # (T, head_dim)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of x (B, heads, T, head_dim), halves rotated as transformers does."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.q_proj = nn.Linear(cfg.hidden_size, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape  # (B, T, C)
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)  # (B, H, T, hd)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)  # (B, KV, T, hd)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        repeat = self.heads // self.kv_heads  # each key/value head serves `repeat` query heads
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)  # (B, H, T, hd)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, hd)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))  # (B, T, C)


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> same
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, rotary: RotaryEmbedding) -> torch.Tensor:  # (B, T, C) -> same
        cos, sin = rotary(x)  # from this layer's own input's length: a stage needs nothing else for it
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.hidden_size // cfg.num_attention_heads, cfg.rope_theta)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, C)
        x = self.embed_tokens(idx)
        for layer in self.layers:
            x = layer(x, self.rotary_emb)  # the layers share the rotary table's buffer
        return self.norm(x)


class Llama(nn.Module):
    """A Llama-style causal LM: idx (B, T) -> logits (B, T, V). ``state_dict`` names are those of transformers'
    ``LlamaForCausalLM`` (``model.layers.3.self_attn.q_proj.weight``, ``lm_head.weight``)."""

    def __init__(self, cfg: LlamaConfig | None = None, **overrides):
        super().__init__()
        cfg = cfg or LlamaConfig(**overrides)
        self.cfg = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.apply(self.init_weights)

    def init_weights(self, module: nn.Module) -> None:
        """Initialise one module as a fresh model is: linear and embedding weights N(0, initializer_range), norms
        at one, rotary frequencies computed (an ``init_fn`` for :func:`dapple.pipeline` of a meta-device model)."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=self.cfg.initializer_range)
        elif isinstance(module, (RMSNorm, RotaryEmbedding)):
            module.reset_parameters()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(idx))  # (B, T, V)
