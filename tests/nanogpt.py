"""nanoGPT's model as written (length assert, buffer-sliced attention): fx cannot trace it, torch.export can."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, BLOCK, EMBD = 64, 32, 16


class Attention(nn.Module):
    def __init__(self, p: float, flash: bool):
        super().__init__()
        self.c_attn, self.c_proj = nn.Linear(EMBD, 3 * EMBD), nn.Linear(EMBD, EMBD)
        self.attn_dropout, self.resid_dropout = nn.Dropout(p), nn.Dropout(p)
        self.p, self.flash, self.n_head = p, flash, 2
        self.register_buffer("bias", torch.tril(torch.ones(BLOCK, BLOCK)).view(1, 1, BLOCK, BLOCK))

    def forward(self, x):  # nanoGPT's CausalSelfAttention: (B, T, C) -> (B, T, C)
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(EMBD, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        if self.flash:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.p if self.training else 0.0, is_causal=True)
        else:  # the slow path slices a buffer with T: fx cannot trace that at all
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = self.attn_dropout(F.softmax(att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf")), dim=-1))
            y = att @ v
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C)))


class Block(nn.Module):
    def __init__(self, p: float, flash: bool):
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(EMBD), Attention(p, flash), nn.LayerNorm(EMBD)
        self.mlp = nn.Sequential(nn.Linear(EMBD, 4 * EMBD), nn.GELU(), nn.Linear(4 * EMBD, EMBD), nn.Dropout(p))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """nanoGPT's GPT (flat: wte, wpe, drop, h.i, ln_f, lm_head), tied embedding, the length assert in forward."""

    def __init__(self, n_layer: int = 2, dropout: float = 0.0, check: bool = True, flash: bool = True):
        super().__init__()
        self.check = check
        self.wte, self.wpe, self.drop = nn.Embedding(VOCAB, EMBD), nn.Embedding(BLOCK, EMBD), nn.Dropout(dropout)
        self.h = nn.ModuleList([Block(dropout, flash) for _ in range(n_layer)])
        self.ln_f, self.lm_head = nn.LayerNorm(EMBD), nn.Linear(EMBD, VOCAB, bias=False)
        self.wte.weight = self.lm_head.weight  # nanoGPT ties this way round

    def forward(self, idx, targets=None):  # idx (B, T) -> logits (B, T, V)
        b, t = idx.size()
        if self.check:
            assert t <= BLOCK, f"Cannot forward sequence of length {t}, block size is only {BLOCK}"
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)  # (T,)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())
