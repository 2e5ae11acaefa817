"""The demo model: a small Llama-style decoder written in plain PyTorch (no downloads).

GQA, RoPE, SwiGLU and RMSNorm, with attention written out by hand (``q @ k^T``, a ``masked_fill`` causal
mask built from ``triu``, an fp32 softmax and ``@ v``, K/V repeated for GQA with ``expand + reshape``),
which is what effpass's passes rewrite. Used by ``effpass demo``, the tests and the benchmarks.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["DemoConfig", "DemoLM", "Block", "Attention"]


@dataclass
class DemoConfig:
    vocab_size: int = 512
    dim: int = 128
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 256
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    dropout: float = 0.0
    tie_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_tables(cfg: DemoConfig, device=None):
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, device=device).float() / cfg.head_dim))
    t = torch.arange(cfg.max_seq_len, device=device).float()
    freqs = torch.outer(t, inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: DemoConfig):
        super().__init__()
        self.cfg = cfg
        self.n_heads, self.n_kv, self.hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * self.hd, bias=False)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * self.hd, bias=False)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * self.hd, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * self.hd, cfg.dim, bias=False)
        self.dropout = cfg.dropout

    def forward(self, x, cos, sin):
        B, S, _ = x.shape
        q = self.q_proj(x).view(B, S, self.n_heads, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(B, S, self.n_kv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(B, S, self.n_kv, self.hd).transpose(1, 2)
        cos, sin = cos[:S], sin[:S]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        rep = self.n_heads // self.n_kv
        if rep > 1:  # GQA: repeat K/V heads (expand + reshape, as Hugging Face's repeat_kv does)
            k = k[:, :, None].expand(B, self.n_kv, rep, S, self.hd).reshape(B, self.n_heads, S, self.hd)
            v = v[:, :, None].expand(B, self.n_kv, rep, S, self.hd).reshape(B, self.n_heads, S, self.hd)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.hd)
        mask = torch.triu(torch.ones(S, S, dtype=torch.bool, device=x.device), diagonal=1)
        scores = scores.masked_fill(mask, float("-inf"))
        probs = F.softmax(scores.float(), dim=-1).to(q.dtype)
        probs = F.dropout(probs, p=self.dropout, training=self.training)
        out = (probs @ v).transpose(1, 2).reshape(B, S, -1)
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, cfg: DemoConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: DemoConfig):
        super().__init__()
        self.input_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_norm(x), cos, sin)
        return x + self.mlp(self.post_attn_norm(x))


class DemoLM(nn.Module):
    """``DemoLM(cfg)(tokens, labels=None)`` returns logits, or ``(loss, logits)`` when labels are given."""

    def __init__(self, cfg: DemoConfig | None = None):
        super().__init__()
        cfg = cfg or DemoConfig()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        cos, sin = rope_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, tokens, labels=None):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, self.rope_cos, self.rope_sin)
        logits = self.lm_head(self.norm(x))
        if labels is None:
            return logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)).float(), labels[:, 1:].reshape(-1))
        return loss, logits
