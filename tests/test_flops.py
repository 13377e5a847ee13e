"""The capture's own matmul and fused-attention FLOP formulas count exactly what torch.utils.flop_counter's
registry counts for the same ops (they replace it only to skip its pytree wrappers)."""

import pytest
import torch
from torch.utils import flop_counter

from graphviz_core.capture.flop_formulas import FLOP_FORMULAS, op_info

aten = torch.ops.aten


def _theirs(packet, *args, out=None):
    return flop_counter.flop_registry[packet](*args, out_val=out)


@pytest.mark.parametrize(
    ("packet", "shapes"),
    [
        (aten.mm, [(3, 5), (5, 7)]),
        (aten.bmm, [(2, 3, 5), (2, 5, 7)]),
        (aten.addmm, [(7,), (3, 5), (5, 7)]),
        (aten.baddbmm, [(2, 3, 7), (2, 3, 5), (2, 5, 7)]),
    ],
)
def test_matmul_formulas_match_flop_counter(packet, shapes):
    tensors = [torch.empty(s, device="meta") for s in shapes]
    out = packet(*tensors)
    # mm (3x5)@(5x7): 2*3*5*7 = 210; bmm with batch 2: 420; addmm / baddbmm count only their product.
    expected = {aten.mm: 210, aten.addmm: 210, aten.bmm: 420, aten.baddbmm: 420}[packet]
    assert FLOP_FORMULAS[packet](*tensors, out_val=out) == _theirs(packet, *tensors, out=out) == expected


@pytest.mark.parametrize("kv_heads", [4, 2])  # multi-head, and grouped-query (2 key/value heads for 4 query heads)
def test_fused_attention_formulas_match_flop_counter(kv_heads):
    b, h, s, d = 2, 4, 6, 8
    q = torch.empty(b, h, s, d, device="meta")
    k = torch.empty(b, kv_heads, s, d, device="meta")
    v = torch.empty(b, kv_heads, s, d, device="meta")
    # Forward: q@kᵀ and p@v over all query heads: 2 * (2*b*h*s*s*d) = 4*2*4*6*6*8 = 9216.
    forward = FLOP_FORMULAS[aten._scaled_dot_product_efficient_attention](q, k, v, None, False, out_val=None)
    assert forward == _theirs(aten._scaled_dot_product_efficient_attention, q, k, v, None, False) == 9216
    # Backward: 5 GEMMs of the same size: 10*b*h*s*s*d = 23040.
    grad = torch.empty(b, h, s, d, device="meta")
    backward = FLOP_FORMULAS[aten._scaled_dot_product_flash_attention_backward](grad, q, k, v, out_val=None)
    assert backward == _theirs(aten._scaled_dot_product_flash_attention_backward, grad, q, k, v) == 23040
    # The CPU kernel, which flop_counter does not count, gets the same formulas.
    assert FLOP_FORMULAS[aten._scaled_dot_product_flash_attention_for_cpu](q, k, v, out_val=None) == 9216
    assert FLOP_FORMULAS[aten._scaled_dot_product_flash_attention_for_cpu_backward](grad, q, k, v, out_val=None) == 23040


def test_op_info_is_looked_up_once_per_overload_and_names_the_packet():
    formula, name = op_info(aten.mm.default)
    assert formula is FLOP_FORMULAS[aten.mm] and name == "aten.mm"
    assert op_info(aten.mm.default) is op_info(aten.mm.default)  # the cached tuple itself
    assert op_info(aten.view.default) == (None, "aten.view")
    a, b = torch.ones(3, 5), torch.ones(5, 7)
    assert formula(a, b, out_val=a @ b) == 210  # 2*3*5*7, on real tensors as the capture's dispatch mode passes them


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no grouped matmul")
def test_grouped_matmul_flops_are_the_sum_of_its_groups_gemms():
    """Each layout of torch._grouped_mm run for real on CPU (offs = [4, 12]: groups of 4 and 8 along the split
    dimension; every dimension a multiple of 4 floats, the kernel's 16-byte strides), its FLOPs counted as the sum of
    the per-group GEMMs it stands for (2·m·k·n each), against the formula the capture uses, which sees only shapes."""
    from graphviz_core.capture.flop_formulas import grouped_mm_flops

    offs = torch.tensor([4, 12], dtype=torch.int32)
    sizes = [4, 8]  # group sizes along the split dimension
    r = torch.randn
    layouts = {
        # (a, b): per-group GEMMs
        "rows x (groups, k, n)": (r(12, 4), r(2, 4, 8), sum(2 * g * 4 * 8 for g in sizes)),
        "(m, k) x (k, n), k split": (r(4, 12), r(12, 8), sum(2 * 4 * g * 8 for g in sizes)),
        "(groups, m, k) x (k, n), n split": (r(2, 4, 8), r(8, 12), sum(2 * 4 * 8 * g for g in sizes)),
    }
    for name, (a, b, per_group) in layouts.items():
        out = torch._grouped_mm(a, b, offs=offs)
        assert grouped_mm_flops(tuple(a.shape), tuple(b.shape), out_val=tuple(out.shape)) == per_group, name
    a, b = r(2, 4, 8), r(2, 8, 12)  # both 3-D: one GEMM per group, as bmm
    out = torch._grouped_mm(a, b)
    assert grouped_mm_flops(tuple(a.shape), tuple(b.shape), out_val=tuple(out.shape)) == 2 * (2 * 4 * 8 * 12)
