"""The three real loops the recorder's tests record (tests/test_record.py), written as functions that record into a
folder: for the Recordings page's tests, which open them."""

import torch

import graphviz_core


def _classified_with_sgd(path, model: torch.nn.Module, steps: int) -> None:
    """`steps` recorded SGD steps (lr 0.05) of 3-class cross-entropy on 6 random rows of 8 features each."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with graphviz_core.record(path, model=model):
        for _ in range(steps):
            torch.nn.functional.cross_entropy(model(torch.randn(6, 8)), torch.randint(0, 3, (6,))).backward()
            opt.step()
            opt.zero_grad()


def mlp_sgd(path, steps: int = 6) -> None:
    """An MLP with plain SGD."""
    torch.manual_seed(0)
    _classified_with_sgd(path, torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)),
                         steps)


def gpt2_adamw_accumulation(path, steps: int = 3, accumulation: int = 4) -> None:
    """A transformers GPT-2 (random weights, config typed here) with AdamW and 4-step gradient accumulation."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=97, n_positions=24, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(1)
    model = GPT2LMHeadModel(config)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    with graphviz_core.record(path, model=model):
        for _ in range(steps):
            for _ in range(accumulation):
                ids = torch.randint(0, 97, (2, 12))
                (model(ids, labels=ids).loss / accumulation).backward()
            opt.step()
            opt.zero_grad()


def float16_grad_scaler(path, steps: int = 5, overflow_at: int = 2) -> None:
    """float16 autocast with a GradScaler; step `overflow_at`'s loss is made infinite, so the scaler skips it and its
    gradient norms are not finite."""
    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
    with graphviz_core.record(path, model=model):
        for step in range(steps):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(5, 8)).float().pow(2).mean()
            if step == overflow_at:
                loss = loss * float("inf")
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()


def mlp_nan_fault(path, steps: int = 3, fault_at: int = 2) -> None:
    """An MLP with SGD whose hidden layer takes the square root of an exact zero at step `fault_at` (the last, so no NaN reaches the weights before it): its gradient there
    is 0 / (2 * 0) = NaN, started at that SqrtBackward0 node (not one of LOOPS: the findings' own test opens it)."""
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with graphviz_core.record(path, model=model):
        for step in range(steps):
            hidden = model[1](model[0](torch.randn(6, 8)))
            if step == fault_at:
                hidden = hidden + 0.0 * torch.sqrt(hidden - hidden.detach())
            torch.nn.functional.cross_entropy(model[2](hidden), torch.randint(0, 3, (6,))).backward()
            opt.step()
            opt.zero_grad()


class _Detached(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.base, self.adapter, self.head = torch.nn.Linear(8, 16), torch.nn.Linear(8, 16), torch.nn.Linear(16, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.base(x) + self.adapter(x).detach()))  # the adapter's output cut off


def mlp_detached_adapter(path, steps: int = 2) -> None:
    """An MLP whose adapter's output is detached before it joins the base layer's: adapter.weight and adapter.bias get
    no gradient, the cut placed at the add it entered (not one of LOOPS: the findings' own test opens it)."""
    torch.manual_seed(4)
    _classified_with_sgd(path, _Detached(), steps)


LOOPS = {"mlp-sgd": mlp_sgd, "gpt2-adamw-accumulation": gpt2_adamw_accumulation, "float16-grad-scaler": float16_grad_scaler}
