"""Every config field declared once: its kind, label, help, unit, what a 0 stands for, its ceiling and its choices.

The CLI's flags (their types, choices and `--help`), the form's labels, tooltips and size inputs, the sentences that
name a field ("model 'mlp' has no attention heads") and the compare page's list of changes are all read from `FIELDS`;
which families take a field is each family's own declaration (`Family.takes`), added where a help names them
(`graphviz_core.config.field_help`). `ModelConfig` (graphviz_core.config) holds the values and their defaults, and
tests/test_fields.py checks that the two list the same fields.

Importing this module imports nothing else of the package (the config layer, the families and the CLI all read it).
"""

from __future__ import annotations

from dataclasses import dataclass

SIZE, CHOICE, NAMES, SWITCH = "size", "choice", "names", "switch"  # a whole number, one of a list, text, on / off
SIZES = "sizes"  # the form's block of size inputs (ConfigField.form)


@dataclass(frozen=True)
class ConfigField:
    """One field of a model config, as every view names and explains it."""

    name: str  # the config's attribute; the CLI's flag is --name with - for _
    kind: str  # SIZE, CHOICE, NAMES or SWITCH: the CLI flag's type and the form's widget
    label: str  # the form's label and the compare page's ("Sequence length")
    help: str = ""  # what it means: the CLI's --help and the form's tooltip
    words: str = ""  # how a sentence names it, where the label would not read as words ("key-value heads")
    unit: str = ""  # what one of it counts, said beside a number ("tokens")
    zero: str = ""  # a size whose 0 stands for a default: what it stands for
    # The CLI refuses a typed 0 for a field whose 0 reads as "not set", saying what it would stand for ("" accepts 0).
    zero_typed: str = ""
    limit: int = 0  # the structural ceiling (0: none): a typo like hidden=76800 must not hang the machine
    choices: tuple[str, ...] = ()  # a CHOICE's options, where they are fixed here (model and checkpoint: elsewhere)
    form: str = ""  # SIZES: one of the form's size inputs, two to a row, in the order declared here

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


_FIELDS = (
    ConfigField("model", CHOICE, "Model family"),
    ConfigField("hidden", SIZE, "Hidden size", "hidden size; for resnet the stem width (64 in ResNet-50)",
                limit=65_536, form=SIZES),
    ConfigField("heads", SIZE, "Attention heads", "attention heads per layer", words="attention heads", limit=1_024,
                form=SIZES),
    ConfigField("layers", SIZE, "Layers", "transformer layers; for resnet its depth (18, 34, 50, 101, 152)",
                limit=256, form=SIZES),
    ConfigField("vocab", SIZE, "Vocabulary", "vocabulary size; for vit and resnet the number of classes",
                words="vocabulary", unit="tokens", limit=1_048_576, form=SIZES),
    ConfigField("batch", SIZE, "Batch", "sequences (or images) in one step", limit=65_536, form=SIZES),
    ConfigField("seq", SIZE, "Sequence length", "tokens in each sequence",
                words="sequence length (it takes images: set image_size)", unit="tokens", limit=1_048_576,
                form=SIZES),
    ConfigField("kv_heads", SIZE, "Key-value heads", "key-value heads for grouped-query attention",
                words="key-value heads", zero="one per attention head, no grouped-query attention",
                zero_typed="as many as --heads", limit=1_024, form=SIZES),
    ConfigField("intermediate", SIZE, "MLP width", "MLP width", words="intermediate (MLP) size",
                zero="4 × hidden size", zero_typed="4 x hidden", limit=262_144, form=SIZES),
    ConfigField("experts", SIZE, "Experts", "experts per layer", words="experts", zero_typed="the family's",
                limit=256, form=SIZES),
    ConfigField("experts_per_token", SIZE, "Experts per token", "experts each token is routed to",
                words="experts per token", zero_typed="the family's", limit=256, form=SIZES),
    ConfigField("image_size", SIZE, "Image size (pixels)", "square image side in pixels", words="image size",
                unit="pixels", zero_typed="the family's", limit=4_096, form=SIZES),
    ConfigField("context", SIZE, "Context", "position-embedding rows: the longest sequence the model takes",
                words="context (position-embedding rows)", unit="tokens", zero="the sequence length",
                limit=1_048_576, form=SIZES),
    ConfigField("tied", SWITCH, "Tied input/output embeddings", "the output head shares the token embedding",
                words="choice of tied embeddings"),
    ConfigField("attention", CHOICE, "Attention", words="attention", choices=("sdpa", "mha", "manual", "eager")),
    ConfigField("checkpoint", CHOICE, "Checkpointing"),
    ConfigField("device", CHOICE, "Device", choices=("auto", "cpu", "cuda", "meta")),
    ConfigField("dtype", CHOICE, "Dtype", choices=("float32", "bfloat16", "float16")),
    ConfigField("autocast", CHOICE, "Mixed precision (autocast)",
                "run the ops under torch.autocast in this dtype; the weights stay in --dtype (fp32 master weights)",
                choices=("none", "bfloat16", "float16")),
    ConfigField("finetune", CHOICE, "Fine-tuning",
                "full: every parameter trains; lora: peft adapters on --lora-targets, the base weights frozen",
                choices=("full", "lora")),
    ConfigField("lora_rank", SIZE, "LoRA rank r", "LoRA rank r (default 8)", limit=4_096),
    ConfigField("lora_alpha", SIZE, "LoRA alpha", "LoRA alpha; the adapter's output is scaled by alpha/r (default 16)",
                limit=65_536),
    ConfigField("lora_targets", NAMES, "LoRA targets", "module names LoRA adapts, comma-separated (default: the "
                "family's attention query and value projections)"),
    ConfigField("freeze", NAMES, "Freeze parameters (glob)",
                "freeze parameters whose names match this glob, e.g. '*embed*' (fnmatch)"),
    ConfigField("optimizer", CHOICE, "Optimizer",
                "the torch.optim optimizer whose state the training step counts (default adamw)",
                choices=("adamw", "adam", "sgd", "sgd-momentum", "adafactor")),
    ConfigField("compile", SWITCH, "torch.compile",
                "capture the step under torch.compile (its compiled backward opened in the graph)"),
    ConfigField("seed", SIZE, "Random seed", "random seed for weights and inputs, 0 .. 2**31-1"),
)
FIELDS: dict[str, ConfigField] = {f.name: f for f in _FIELDS}


def named(kind: str) -> tuple[str, ...]:
    """The fields of one kind, in the order declared."""
    return tuple(f.name for f in _FIELDS if f.kind == kind)


def in_form(form: str) -> tuple[str, ...]:
    """The fields of one block of the form, in the order declared."""
    return tuple(f.name for f in _FIELDS if f.form == form)
