"""Maps an autograd node (its normalised op name, and the type of the module that created it) to one of
the fixed categories below (graph/schema.py's `category`)."""

from __future__ import annotations

import functools
import re

CATEGORIES = (
    "attention",
    "matmul",
    "conv",
    "normalization",
    "activation",
    "elementwise",
    "residual_add",
    "position",
    "routing",
    "pooling",
    "reduction",
    "loss",
    "embedding",
    "shape",
    "conversion",
    "cast",  # ToCopyBackward0 nodes torch.autocast made (capture.instruments.casts decides, not the op name)
    "communication",
    "checkpoint",
    "compiled",
    "accumulate_grad",
    "other",
)

# Keyed by the op name without its `Backward<N>` suffix: `AddmmBackward0` -> `Addmm`.
_BY_STEM = {
    "matmul": (
        "Addmm",
        "Mm",
        "Bmm",
        "Baddbmm",
        "GroupedMm",
        "Addbmm",
        "Matmul",
        "Linear",
        "Addmv",
        "Mv",
        "Dot",
        "Vdot",
        "Addr",
        "Outer",
        "Einsum",
    ),
    "conv": (
        "Convolution",
        "ConvolutionBackward",
        "MkldnnConvolution",
        "CudnnConvolution",
        "ThnnConv2D",
        "SlowConv2D",
        "ConvDepthwise2D",
    ),
    "pooling": (
        "MaxPool2DWithIndices",
        "MaxPool2D",
        "AvgPool2D",
        "AdaptiveAvgPool2D",
        "AdaptiveMaxPool2D",
        "MaxPool1DWithIndices",
        "AvgPool1D",
        "AdaptiveAvgPool1D",
    ),
    "routing": ("Topk",),
    "communication": (
        "AllReduce",
        "AllGather",
        "ReduceScatter",
        "AllGatherIntoTensor",
        "ReduceScatterTensor",
        "WaitTensor",
        "AllToAll",
        "Broadcast",
        # Tensor parallelism: DTensor's input conversions and redistributions run their collectives inside
        # these nodes' backward (graphviz_core.parallel.collectives records them).
        "_FromTorchTensor",
        "_ToTorchTensor",
        "Redistribute",
        "AllToAllSingle",
    ),
    "normalization": (
        "NativeLayerNorm",
        "LayerNorm",
        "FusedRmsNorm",
        "RmsNorm",
        "NativeGroupNorm",
        "NativeBatchNorm",
        "CudnnBatchNorm",
        "Softmax",
        "SafeSoftmax",
        "LogSoftmax",
    ),
    "activation": (
        "Gelu",
        "Relu",
        "Silu",
        "Tanh",
        "Sigmoid",
        "Threshold",
        "LeakyRelu",
        "Elu",
        "Mish",
        "Hardtanh",
        "Hardswish",
        "Hardsigmoid",
        "Softplus",
        "Glu",
        "Prelu",
    ),
    "elementwise": (
        "Mul",
        "Div",
        "Sub",
        "Rsub",
        "Neg",
        "Pow",
        "Exp",
        "Log",
        "Sqrt",
        "Rsqrt",
        "Reciprocal",
        "MaskedFill",
        "Where",
        "Abs",
        "Sin",
        "Cos",
        "Clamp",
        "ClampMin",
        "ClampMax",
        "Sign",
        "Lerp",
        "Addcmul",
        "Addcdiv",
        "Erf",
        "NativeDropout",
        "Dropout",
        "Maximum",
        "Minimum",
        "Square",
        "Log1P",
        "Expm1",
        "Fill",
    ),
    "residual_add": ("Add",),
    "reduction": (
        "Sum",
        "Mean",
        "Max",
        "Min",
        "Amax",
        "Amin",
        "Norm",
        "LinalgVectorNorm",
        "Var",
        "Std",
        "Prod",
        "Logsumexp",
        "Cumsum",
    ),
    "loss": (
        "NllLoss",
        "NllLoss2D",
        "MseLoss",
        "L1Loss",
        "SmoothL1Loss",
        "HuberLoss",
        "BinaryCrossEntropy",
        "BinaryCrossEntropyWithLogits",
        "CrossEntropyLoss",
        "KlDiv",
    ),
    "embedding": ("Embedding", "EmbeddingDense", "EmbeddingBag"),
    "shape": (
        "View",
        "UnsafeView",
        "Reshape",
        "ReshapeAlias",
        "Transpose",
        "Permute",
        "Expand",
        "Select",
        "Slice",
        "Split",
        "SplitWithSizes",
        "UnsafeSplit",
        "Squeeze",
        "Unsqueeze",
        "T",
        "Clone",
        "Unbind",
        "Cat",
        "Stack",
        "AsStrided",
        "Unfold",
        "Narrow",
        "Alias",
        "Flip",
        "Roll",
        "Repeat",
        "IndexSelect",
        "Index",
        "Gather",
        "Diagonal",
        "Contiguous",
        "Tril",
        "Triu",
        "ConstantPadNd",
        "Chunk",
        "IndexAdd",
        "Scatter",
        "ScatterAdd",
        "IndexPut",
    ),
    "conversion": ("ToCopy", "Copy", "CopyBackwards", "CopySlices", "ToDense", "Cpu", "Cuda", "ToSparse"),
    "checkpoint": ("CheckpointFunction", "Checkpoint"),
    "compiled": ("CompiledFunction",),  # a torch.compile region's whole backward (graphviz_core.capture.compiled)
}
_STEM_TO_CATEGORY = {stem: cat for cat, stems in _BY_STEM.items() for stem in stems}
_SUFFIX = re.compile(r"Backward\d*$")


