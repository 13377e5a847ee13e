"""The recorder under FSDP2 (issue 35 item 8): each rank holds a shard of every parameter, and the recorded gradient,
weight and update norms are the whole parameter's (the shards' squared norms summed across ranks, rooted), equal to
the same step run in one process. Two real gloo processes on the CPU."""

import math

import torch

from graphviz_core.graph.recording import open_recording


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.ReLU(), torch.nn.Linear(10, 3))


def _batches():
    torch.manual_seed(7)  # the same batches on every rank and in the single process
    return [torch.randn(5, 6) for _ in range(2)]


def _fsdp_rank(rank, world, port, folder, results):
    from torch.distributed.fsdp import fully_shard

    import graphviz_core
    from tests.gloo import gloo_group

    with gloo_group(rank, world, port):
        model = _model()
        for layer in (model[0], model[2]):
            fully_shard(layer)
        fully_shard(model)
        shards = {n: tuple(p.to_local().shape) for n, p in model.named_parameters()}
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with graphviz_core.record(folder, model=model):
            for x in _batches():
                model(x).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
        if rank == 0:
            results.put(shards)


def test_fsdp2_norms_are_the_whole_parameters_equal_to_one_process(tmp_path):
    from tests.gloo import spawn_ranks

    shards = spawn_ranks(_fsdp_rank, 2, str(tmp_path / "fsdp"))
    # FSDP2 shards each parameter's first dimension over the 2 ranks: rank 0 holds 5 of the first layer's 10 rows
    assert shards["0.weight"] == (5, 6) and shards["2.weight"] == (2, 10)
    # the same two steps in one process, the norms taken by hand (FSDP2 averages the ranks' gradients: the same
    # batch on both ranks gives this process's gradient)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    hand = []
    for x in _batches():
        model(x).pow(2).mean().backward()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        grads = {n: float(torch.linalg.vector_norm(p.grad)) for n, p in model.named_parameters()}
        weights = {n: float(torch.linalg.vector_norm(p.detach())) for n, p in model.named_parameters()}
        opt.step()
        updates = {n: float(torch.linalg.vector_norm(p.detach() - before[n])) for n, p in model.named_parameters()}
        opt.zero_grad()
        hand.append((grads, weights, updates))
    recording = open_recording(tmp_path / "fsdp")
    assert recording.ranks == [0, 1] and recording.complete
    for rank in (0, 1):
        steps = recording.steps(rank)
        assert len(steps) == 2
        for step, (grads, weights, updates) in zip(steps, hand, strict=True):
            for name, p in step.parameters.items():
                assert math.isclose(p.grad_norm, grads[name], rel_tol=1e-5), (rank, name)
                assert math.isclose(p.weight_norm, weights[name], rel_tol=1e-5), (rank, name)
                assert math.isclose(p.update_norm, updates[name], rel_tol=1e-4, abs_tol=1e-9), (rank, name)
            whole = math.sqrt(sum(g * g for g in grads.values()))  # the whole gradient's norm, every parameter
            assert math.isclose(step.grad_norm, whole, rel_tol=1e-5)
