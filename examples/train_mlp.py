"""A plain training loop with no recorder in it: `graphviz-core record` records it unchanged (docs/recording.md).

    python examples/train_mlp.py --steps 20 --lr 0.05
"""

import argparse

import torch

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--lr", type=float, default=0.05)
parser.add_argument("--accumulate", type=int, default=1, help="backwards per optimizer step")
args = parser.parse_args()

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))
opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
for _step in range(args.steps):
    for _ in range(args.accumulate):
        x = torch.randn(32, 16)
        loss = torch.nn.functional.cross_entropy(model(x), (x[:, :4].argmax(dim=1)))
        (loss / args.accumulate).backward()
    opt.step()
    opt.zero_grad()
print(f"trained {args.steps} steps; last loss {loss.item():.4f}")  # noqa: T201
