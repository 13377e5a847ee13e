"""The user's own `nn.Module` as a family: its fields describe nothing, since the module decides its own shapes.

From Python or the CLI (`--model-file PATH:FACTORY`) the capture is handed the module, inputs and loss directly
(graphviz_core.capture.own_module); in the web app, a factory from the trusted folder is named by `config.preset` and
loaded here (graphviz_core.models.model_files)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from graphviz_core.models.family import Family, ParallelPlan

if TYPE_CHECKING:
    from graphviz_core.config import ModelConfig

CUSTOM = "custom"


class Custom(Family):
    name = CUSTOM
    title = "Your model (trusted folder)"
    offered = False  # never in --model's choices; the form lists trusted factories only when the server allows them
    has_attention = False
    language_model = False
    stacked_layers = False
    rebuildable = False
    shardable = False
    parallel = ParallelPlan(no_tensor="your own module declares no column / row plan",
                            no_stages="your own module declares no stages to cut between",
                            no_ring="your own module declares no attention for torch's ring",
                            no_sequence="your own module declares no sequence shard")
    user_code = True
    lora_targets = ()  # the capture runs the user's module as given: no fine-tuning settings apply

    def takes(self, field_name: str) -> bool:
        """Only what the capture sets from the module itself (its batch, dtype and device), the seed, and whether the
        step runs under torch.compile."""
        return field_name in ("model", "preset", "batch", "dtype", "device", "seed", "compile")

    def validate(self, config: ModelConfig) -> None:
        """Nothing to check: the user's module decides its own shapes."""

    def describe(self, config: ModelConfig) -> list[str]:
        return [f"custom module {config.preset}"]

    def sample_size(self, config: ModelConfig) -> str:
        return ""

    # Admission's estimates: the module is not known until it is loaded, so nothing is reserved or refused ahead.
    def parameter_count(self, config: ModelConfig) -> int:
        return 0

    def activation_elements(self, config: ModelConfig) -> int:
        return 0

    def training_flops(self, config: ModelConfig) -> int:
        return 0

    def source(self, config: ModelConfig):
        """The trusted-folder factory `config.preset` names: (module, inputs, loss), refused unless allowed."""
        from graphviz_core.models.model_files import trusted_source

        return trusted_source(config.preset)


FAMILIES = (Custom(),)
