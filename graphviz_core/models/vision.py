"""Image classifiers from `transformers`: ViT (16-pixel patches as tokens) and ResNet (convolutions, batch norm)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from graphviz_core.models.family import ParallelPlan, Preset
from graphviz_core.models.transformers_family import TransformersFamily

if TYPE_CHECKING:
    from graphviz_core.config import ModelConfig

VIT_PATCH = 16  # ViT-base/16: 16 x 16 pixel patches
# ResNet depth -> (blocks per stage, block type), as in He et al. 2016, Table 1.
RESNET_DEPTHS = {
    18: ([2, 2, 2, 2], "basic"),
    34: ([3, 4, 6, 3], "basic"),
    50: ([3, 4, 6, 3], "bottleneck"),
    101: ([3, 4, 23, 3], "bottleneck"),
    152: ([3, 8, 36, 3], "bottleneck"),
}


class _Vision(TransformersFamily):
    auto_class = "AutoModelForImageClassification"
    images = True
    language_model = False
    lacks = ("seq",)
    parallel = ParallelPlan(
        no_tensor="no column / row plan is declared for the image models' layers",
        no_stages="an image classifier has no token embedding and language head for the first and last stages",
        no_ring="an image classifier has no token sequence for context parallel to split",
        no_sequence="no column / row plan is declared for the image models, and sequence parallel runs inside one",
    )
    labels = {"vocab": "Classes"}

    def validate(self, config: ModelConfig) -> None:
        super().validate(config)
        if not config.image_size:
            raise ValueError(f"model {self.name!r} takes images: set image_size (e.g. 224).")

    def sample_size(self, config: ModelConfig) -> str:
        return f"{config.image_size}px"


class ViT(_Vision):
    name = "vit"
    title = "ViT (images)"
    optional = ("intermediate", "image_size")
    hf_module = "vit"
    config_class, model_class = "ViTConfig", "ViTForImageClassification"
    presets = (
        Preset(
            "vit-tiny",
            "ViT (image classification, 16-pixel patches) at toy size: 32-pixel images, 2 layers, h=64; "
            "a real backward on CPU in about a second.",
            dict(model="vit", hidden=64, intermediate=256, layers=2, heads=4, vocab=10, image_size=32, batch=2),
        ),
        Preset(
            "vit-base",
            "ViT-base/16 for ImageNet: 12 layers, h=768, 12 heads, 3072, 224-pixel images, 1000 classes "
            "(86.6M parameters).",
            dict(model="vit", hidden=768, intermediate=3072, layers=12, heads=12, vocab=1000, image_size=224, batch=8),
        ),
    )
    default_fields = presets[0].fields

    def validate(self, config: ModelConfig) -> None:
        super().validate(config)
        if config.image_size % VIT_PATCH:
            raise ValueError(
                f"image_size {config.image_size} is not a multiple of ViT's {VIT_PATCH}-pixel patches; "
                f"pick e.g. {max(VIT_PATCH, config.image_size // VIT_PATCH * VIT_PATCH)}."
            )

    def tokens(self, config: ModelConfig) -> int:
        """The patches plus the class token."""
        return (config.image_size // VIT_PATCH) ** 2 + 1

    def hf_config(self, config: ModelConfig, tf):
        return tf.ViTConfig(
            hidden_size=config.hidden,
            num_hidden_layers=config.layers,
            num_attention_heads=config.heads,
            intermediate_size=config.intermediate or 4 * config.hidden,
            image_size=config.image_size,
            patch_size=VIT_PATCH,
            num_labels=config.vocab,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            use_cache=False,
            attn_implementation=config.attention,
        )


class ResNet(_Vision):
    name = "resnet"
    title = "ResNet (images)"
    optional = ("image_size",)
    lacks = ("seq", "heads", "attention")
    attentions = ("sdpa",)
    spelled_out_attention = None
    hf_module = "resnet"
    config_class, model_class = "ResNetConfig", "ResNetForImageClassification"
    labels = {"vocab": "Classes", "layers": "Depth (18, 34, 50, 101, 152)", "hidden": "Stem width (channels)"}
    has_attention = False
    # No attention to adapt; LoRA on convolutions is the user's choice of layers (peft adapts nn.Conv2d).
    lora_targets = ()
    lora_targets_note = "it has no attention; LoRA can adapt its convolutions: name them, e.g. 'convolution'"
    stacked_layers = False
    min_batch = 2
    convolutional = True
    presets = (
        Preset(
            "resnet-tiny",
            "ResNet-18's layout (basic blocks 2-2-2-2) at width 8 on 32-pixel images, 10 classes: "
            "a real backward on CPU in about a second.",
            dict(model="resnet", hidden=8, layers=18, vocab=10, image_size=32, batch=2),
        ),
        Preset(
            "resnet-50",
            "ResNet-50 for ImageNet: bottleneck blocks 3-4-6-3, widths 256..2048, 224-pixel images, "
            "1000 classes (25.6M parameters).",
            dict(model="resnet", hidden=64, layers=50, vocab=1000, image_size=224, batch=8),
        ),
    )
    default_fields = presets[0].fields

    def validate(self, config: ModelConfig) -> None:
        super().validate(config)
        if config.layers not in RESNET_DEPTHS:
            raise ValueError(
                f"model 'resnet' takes layers as its depth, one of {', '.join(map(str, RESNET_DEPTHS))}; "
                f"got {config.layers}."
            )
        if config.image_size < 32:
            raise ValueError(f"image_size {config.image_size} is too small for ResNet's five halvings; use at least 32.")

    def describe(self, config: ModelConfig) -> list[str]:
        return [self.name, f"depth {config.layers}", f"h={config.hidden}"]

    def hf_config(self, config: ModelConfig, tf):
        depths, kind = RESNET_DEPTHS[config.layers]
        h = config.hidden
        widths = [h, 2 * h, 4 * h, 8 * h]  # output channels per stage: 64..512 for ResNet-18/34 at h=64
        if kind == "bottleneck":
            widths = [4 * w for w in widths]  # 256..2048 for ResNet-50 (expansion 4)
        return tf.ResNetConfig(embedding_size=h, hidden_sizes=widths, depths=depths, layer_type=kind,
                               num_labels=config.vocab)

    def activation_elements(self, config: ModelConfig) -> int:
        """About half an element per pixel per channel of the stem width per layer of depth (its early stages
        dominate)."""
        return config.batch * config.image_size**2 * config.hidden * config.layers // 2

    def training_flops(self, config: ModelConfig) -> int:
        """6 per parameter per 16 x 16 pixel patch."""
        return 6 * self.parameter_count(config) * config.batch * (config.image_size // 16) ** 2


FAMILIES = (ViT(), ResNet())