def normalise_op(raw_name: str) -> str:
    """`torch::autograd::AccumulateGrad` -> `AccumulateGrad`; other names are kept as PyTorch gives them."""
    return raw_name.rsplit("::", 1)[-1]


def category_of(op: str) -> str:
    """The category of a normalised op name; `other` when nothing matches."""
    if op == "AccumulateGrad":
        return "accumulate_grad"
    if "Attention" in op and "Backward" in op:
        return "attention"  # ScaledDotProduct{Efficient,Flash,Cudnn,FlashForCpu}AttentionBackward0, ...
    stem = _SUFFIX.sub("", op)
    if stem in _STEM_TO_CATEGORY:
        return _STEM_TO_CATEGORY[stem]
    if stem.endswith("Backwards"):  # CopyBackwards
        return _STEM_TO_CATEGORY.get(stem, "other")
    return "other"


# Module types whose ops all mean one thing, whatever the op (a Mul inside an RMSNorm normalises).
_NORM_SUFFIXES = ("RMSNorm", "RmsNorm", "LayerNorm", "BatchNorm2d", "BatchNorm1d", "GroupNorm")
_ROUTER_SUFFIXES = ("Router",)  # MixtralTopKRouter: the gate's top-k and softmax
_ACTIVATION_SUFFIXES = ("Activation", "GELU", "SiLU")  # GPT-2's gelu_new spelled out as mul/pow/add/tanh
_POOLING_SUFFIXES = ("Pool2d", "Pool1d")  # AdaptiveAvgPool2d runs as a mean on CPU
_ROTARY = ("ApplyRotary",)  # graphviz_core.models.hf runs transformers' apply_rotary_pos_emb inside this module
# Attention modules: CoreAttention (the built-in models), LlamaAttention, MistralAttention, Qwen2Attention,
# MixtralAttention, Gemma3Attention, GPT2Attention, BertSelfAttention, ViTSelfAttention. What is computed directly in
# one (not in its Linear, Conv1D, norm or rotary children) is the attention core: spelled out (`manual`, `eager`),
# q·kᵀ, scale, mask, softmax, dropout and ·v are all `attention` (this module's rule), the op that would otherwise read as a
# matmul, an elementwise op or a normalisation; its views and reshapes stay `shape`, dtype copies `conversion`.
_ATTENTION_SUFFIXES = ("Attention",)
# nn.MultiheadAttention computes its packed in-projection itself (a matmul that stays one) and runs its core as one
# fused kernel, which the op name already calls attention.
_NOT_ATTENTION_CORE = ("MultiheadAttention",)
_ATTENTION_CORE_CATEGORIES = ("matmul", "normalization", "elementwise", "activation", "residual_add", "reduction")
# An Add here joins the residual stream: transformer layers and blocks, BERT/ViT's *Output (dense + residual),
# ResNet's residual layers.
_RESIDUAL_SUFFIXES = ("Layer", "Block", "Output")
# An Add here is a bias add of a linear layer.
_LINEAR = ("Linear", "NonDynamicallyQuantizableLinear", "MultiheadAttention", "Conv1D")
# An Add here sums token and position (and segment) embeddings.
_EMBEDDING_ROOTS = ("GPT2", "GPT2Model")


def is_attention_core(module_type: str) -> bool:
    """Whether what a module of this type computes itself is an attention core (its projections are children)."""
    return module_type.endswith(_ATTENTION_SUFFIXES) and module_type not in _NOT_ATTENTION_CORE


@functools.lru_cache(maxsize=4096)  # a pure function of two names: captures ask it once per node
def category_in_module(op: str, module_type: str) -> str:
    """The category of `op` created inside a module of type `module_type` ("" where no module created it,
    e.g. the loss computed after the model's forward). The op name decides first; the module decides where
    the op alone cannot: ops inside a norm are normalization, inside the rotary embedding position, inside a
    router routing, the arithmetic of a spelled-out attention core attention, and an Add is residual_add only
    where it joins the residual stream."""
    category = category_of(op)
    if category in ("accumulate_grad", "attention", "conversion", "checkpoint", "compiled"):
        return category
    if not module_type:
        return "loss" if _SUFFIX.sub("", op) == "LogSoftmax" else category
    if module_type in _ROTARY:
        return "position"
    if is_attention_core(module_type) and category in _ATTENTION_CORE_CATEGORIES:
        return "attention"
    if module_type.endswith(_NORM_SUFFIXES) and category in ("elementwise", "reduction", "residual_add"):
        return "normalization"
    if module_type.endswith(_ROUTER_SUFFIXES) and category != "matmul":
        return "routing"
    if module_type.endswith(_ACTIVATION_SUFFIXES) and category in ("elementwise", "residual_add"):
        return "activation"
    if module_type.endswith(_POOLING_SUFFIXES) and category in ("reduction", "elementwise"):
        return "pooling"
    if category != "residual_add":
        return category
    if module_type in _LINEAR:
        return "matmul"
    if "Embedding" in module_type or module_type in _EMBEDDING_ROOTS:
        return "embedding"
    if module_type.endswith(_RESIDUAL_SUFFIXES):
        return "residual_add"
    return "elementwise"
