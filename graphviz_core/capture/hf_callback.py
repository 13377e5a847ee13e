"""The Hugging Face Trainer recorded: a `transformers.TrainerCallback` around `Trainer.train()` (docs/recording.md).

    from graphviz_core.capture.hf_callback import RecordCallback

    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[RecordCallback("runs/exp1")])
    trainer.train()

The recording starts at `on_train_begin` (graphviz_core.record, with the Trainer's model, so parameter and module
names are the model's) and ends at `on_train_end`. Steps are the Trainer's optimizer steps, taken from torch.optim's
step hooks as in any loop: with `gradient_accumulation_steps` N a step holds N backwards, and the parameter figures
are read after the Trainer's gradient clipping, from the gradient the optimizer steps with. A `train()` that raises
never reaches `on_train_end`: call `close()` (it ends the recording, marked incomplete, and removes its hooks).
"""

from __future__ import annotations

from transformers import TrainerCallback

from graphviz_core.capture.recorder import record


class RecordCallback(TrainerCallback):
    """Records the `Trainer.train()` it is given to into the folder `path`; `steps` and `nodes` as in `record()`."""

    def __init__(self, path, *, steps: int | None = None, nodes: bool = True) -> None:
        self.path, self.steps, self.nodes = path, steps, nodes
        self._context = None
        self.recorder = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self._context is not None:
            raise ValueError("this RecordCallback is recording already; give each train() run its own callback and "
                             "folder.")
        context = record(self.path, steps=self.steps, model=model, nodes=self.nodes)
        self.recorder = context.__enter__()
        self._context = context
        return control

    def on_train_end(self, args, state, control, **kwargs):
        self._finish(clean=True)
        return control

    def close(self) -> None:
        """End a recording that `train()` left open by raising (marked incomplete); nothing when none is open."""
        self._finish(clean=False)

    def _finish(self, clean: bool) -> None:
        context, self._context = self._context, None
        if context is None:
            return
        if clean:
            context.__exit__(None, None, None)
            return
        stop = RuntimeError("Trainer.train() did not finish")
        try:
            context.__exit__(RuntimeError, stop, None)
        except RuntimeError as exc:
            if exc is not stop:
                raise
