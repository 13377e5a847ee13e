"""What every kind of model answers for itself: the `Family` interface, its presets, and the example batch.

One `Family` object per architecture (graphviz_core.models.registry lists them). Everything the rest of the code
asks of "what kind of model is this" is a method or attribute here: which config fields it takes, its presets and
shape rules, how to build it with its example batch and loss, its parameter count, the rough activation and FLOP
estimates admission uses, which checkpointing policies apply, which textbook derivations describe it, and how it
splits over ranks (`ParallelPlan`).

Importing this module imports no torch: the config layer validates against families before any model is built.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from graphviz_core.fields import FIELDS

if TYPE_CHECKING:
    import torch
    from torch import nn

    from graphviz_core.config import ModelConfig

# Optional fields a family may take (0 / False = not used); every family takes hidden, layers, batch and the rest.
OPTIONAL_FIELDS = ("kv_heads", "intermediate", "experts", "experts_per_token", "image_size", "context", "tied")
# Fields some families have no use for at all (a ResNet has no sequence, an MLP no heads or vocabulary).
SOMETIMES_FIELDS = ("seq", "heads", "vocab", "attention")


class Choices(tuple):
    """Names offered (iterating gives them: the form's options, the CLI's choices) and names accepted (`in`): the
    offered ones plus aliases that old links and scripts use."""

    aliases: frozenset[str]

    def __new__(cls, names: tuple[str, ...], aliases: tuple[str, ...] = ()) -> Choices:
        choices = super().__new__(cls, names)
        choices.aliases = frozenset(aliases)
        return choices

    def __contains__(self, name: object) -> bool:
        return super().__contains__(name) or name in self.aliases

    def __reduce__(self):
        return Choices, (tuple(self), tuple(sorted(self.aliases)))


# Checkpointing policies, each meaning the same for every family that offers it. `selective` is an alias kept for
# old links and scripts: a config resolves it to its family's `selective_alias` (what it meant for that family).
SELECTIVE = "selective"
CHECKPOINTS = Choices(("none", "full", "selective-attention", "selective-ops", "selective-ops-torchtitan"),
                      aliases=(SELECTIVE,))
# What each policy keeps for backward and recomputes, and where it comes from: every explanation of a policy starts
# from these (Family.checkpoint_note), never from one model.
CHECKPOINT_POLICIES = {
    "none": "no checkpointing: every layer keeps what its backward needs",
    "full": "full checkpointing: each layer keeps only its inputs and re-runs its whole forward in backward",
    "selective-attention": (
        "selective recomputation of the attention core (Korthikanti et al. 2022, \"Reducing Activation "
        "Recomputation in Large Transformer Models\"): each attention keeps only q, k and v for its core and re-runs "
        "the core in backward ({core}); everything else keeps what its backward needs"
    ),
    "selective-ops": (
        "op-level selective activation checkpointing (torchtitan's op SAC without its every-second-matmul rule, "
        "with torch.utils.checkpoint's create_selective_checkpoint_contexts): each layer keeps its inputs and the "
        "outputs of its compute-heavy ops (matmuls, convolutions, attention kernels) and recomputes the rest in "
        "backward (norms, activations, rotary, elementwise)"
    ),
    "selective-ops-torchtitan": (
        "torchtitan's op-level selective activation checkpointing exactly (its save list and every-second-matmul "
        "rule, pytorch/torchtitan parallelize_llama.py, with torch.utils.checkpoint's "
        "create_selective_checkpoint_contexts): each layer keeps its inputs, the outputs of its 1st, 3rd, 5th... "
        "matrix multiplications without a bias (aten.mm) and of its fused attention kernels, and recomputes the rest "
        "in backward, the 2nd, 4th, 6th... of those matmuls included (matmuls with a bias, batched matmuls and "
        "convolutions are not on its list: recomputed)"
    ),
}

# How each field is named on the form and in sentences (a family may rename one: ResNet's layers are its depth), what
# it means (the CLI's --help and the form's tooltips; config.field_help adds the families that take an optional one),
# what a 0 stands for, and how a sentence names it: each read from its one declaration (graphviz_core.fields).
FIELD_LABELS = {name: f.label for name, f in FIELDS.items()}
FIELD_HELP = {name: f.help for name, f in FIELDS.items() if f.help}
FIELD_ZERO = {name: f.zero for name, f in FIELDS.items() if f.zero}
FIELD_WORDS = {name: f.words for name, f in FIELDS.items() if f.words}


@dataclass(frozen=True)
class Preset:
    """A named starting config and the sentence that says what it is for."""

    name: str
    description: str
    fields: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Batch:
    """Model inputs and loss targets for one step."""

    inputs: Any  # torch.Tensor
    targets: Any  # torch.Tensor


@dataclass(frozen=True)
class Source:
    """A model that is not built from a config: the module, its example inputs, and the loss of its output."""

    model: Any  # nn.Module
    inputs: tuple
    loss_fn: Any  # loss_fn(model_output) -> scalar tensor


@dataclass(frozen=True)
class StageSplit:
    """Where a pipeline cuts a decoder between its layers (torchtitan's split): attribute paths from the model's root."""

    embedding: str  # the token embedding: kept by the first stage only
    layers: str  # the nn.ModuleList of repeated blocks, a slice of it per stage
    norm: str  # the final norm: kept by the last stage only
    head: str  # the output head: kept by the last stage only
    first_only: tuple[str, ...] = ()  # more parts that only the first stage runs (GPT-2's position embedding)
    # A later stage's forward, (model, hidden states, positions or None) -> output, where the model's own forward
    # would redo the first stage's work on the hidden states it is handed (GPT-2 adds its position embedding to
    # `inputs_embeds`). None: the model's forward with `inputs_embeds`.
    later_forward: Callable | None = None


@dataclass(frozen=True)
class ParallelPlan:
    """How a family's model is laid out over ranks. graphviz_core.parallel reads this and guesses nothing from names;
    a dimension the family cannot take carries the reason, said when a layout asks for it.

    `tensor` is each layer's projections by the end of their path inside the layer, with Megatron-LM's split
    (Shoeybi et al. 2019, section 3: the first matmul of attention and of the MLP split by output columns, the second
    by input rows; one all-reduce forward and one backward per pair), as `transformers` configs carry
    `base_model_tp_plan`."""

    tensor: tuple[tuple[str, str], ...] = ()  # (path end, "colwise" | "rowwise")
    no_tensor: str = "its layers declare no projections for a column / row split"
    split_heads: bool = True  # tensor parallel splits attention heads (whole heads per rank)
    stages: StageSplit | None = None
    no_stages: str = "it is not a causal decoder with a token embedding, layers, a final norm and a head to cut between"
    ring_attention: bool = False  # attention runs through F.scaled_dot_product_attention, so torch's ring can replace it
    no_ring: str = "its attention does not run through scaled_dot_product_attention with positions given per token"
    ring_window: int = 0  # the longest sequence the ring takes (0: any): past a sliding window, attention needs a mask
    # Sequence parallel: the residual stream between layers sharded on the sequence, from the first layer's input to
    # the final norm, the head gathering it back (a transformers decoder: get_decoder's norm, get_output_embeddings).
    sequence: bool = False
    no_sequence: str = "no final norm and head are declared for the sequence shard to end at"

    def tensor_style(self, path: str) -> str | None:
        """The split of the module at `path` inside a layer ("colwise" / "rowwise"), or None."""
        for end, style in self.tensor:
            if path == end or path.endswith("." + end):
                return style
        return None


# Megatron's pairs in a Llama-style decoder layer (transformers' LlamaConfig.base_model_tp_plan).
LLAMA_TENSOR = (("q_proj", "colwise"), ("k_proj", "colwise"), ("v_proj", "colwise"), ("o_proj", "rowwise"),
                ("gate_proj", "colwise"), ("up_proj", "colwise"), ("down_proj", "rowwise"))
DECODER_STAGES = StageSplit(embedding="model.embed_tokens", layers="model.layers", norm="model.norm", head="lm_head")


class Family:
    """One architecture. Subclasses set the attributes and override what differs; the defaults describe a
    decoder-only transformer language model."""

    name: str = ""  # the config's `model`
    title: str = ""  # what the form's family box shows
    # Optional fields this family takes (OPTIONAL_FIELDS), and the sometimes-fields it lacks (SOMETIMES_FIELDS).
    optional: tuple[str, ...] = ()
    lacks: tuple[str, ...] = ()
    attentions: tuple[str, ...] = ("sdpa",)  # the first is the default
    spelled_out_attention: str | None = None  # the attention that runs the core op by op: "manual" or "eager"
    labels: dict[str, str] = {}  # form labels that differ from FIELD_LABELS
    presets: tuple[Preset, ...] = ()
    # (old name, preset) pairs: names a preset had, still accepted by --preset, links and config_from_preset
    renamed_presets: tuple[tuple[str, str], ...] = ()
    default_fields: dict = {}  # what `--model NAME` starts from when no preset is named
    offered: bool = True  # in the form's family box and `--model`'s choices
    # What the analyses ask.
    has_attention: bool = True  # an attention core that selective-attention checkpointing can recompute
    selective_alias: str | None = None  # the policy an old `checkpoint=selective` means here (None: refused)
    language_model: bool = True  # logits over a vocabulary at every position
    stacked_layers: bool = True  # `layers` counts identical blocks (will-it-fit extrapolates over them)
    min_batch: int = 1  # BatchNorm cannot train on one example at 1 x 1 pixels
    rebuildable: bool = True  # can be built again at other sizes (a user's own module cannot)
    user_code: bool = False  # runs code from a file the server's operator trusted (only the server imports it)
    shardable: bool = True  # has repeated layers FSDP can wrap one by one
    parallel: ParallelPlan = ParallelPlan()  # tensor, pipeline and context parallel (graphviz_core.parallel reads it)
    rms_norm: bool = False  # normalises with RMSNorm (the FLOPs tab's per-family rows)
    convolutional: bool = False
    # How compare's sentences say what grows with hidden and with the MLP width.
    hidden_grows: str = "matmuls grow as hidden², elementwise work as hidden"
    mlp_matmuls: str = "MLP's two matmuls"
    # Which derivations the textbook panels hold for this family (graphviz_core.analysis.textbook):
    # "korthikanti" (a GPT-style layer's saved bytes), "llama" (a Llama-style layer op by op) or None.
    layer_memory_formula: str | None = None
    gpt2_backward_terms: bool = False  # the per-op backward FLOP terms of "Backpropagating through GPT-2"
    preload: tuple[str, ...] = ()  # modules a worker process imports before its first capture of this family
    # LoRA's default targets (module names, matched as peft matches them: the path's last parts): the attention
    # query and value projections, as Hu et al. 2021 adapt W_q and W_v; empty: the user names them (--lora-targets).
    lora_targets: tuple[str, ...] = ("q_proj", "v_proj")
    lora_targets_note: str = "the attention query and value projections"

    # ---- the config -----------------------------------------------------------------------------------------

    def takes(self, field_name: str) -> bool:
        """Whether `field_name` means something for this family (the form hides it and the CLI refuses it otherwise)."""
        if field_name in OPTIONAL_FIELDS:
            return field_name in self.optional
        if field_name in SOMETIMES_FIELDS:
            return field_name not in self.lacks
        return True

    def label(self, field_name: str) -> str:
        return self.labels.get(field_name, FIELDS[field_name].label)

    def validate(self, config: ModelConfig) -> None:
        """Shape rules of this family, each refused with a sentence that says the fix."""
        if config.attention not in self.attentions:
            if not self.takes("attention"):
                raise ValueError(f"model {self.name!r} has no attention; leave attention at its default 'sdpa'.")
            choices = ", ".join(self.attentions[:-1]) + " or " + self.attentions[-1]
            if config.attention == "eager":
                raise ValueError(f"attention 'eager' is for the transformers families; model {self.name!r} takes {choices}.")
            raise ValueError(f"model {self.name!r} has no attention {config.attention!r}: choose {choices}.")
        policies = self.checkpoint_policies()
        if config.checkpoint not in policies:
            choose = ", ".join(policies)
            if config.checkpoint == "selective-attention":
                raise ValueError(f"selective-attention recomputes the attention core, and model {self.name!r} has "
                                 f"none; choose one of: {choose}.")
            raise ValueError(f"checkpoint {config.checkpoint!r} does not apply to model {self.name!r}; choose one of: "
                             f"{choose}.")
        if self.takes("heads") and config.hidden % config.heads:
            raise ValueError(
                f"hidden {config.hidden} is not divisible by {config.heads} heads; "
                f"pick a hidden size that is a multiple of {config.heads} "
                f"(e.g. {config.heads * max(1, config.hidden // config.heads)})."
            )
        if self.takes("context") and config.context and config.seq > config.context:
            raise ValueError(
                f"seq {config.seq} is longer than the context {config.context} (position-embedding rows); "
                f"lower seq or raise context."
            )
        self.validate_finetuning(config)

    def validate_finetuning(self, config: ModelConfig) -> None:
        """LoRA needs modules to adapt: the family's defaults or the user's --lora-targets."""
        if config.finetune == "lora" and not config.lora_targets and not self.lora_targets:
            raise ValueError(f"model {self.name!r} has no default LoRA targets ({self.lora_targets_note}); name the "
                             f"layers to adapt with lora_targets (--lora-targets).")

    def default_lora_targets(self, config: ModelConfig) -> tuple[str, ...]:
        """The modules LoRA adapts when lora_targets is empty (lora_targets_note says what they are)."""
        return self.lora_targets

    def tokens(self, config: ModelConfig) -> int:
        """Positions per example the model sees."""
        return config.seq

    def describe(self, config: ModelConfig) -> list[str]:
        """The config in a few words, without batch, dtype and device (`llama · 2 layers · h=64 · 4 heads / 2 kv`)."""
        layers = f"{config.layers} layer{'' if config.layers == 1 else 's'}"
        parts = [self.name, layers, f"h={config.hidden}"]
        if self.takes("heads"):
            heads = f"{config.heads} heads"
            if config.kv_heads and config.kv_heads != config.heads:
                heads += f" / {config.kv_heads} kv"
            parts.append(heads)
        if config.experts:
            parts.append(f"{config.experts} experts, top-{config.experts_per_token}")
        return parts

    def sample_size(self, config: ModelConfig) -> str:
        """How big one example is, in the config line (`s=32`, `32px`)."""
        return f"s={config.seq}"

    def checkpoint_policies(self) -> Choices:
        """The checkpointing policies that mean something here (selective-attention needs an attention core), and
        the `selective` alias where this family gives it a meaning."""
        names = tuple(p for p in CHECKPOINTS if p != "selective-attention" or self.has_attention)
        return Choices(names, aliases=(SELECTIVE,) if self.selective_alias else ())

    def checkpoint_note(self, policy: str, config: ModelConfig | None = None) -> str:
        """What `policy` keeps and recomputes and its source, in one sentence (CHECKPOINT_POLICIES), with what the
        attention core is under `config`'s attention."""
        core = "the fused kernel, from q, k and v"
        if config is not None and self.spelled_out_attention and config.attention == self.spelled_out_attention:
            core = "q·kᵀ, scale, mask, softmax and ·v, op by op"
        return CHECKPOINT_POLICIES[policy].format(core=core)

    # ---- the model --------------------------------------------------------------------------------------------

    def source(self, config: ModelConfig) -> Source | None:
        """The model, inputs and loss where they are not built from the config's fields (a trusted user module)."""
        return None

    def build(self, config: ModelConfig) -> nn.Module:
        """The model with random weights from `config.seed`, on the current default device, in training mode."""
        raise NotImplementedError

    def batch(self, config: ModelConfig, device: torch.device | str) -> Batch:
        """Random inputs and targets of the config's shape, reproducible from `config.seed` (empty on meta)."""
        raise NotImplementedError

    def loss(self, config: ModelConfig, output: Any, targets: torch.Tensor) -> torch.Tensor:
        """The scalar loss of the model's output, computed outside the model's forward."""
        raise NotImplementedError

    # ---- estimates (admission) ----------------------------------------------------------------------------------

    def parameter_count(self, config: ModelConfig) -> int:
        """Parameters of the model `config` builds, exactly."""
        raise NotImplementedError

    def activation_elements(self, config: ModelConfig) -> int:
        """A rough upper estimate of the elements the whole model keeps for backward (admission only)."""
        raise NotImplementedError

    def training_flops(self, config: ModelConfig) -> int:
        """A rough count of forward + backward FLOPs (admission only): 6 per parameter per token for the matmuls
        (2 forward, 4 backward; Kaplan et al. 2020), plus attention's 12·b·s²·h per layer."""
        s = self.tokens(config)
        return 6 * self.parameter_count(config) * config.batch * s + 12 * config.layers * config.batch * s * s * config.hidden
