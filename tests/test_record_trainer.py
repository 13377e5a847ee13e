"""The Hugging Face Trainer recorded by graphviz_core.capture.hf_callback.RecordCallback: a real Trainer.train() on a
tiny random-weight GPT-2 (config typed here) and token ids made here; no download (HF_HUB_OFFLINE=1)."""

import math
import os

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from graphviz_core.capture.hf_callback import RecordCallback  # noqa: E402
from graphviz_core.graph.recording import open_recording  # noqa: E402


class Ids(torch.utils.data.Dataset):
    def __init__(self, rows: int, seq: int, vocab: int) -> None:
        generator = torch.Generator().manual_seed(5)
        self.ids = torch.randint(0, vocab, (rows, seq), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class ByHand(TrainerCallback):
    """Each parameter's gradient norm just before the optimizer steps (after the Trainer's clipping), and its weights'
    norm, taken by hand."""

    def __init__(self, model) -> None:
        self.model, self.grads, self.weights = model, [], []

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.grads.append({n: float(torch.linalg.vector_norm(p.grad)) for n, p in self.model.named_parameters()
                           if p.grad is not None})
        self.weights.append({n: float(torch.linalg.vector_norm(p.detach())) for n, p in self.model.named_parameters()})


def test_a_trainer_run_is_recorded_step_by_step(tmp_path):
    torch.manual_seed(6)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=89, n_positions=16, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, max_steps=3, learning_rate=1e-3, report_to=[],
                             save_strategy="no", logging_strategy="no", use_cpu=True, dataloader_num_workers=0,
                             disable_tqdm=True, seed=6)
    by_hand, recording = ByHand(model), RecordCallback(tmp_path / "trainer")
    trainer = Trainer(model=model, args=args, train_dataset=Ids(12, 10, 89), callbacks=[by_hand, recording])
    trainer.train()
    assert torch.autograd.backward.__name__ == "backward" and not hasattr(torch.autograd.backward, "__wrapped__")
    run = open_recording(tmp_path / "trainer")
    assert run.complete and run.ranks == [0]
    steps = run.steps()
    assert len(steps) == trainer.state.global_step == 3
    for step, grads, weights in zip(steps, by_hand.grads, by_hand.weights, strict=True):
        # gradient_accumulation_steps 2: two backwards (micro-batches) per optimizer step, one distinct graph
        assert len(step.backward_graphs) == 2 and len(set(step.backward_graphs)) == 1
        assert step.lr is not None and not step.skipped
        # the model's own names (the Trainer's model given to record()); lm_head is tied to wte, named once
        assert set(step.parameters) == set(grads)
        for name, p in step.parameters.items():
            assert math.isclose(p.grad_norm, grads[name], rel_tol=1e-5), name
            assert math.isclose(p.weight_norm, weights[name], rel_tol=1e-5, abs_tol=1e-12), name
        assert math.isclose(step.grad_norm, math.sqrt(sum(v * v for v in grads.values())), rel_tol=1e-5)
    # the Trainer's linear schedule decays the learning rate from 1e-3 towards 0 over max_steps
    assert steps[0].lr > steps[1].lr > steps[2].lr


def test_close_ends_a_recording_a_failed_train_left_open(tmp_path):
    model = torch.nn.Linear(3, 1)
    callback = RecordCallback(tmp_path / "broken")
    callback.on_train_begin(None, None, None, model=model)
    model(torch.randn(2, 3)).sum().backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    callback.close()  # what a caller does after train() raised
    assert not hasattr(torch.autograd.backward, "__wrapped__")
    run = open_recording(tmp_path / "broken")
    assert run.complete is False and len(run.steps()) == 1
    callback.close()  # nothing open: nothing done
