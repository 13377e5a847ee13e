"""The recorder (docs/recording.md) and the gradient-flow debugger (docs/debugging.md) on a CUDA GPU: run for real by
`make test` and benchmarks/gpu_check.sh on a machine with a GPU; skipped, with the reason printed, elsewhere.

The CPU suite (tests/test_record.py, tests/test_gradient_flow.py) checks the same figures on the CPU; here the
device-specific parts are checked: the step's peak read from the CUDA caching allocator, backward times from CUDA
events, a GradScaler on "cuda", a NaN found at its node on the GPU.
"""

import inspect
import math

import pytest
import torch

import graphviz_core
from graphviz_core.analysis.gradient_flow import analyse
from graphviz_core.capture.record_hooks import COUNT_CHUNK, nonfinite_count
from graphviz_core.graph.recording import open_recording

cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device on this machine: the CUDA paths run on a GPU box (make test)"
)


def test_the_non_finite_count_adds_up_across_chunks():
    """The count runs on any device; on the CPU here, over three chunks: 2 x 4,194,304 + 5 values."""
    g = torch.randn(COUNT_CHUNK * 2 + 5)
    g[3], g[COUNT_CHUNK + 7], g[-1] = math.nan, math.inf, -math.inf  # one in each chunk
    assert int(nonfinite_count(g)) == 3
    assert int(nonfinite_count(g[:10])) == 1 and int(nonfinite_count(g[4:10])) == 0


def _mlp():
    torch.manual_seed(0)
    # 64*1024 + 1024*1024 + 1024*10 weights and 2,058 biases: 4,497,448 bytes of float32 parameters
    return torch.nn.Sequential(torch.nn.Linear(64, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                               torch.nn.Linear(1024, 10)).cuda()


def _sgd_loop(model, opt, steps, on_step=None):
    torch.manual_seed(1)
    batches = [(torch.randn(32, 64, device="cuda"), torch.randint(0, 10, (32,), device="cuda")) for _ in range(steps)]
    for x, y in batches:
        torch.nn.functional.cross_entropy(model(x), y).backward()
        if on_step is not None:
            on_step()
        opt.step()
        opt.zero_grad()


@cuda
def test_sgd_on_cuda_gradient_norms_update_ratio_and_the_allocators_peak(tmp_path):
    lr = 0.05
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    by_hand = []

    def take():  # after backward, before the step: the gradients and weights the recorder reads
        by_hand.append({n: (float(torch.linalg.vector_norm(p.grad)), float(torch.linalg.vector_norm(p.detach())))
                        for n, p in model.named_parameters()})

    with graphviz_core.record(tmp_path / "run", model=model):
        _sgd_loop(model, opt, 3, take)
    steps = open_recording(tmp_path / "run").steps()
    assert len(steps) == 3
    for step, hand in zip(steps, by_hand, strict=True):
        for name, (g, w) in hand.items():
            p = step.parameters[name]
            assert math.isclose(p.grad_norm, g, rel_tol=1e-5) and math.isclose(p.weight_norm, w, rel_tol=1e-5)
            assert math.isclose(p.update_ratio, lr * g / w, rel_tol=1e-5)  # plain SGD: |lr g| / |w|
        assert step.peak_source == "cuda allocator"

    # the same loop without the recorder, its peak per step read from the allocator by hand: the recorded peak is the
    # loop's, the recorder's copy of the parameters (4,497,448 bytes, for the update's norm) left out; what stays is
    # the per-node figures' temporaries in backward: counting the non-finite values of the largest gradient (the
    # 1024x1024 weight's, 1,048,576 values) makes a boolean and an int32 per value, 5 MiB, plus 0-dim results
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    bare = []
    torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(32, 64, device="cuda"), torch.randint(0, 10, (32,), device="cuda")
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        bare.append(torch.cuda.max_memory_allocated())
        opt.zero_grad()
        torch.cuda.reset_peak_memory_stats()
    for step, peak in zip(steps, bare, strict=True):
        assert peak <= step.peak_bytes <= peak + 5 * 2**20 + 2**16, f"step {step.step}: recorded {step.peak_bytes:,} B, bare {peak:,} B"


@cuda
def test_a_grad_scaler_on_cuda_skips_and_unscales(tmp_path):
    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 1)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    # float16's largest value is 65,504: a loss scaled by 2**24 overflows in the float16 backward, and the scaler
    # halves its scale and skips each step until the gradients fit
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 24)
    unscaled = []
    with graphviz_core.record(tmp_path / "amp", model=model):
        for _ in range(12):
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(torch.randn(16, 8, device="cuda")).float().pow(2).mean()
            scaler.scale(loss).backward()
            unscaled.append({n: float(torch.linalg.vector_norm(p.grad.float())) / scaler.get_scale()
                             for n, p in model.named_parameters()})
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    recording = open_recording(tmp_path / "amp")
    steps = recording.steps()
    skipped = [s for s in steps if s.skipped]
    assert skipped and len(skipped) < 12
    for step, hand in zip(steps, unscaled, strict=True):
        if not step.skipped:
            for name, g in hand.items():  # every gradient figure is the unscaled one
                assert math.isclose(step.parameters[name].grad_norm, g, rel_tol=1e-3)
    findings = analyse(recording)["findings"]
    assert [(f["kind"], f["step"]) for f in findings] == [("scaler-overflow", s.step) for s in skipped]


def _nan_fault(out):
    return 0.0 * torch.sqrt(out - out.detach())  # sqrt of an exact zero; its gradient is 0 / (2 * 0) = NaN


@cuda
def test_a_nan_started_on_the_gpu_is_named_at_its_node_and_line(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=3, n_embd=32, n_head=2, vocab_size=61, n_positions=16, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(5)
    model = GPT2LMHeadModel(config).cuda()
    mlp = model.transformer.h[1].mlp
    forward, state = mlp.forward, {"on": False}
    mlp.forward = lambda hidden: forward(hidden) + _nan_fault(forward(hidden)) if state["on"] else forward(hidden)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with graphviz_core.record(tmp_path / "run", model=model, check_forward=True):
        for step in range(3):
            state["on"] = step == 2  # the last step: the NaN reaches the weights after it
            x = torch.randint(0, 61, (3, 12), device="cuda")
            model(x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad()
    result = analyse(open_recording(tmp_path / "run"))
    backward = [f for f in result["findings"] if f["kind"] == "nonfinite-backward"]
    assert [(f["step"], f["node"], f["module"]) for f in backward] == [(2, "SqrtBackward0", "transformer.h.1.mlp")]
    lines, first = inspect.getsourcelines(_nan_fault)
    assert backward[0]["source"] == f"{__file__}:{first + 1}"
    times = [d["time_s"] for _, d in open_recording(tmp_path / "run").step_graph(0).nodes(data=True)]
    assert all(t is not None and t >= 0 for t in times)  # backward times taken with CUDA events
