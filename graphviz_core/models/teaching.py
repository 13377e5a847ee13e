"""The built-in teaching models (MLP, one transformer block, a GPT-2 stack), their example batches and losses.

The loss is computed outside every model's `forward` (see `loss`) so that per-module attribution of autograd nodes
stays honest: nothing the loss creates is charged to the model. graphviz_core.models.builtin describes them as
families.
"""

from __future__ import annotations

import math
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from graphviz_core.models.family import Batch

if TYPE_CHECKING:
    from graphviz_core.config import ModelConfig

# Set on modules whose forward runs under torch.utils.checkpoint: the capture counts the inputs that the
# checkpoint keeps for recomputation, which no saved-tensor hook sees.
RECOMPUTED = "recomputed_in_backward"
# Set on a model whose layers run a selective-checkpoint policy (graphviz_core.models.hf): the bytes of the op outputs
# the policy stored in forward, which the checkpoint keeps itself where no saved-tensor hook sees them.
KEPT_BYTES = "selective_checkpoint_kept_bytes"

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# No model here draws random numbers in forward (no dropout), so recompute needs no saved RNG state; and saving it
# is harmful on a shared server: checkpoint's recompute sets torch's one global generator back to the forward's
# state (and restores it after), which, in another thread, corrupted a model being initialised from that generator
# under graphviz_core.models.registry's build lock (5 of 15 transformer-block builds got other weights beside full-checkpoint captures).
CHECKPOINT_KWARGS = {"use_reentrant": False, "preserve_rng_state": False}

# `selective-ops` (torchtitan's op-level selective activation checkpointing), for every family: inside a checkpointed
# layer, keep the outputs of the compute-heavy ops (matrix multiplications, convolutions, attention kernels: expensive
# to recompute) and recompute everything else (norms, activations, rotary, elementwise: cheap per byte kept).
# torchtitan also recomputes every second mm to balance memory; this policy keeps them all (that one is
# `selective-ops-torchtitan`, below).
KEEP_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default,
    torch.ops.aten.convolution.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
}


# `selective-ops-torchtitan`: torchtitan's op-level selective activation checkpointing exactly ("TorchTitan:
# One-stop PyTorch native solution for production ready LLM pre-training"; repo pytorch/torchtitan,
# torchtitan/parallelisms/parallelize_llama.py, `_save_list` and `_get_custom_policy`, Dec 2024): keep the outputs of
# the ops in its save list except every second aten.mm of each checkpointed layer run (a count of mm calls that
# starts at 0 for every run of the layer: the 2nd, 4th, 6th... are recomputed), recompute everything else. Like
# torchtitan it counts forward and recompute apart; this torch asks the policy in forward only and replays those
# decisions in the recompute (SelectiveCheckpointContext.is_recompute is always False). Its list names the CUDA attention kernels; the CPU's fused kernel, which SDPA runs here
# on CPU (and on meta for a CPU target), stands in for them. Not in it: aten.addmm (a Linear with a bias), bmm,
# convolutions, grouped expert matmuls: recomputed.
MM = torch.ops.aten.mm.default
TORCHTITAN_SAVE_OPS = {
    MM,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,  # the CPU's stand-in for the two above
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    # for low precision training torchtitan always saves the result of max(abs(tensor))
    torch.ops.aten.abs.default,
    torch.ops.aten.max.default,
}


def _count_kept(model: nn.Module, ctx, op, args, kwargs) -> None:
    """Add the bytes of `op`'s output to `model`'s KEPT_BYTES: the checkpoint stores these outputs itself, where no
    saved-tensor hook sees them. torch hands the policy the output (`ctx.op_output`); a tensor-parallel DTensor
    keeps its local shard (`_local_tensor`), the bytes this rank holds. Without `op_output` (an older torch) the op
    runs again on meta copies of its arguments (shapes only, no arithmetic)."""
    out = getattr(ctx, "op_output", None)
    if out is None:
        # With the dispatch modes below this one switched off: the capture's FLOP counter and storage observer
        # would otherwise count this shape computation as a second forward op (llama-tiny's forward read
        # 25.3 MFLOP under selective-ops instead of 14.8).
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():
            meta = torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), (args, kwargs))
            out = op(*meta[0], **meta[1])
    tensors = (getattr(t, "_local_tensor", t) for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
    kept = sum(t.numel() * t.element_size() for t in tensors)
    setattr(model, KEPT_BYTES, getattr(model, KEPT_BYTES, 0) + kept)


def _keep_compute_heavy(model: nn.Module, ctx, op, *args, **kwargs):
    if op not in KEEP_OPS:
        return CheckpointPolicy.PREFER_RECOMPUTE
    if not ctx.is_recompute:
        _count_kept(model, ctx, op, args, kwargs)
    return CheckpointPolicy.MUST_SAVE


def keep_compute_heavy_contexts(model: nn.Module):
    """`context_fn` for torch.utils.checkpoint running the `selective-ops` policy; the bytes it keeps are added up
    on `model` (KEPT_BYTES), the whole model the capture reads them from."""
    return partial(create_selective_checkpoint_contexts, partial(_keep_compute_heavy, model))


def _torchtitan_policy(model: nn.Module, mm_counts: dict, ctx, op, *args, **kwargs):
    mode = "recompute" if ctx.is_recompute else "forward"
    if op == MM:
        mm_counts[mode] += 1
    if op not in TORCHTITAN_SAVE_OPS or (op == MM and mm_counts[mode] % 2 == 0):
        return CheckpointPolicy.PREFER_RECOMPUTE
    if not ctx.is_recompute:
        _count_kept(model, ctx, op, args, kwargs)
    return CheckpointPolicy.MUST_SAVE


def torchtitan_contexts(model: nn.Module):
    """`context_fn` for torch.utils.checkpoint running `selective-ops-torchtitan`: called once per checkpointed run
    of a layer, each call with its own mm counts, as torchtitan's `selective_checkpointing_context_fn`."""

    def context_fn():
        return create_selective_checkpoint_contexts(partial(_torchtitan_policy, model, {"forward": 0, "recompute": 0}))

    return context_fn


# The selective policies that checkpoint whole layers, each with the `context_fn` maker of its op policy.
SELECTIVE_OPS_CONTEXTS = {"selective-ops": keep_compute_heavy_contexts, "selective-ops-torchtitan": torchtitan_contexts}


def run_checkpointed(layer, x: torch.Tensor, policy: str, model: nn.Module) -> torch.Tensor:
    """`layer(x)` under the config's checkpoint policy: whole (`full`), keeping some ops' outputs (`selective-ops`,
    `selective-ops-torchtitan`), or plain (`none`, and `selective-attention`, which checkpoints inside the attention)."""
    if policy == "full":
        return checkpoint(layer, x, **CHECKPOINT_KWARGS)
    if policy in SELECTIVE_OPS_CONTEXTS:
        return checkpoint(layer, x, **CHECKPOINT_KWARGS, context_fn=SELECTIVE_OPS_CONTEXTS[policy](model))
    return layer(x)


LAYER_POLICIES = ("full", *SELECTIVE_OPS_CONTEXTS)  # the policies that checkpoint whole layers


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
        # parallelism (graphviz_core.parallel.simulate) a rank whose qkv holds 3C/tp columns runs nh/tp whole heads.
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
