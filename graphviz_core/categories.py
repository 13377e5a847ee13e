"""Maps a normalised autograd node name (`AddmmBackward0`) to one of DESIGN.md's fixed categories."""

from __future__ import annotations

import re

CATEGORIES = (
    "attention",
    "matmul",
    "normalization",
    "activation",
    "elementwise",
    "residual_add",
    "reduction",
    "loss",
    "embedding",
    "shape",
    "conversion",
    "checkpoint",
    "accumulate_grad",
    "other",
)

# Keyed by the op name without its `Backward<N>` suffix: `AddmmBackward0` -> `Addmm`.
_BY_STEM = {
    "matmul": (
        "Addmm", "Mm", "Bmm", "Baddbmm", "Addbmm", "Matmul", "Linear", "Addmv", "Mv", "Dot", "Vdot", "Addr",
        "Outer", "Einsum",
    ),
    "normalization": (
        "NativeLayerNorm", "LayerNorm", "FusedRmsNorm", "RmsNorm", "NativeGroupNorm", "NativeBatchNorm",
        "CudnnBatchNorm", "Softmax", "SafeSoftmax", "LogSoftmax",
    ),
    "activation": (
        "Gelu", "Relu", "Silu", "Tanh", "Sigmoid", "Threshold", "LeakyRelu", "Elu", "Mish", "Hardtanh",
        "Hardswish", "Hardsigmoid", "Softplus", "Glu", "Prelu",
    ),
    "elementwise": (
        "Mul", "Div", "Sub", "Rsub", "Neg", "Pow", "Exp", "Log", "Sqrt", "Rsqrt", "Reciprocal", "MaskedFill",
        "Where", "Abs", "Sin", "Cos", "Clamp", "ClampMin", "ClampMax", "Sign", "Lerp", "Addcmul", "Addcdiv",
        "Erf", "NativeDropout", "Dropout", "Maximum", "Minimum", "Square", "Log1P", "Expm1", "Fill",
    ),
    "residual_add": ("Add",),
    "reduction": ("Sum", "Mean", "Max", "Min", "Amax", "Amin", "Norm", "LinalgVectorNorm", "Var", "Std", "Prod",
                  "Logsumexp", "Cumsum"),
    "loss": ("NllLoss", "NllLoss2D", "MseLoss", "L1Loss", "SmoothL1Loss", "HuberLoss", "BinaryCrossEntropy",
             "BinaryCrossEntropyWithLogits", "CrossEntropyLoss", "KlDiv"),
    "embedding": ("Embedding", "EmbeddingDense", "EmbeddingBag"),
    "shape": (
        "View", "UnsafeView", "Reshape", "ReshapeAlias", "Transpose", "Permute", "Expand", "Select", "Slice",
        "Split", "SplitWithSizes", "UnsafeSplit", "Squeeze", "Unsqueeze", "T", "Clone", "Unbind", "Cat",
        "Stack", "AsStrided", "Unfold", "Narrow", "Alias", "Flip", "Roll", "Repeat", "IndexSelect", "Index",
        "Gather", "Diagonal", "Contiguous", "Tril", "Triu", "ConstantPadNd", "Chunk",
    ),
    "conversion": ("ToCopy", "Copy", "CopyBackwards", "CopySlices", "ToDense", "Cpu", "Cuda", "ToSparse"),
    "checkpoint": ("CheckpointFunction", "Checkpoint"),
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
