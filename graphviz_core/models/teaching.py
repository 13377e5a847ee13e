"""The built-in teaching models (MLP, one transformer block, a GPT-2 stack), their example batches and losses.

The loss is computed outside every model's `forward` (see `loss`) so that per-module attribution of autograd nodes
stays honest: nothing the loss creates is charged to the model. graphviz_core.models.builtin describes them as
families.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from graphviz_core.models.checkpoint_policies import CHECKPOINT_KWARGS, LAYER_POLICIES, RECOMPUTED, run_checkpointed
from graphviz_core.models.family import Batch

if TYPE_CHECKING:
    from graphviz_core.config import ModelConfig


TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CoreAttention(nn.Module):
    """softmax(q kᵀ / sqrt(d)) v, fused (`sdpa`) or spelled out op by op (`manual`)."""

    def __init__(self, kind: str, causal: bool) -> None:
        super().__init__()
        self.kind = kind
        self.causal = causal

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q, k, v: (B, nh, T, hs)
        if self.kind == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)  # (B, nh, T, hs)
        seq = q.size(-2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1)))  # (B, nh, T, T)
        if self.causal:
            mask = torch.ones(seq, seq, dtype=torch.bool, device=q.device).triu(1)  # (T, T), True above diagonal
            att = att.masked_fill(mask, float("-inf"))
        att = F.softmax(att, dim=-1)
        return att @ v  # (B, nh, T, hs)


class SelfAttention(nn.Module):
    """Multi-head self-attention: `sdpa` and `manual` share projections; `mha` is nn.MultiheadAttention."""

    def __init__(self, config: ModelConfig, causal: bool) -> None:
        super().__init__()
        self.heads = config.heads
        self.causal = causal
        self.kind = config.attention
        # selective-attention recomputes the core attention only: the s x s part that is cheap to recompute and
        # expensive to keep (Korthikanti et al. 2022; "Backprop as a Graph").
        self.recompute_core = config.checkpoint == "selective-attention"
        if self.kind == "mha":
            self.mha = nn.MultiheadAttention(config.hidden, config.heads, batch_first=True)
            setattr(self.mha, RECOMPUTED, self.recompute_core)
        else:
            self.qkv = nn.Linear(config.hidden, 3 * config.hidden)
            self.core = CoreAttention(self.kind, causal)
            setattr(self.core, RECOMPUTED, self.recompute_core)
            self.proj = nn.Linear(config.hidden, config.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape  # (B, T, C)
        if self.kind == "mha":
            mask = None
            if self.causal:
                mask = torch.ones(seq, seq, dtype=torch.bool, device=x.device).triu(1)  # (T, T)
            if self.recompute_core:
                return checkpoint(self._mha, x, mask, **CHECKPOINT_KWARGS)
            return self._mha(x, mask)
        # Heads and widths come from the projection's output, not the config, so that under tensor
        # parallelism (graphviz_core.parallel.tensor) a rank whose qkv holds 3C/tp columns runs nh/tp whole heads.
        head_dim = hidden // self.heads
        q, k, v = self.qkv(x).chunk(3, dim=2)  # 3 x (B, T, C) (C/tp per rank under TP)
        q = q.view(batch, seq, -1, head_dim).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(batch, seq, -1, head_dim).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(batch, seq, -1, head_dim).transpose(1, 2)  # (B, nh, T, hs)
        if self.recompute_core:
            y = checkpoint(self.core, q, k, v, **CHECKPOINT_KWARGS)
        else:
            y = self.core(q, k, v)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(batch, seq, -1)  # (B, T, C)
        return self.proj(y)

    def _mha(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        # need_weights=False lets nn.MultiheadAttention take the fused SDPA path ("Why Your Transformer Block Has 50 Backward Nodes").
        out, _ = self.mha(x, x, x, need_weights=False, attn_mask=mask, is_causal=mask is not None)
        return out


class FeedForward(nn.Module):
    """Linear(h, 4h) -> GELU (tanh, as GPT-2) -> Linear(4h, h)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(hidden, 4 * hidden)
        self.act = nn.GELU(approximate="tanh")
        self.proj = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.fc(x)))


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, config: ModelConfig, causal: bool) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.hidden)
        self.attn = SelfAttention(config, causal)
        self.ln_2 = nn.LayerNorm(config.hidden)
        self.mlp = FeedForward(config.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def _mark_recomputed(modules: nn.ModuleList, policy: str) -> None:
    for module in modules:
        setattr(module, RECOMPUTED, policy in LAYER_POLICIES)


class MLP(nn.Module):
    """`layers` feed-forward stacks (Linear -> GELU -> Linear) over (B, T, h) inputs."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(FeedForward(config.hidden) for _ in range(config.layers))
        self.checkpoint_policy = config.checkpoint
        _mark_recomputed(self.layers, self.checkpoint_policy)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = run_checkpointed(layer, x, self.checkpoint_policy, self)
        return x


class BlockModel(nn.Module):
    """One transformer block on random (B, T, h) inputs ("Why Your Transformer Block Has 50 Backward Nodes"'s subject); not causal, as an encoder."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.block = Block(config, causal=False)
        self.checkpoint_policy = config.checkpoint
        setattr(self.block, RECOMPUTED, self.checkpoint_policy in LAYER_POLICIES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return run_checkpointed(self.block, x, self.checkpoint_policy, self)


class GPT2(nn.Module):
    """GPT-2 as in "Backpropagating through GPT-2": token + position embeddings, pre-LN blocks, final LayerNorm, tied lm_head."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(config.vocab, config.hidden)
        self.wpe = nn.Embedding(config.positions, config.hidden)
        self.blocks = nn.ModuleList(Block(config, causal=True) for _ in range(config.layers))
        self.ln_f = nn.LayerNorm(config.hidden)
        self.lm_head = nn.Linear(config.hidden, config.vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as GPT-2: one parameter, two uses
        self.checkpoint_policy = config.checkpoint
        _mark_recomputed(self.blocks, self.checkpoint_policy)
        self.apply(_gpt2_init)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        seq = idx.size(1)  # idx: (B, T)
        pos = torch.arange(seq, device=idx.device)  # (T,)
        x = self.wte(idx) + self.wpe(pos)  # (B, T, C)
        for block in self.blocks:
            x = run_checkpointed(block, x, self.checkpoint_policy, self)
        return self.lm_head(self.ln_f(x))  # (B, T, V)


def _gpt2_init(module: nn.Module) -> None:
    # GPT-2's initialisation (as nanoGPT): N(0, 0.02) weights, zero biases. PyTorch's N(0, 1) embedding
    # default makes tied logits huge (initial loss ~42 instead of ~ln V).
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def build(module_class: type[nn.Module], config: ModelConfig) -> nn.Module:
    """`module_class(config)` at the config's dtype, in training mode (seeded by the registry's build_model)."""
    return module_class(config).to(TORCH_DTYPES[config.dtype]).train()


def random_batch(config: ModelConfig, device: torch.device | str, tokens: bool) -> Batch:
    """Random token ids and next tokens (`tokens`) or (B, T, h) inputs and targets, reproducible from `config.seed`;
    empty tensors of those shapes on meta."""
    dtype = TORCH_DTYPES[config.dtype]
    shape = (config.batch, config.seq)
    if str(device) == "meta":
        if tokens:
            return Batch(torch.empty(shape, dtype=torch.long, device="meta"), torch.empty(shape, dtype=torch.long, device="meta"))
        full = (*shape, config.hidden)
        return Batch(torch.empty(full, dtype=dtype, device="meta"), torch.empty(full, dtype=dtype, device="meta"))
    gen = torch.Generator(device=device).manual_seed(config.seed + 1)
    if tokens:
        idx = torch.randint(config.vocab, shape, generator=gen, device=device)  # (B, T)
        targets = torch.randint(config.vocab, shape, generator=gen, device=device)  # (B, T)
        return Batch(idx, targets)
    full = (*shape, config.hidden)  # (B, T, C)
    return Batch(
        torch.randn(full, generator=gen, device=device).to(dtype),
        torch.randn(full, generator=gen, device=device).to(dtype),
    )


def loss(output: torch.Tensor, targets: torch.Tensor, cross_entropy: bool) -> torch.Tensor:
    """Cross-entropy against random tokens (`cross_entropy`), mean squared error against random targets otherwise."""
    if cross_entropy:
        return F.cross_entropy(output.view(-1, output.size(-1)), targets.view(-1))  # (B*T, V) vs (B*T,)
    return F.mse_loss(output, targets)
