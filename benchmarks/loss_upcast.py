"""What the float32 loss costs: the loss as torchtitan and transformers' ForCausalLMLoss compute it (bf16 logits upcast
to float32 first, `pred.flatten(0, 1).float()`; the simulation's loss for transformers language models too) beside a
cross-entropy on the bf16 logits themselves: the peak of each one's forward and backward, on fake tensors under torch's
MemTracker, for Llama 3.1's vocabulary of 128,256 and the tokens of one rank.

    python benchmarks/loss_upcast.py [--tokens 32768]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker


def loss_peak(tokens: int, vocab: int, upcast: bool) -> int:
    with FakeTensorMode():
        hidden = torch.empty(tokens, vocab, dtype=torch.bfloat16, requires_grad=True)
        targets = torch.zeros(tokens, dtype=torch.long)
        tracker = MemTracker()
        tracker.track_external(hidden)
        with tracker:
            pred = hidden * 1  # the head's output: a non-leaf, as in the model
            loss = F.cross_entropy(pred.float() if upcast else pred, targets)
            del pred
            loss.backward()
        return max(v["Total"] for v in tracker.get_tracker_snapshot("peak").values())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--vocab", type=int, default=128256)
    args = parser.parse_args()
    ours, theirs = (loss_peak(args.tokens, args.vocab, upcast) for upcast in (False, True))
    print(f"{args.tokens} tokens x {args.vocab} logits, bf16; peaks include the logits and their gradient")
    print(f"loss on the bf16 logits (no upcast):         {ours:>16,} B = {ours / 2**30:6.2f} GiB")
    print(f"loss on float32 logits (.float(), as trained): {theirs:>14,} B = {theirs / 2**30:6.2f} GiB")
    print(f"difference:                                  {theirs - ours:>16,} B = {(theirs - ours) / 2**30:6.2f} GiB")


if __name__ == "__main__":
    main()
