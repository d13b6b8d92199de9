"""A GPT-2-shaped decoder in plain torch: the realistic model of the GPU benchmark.

``GPT2_SMALL`` has GPT-2 small's shape (12 layers, 12 heads, width 768, 1024 positions,
50257-token vocabulary, tied embedding): 124M parameters in 148 tensors. Nothing is
downloaded; weights are random (seeded), which is all a step-time measurement needs.
``TINY`` is the same code at a size a CPU runs in milliseconds, for dry runs and tests.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True, kw_only=True)
class GPTShape:
    """Sizes of the decoder and of one training batch."""

    layers: int
    heads: int
    width: int
    vocab: int
    context: int
    """Positions the model embeds; also the sequence length of a batch."""
    batch: int
    """Sequences per step."""

    def __post_init__(self) -> None:
        if self.width % self.heads:
            raise ValueError("width must be a multiple of heads")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


GPT2_SMALL = GPTShape(layers=12, heads=12, width=768, vocab=50257, context=1024, batch=8)
TINY = GPTShape(layers=2, heads=2, width=64, vocab=256, context=32, batch=4)
SHAPES = {"gpt2-small": GPT2_SMALL, "tiny": TINY}


class Block(nn.Module):
    def __init__(self, shape: GPTShape) -> None:
        super().__init__()
        self.heads = shape.heads
        self.ln_1 = nn.LayerNorm(shape.width)
        self.qkv = nn.Linear(shape.width, 3 * shape.width)
        self.attn_proj = nn.Linear(shape.width, shape.width)
        self.ln_2 = nn.LayerNorm(shape.width)
        self.fc = nn.Linear(shape.width, 4 * shape.width)
        self.mlp_proj = nn.Linear(4 * shape.width, shape.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_proj(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp_proj(F.gelu(self.fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    """Token and position embeddings, pre-norm blocks, a final norm, a tied output head."""

    def __init__(self, shape: GPTShape) -> None:
        super().__init__()
        self.wte = nn.Embedding(shape.vocab, shape.width)
        self.wpe = nn.Embedding(shape.context, shape.width)
        self.blocks = nn.ModuleList(Block(shape) for _ in range(shape.layers))
        self.ln_f = nn.LayerNorm(shape.width)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean next-token cross-entropy (float32) of ``tokens`` against ``targets``."""
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(positions)
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def build_gpt(shape: GPTShape, *, seed: int = 0) -> GPT:
    """The model on the CPU, in float32, identically initialised for the same seed."""
    torch.manual_seed(seed)
    model = GPT(shape)
    for name, param in model.named_parameters():
        if name.endswith("weight") and param.dim() == 2:
            nn.init.normal_(param, std=0.02)
    return model


def batch(
    shape: GPTShape, device: torch.device | str, *, seed: int = 1
) -> tuple[torch.Tensor, ...]:
    """One batch of random tokens and their targets on ``device``."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, shape.vocab, (shape.batch, shape.context + 1), generator=gen)
    return tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device)


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
