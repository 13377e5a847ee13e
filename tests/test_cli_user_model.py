"""`graph --model-file PATH:FACTORY` when the user's code does not return: KeyboardInterrupt, sys.exit() or another
BaseException from the factory or the forward pass is one sentence and exit 2; a real Ctrl-C still interrupts.
And a folder or a FIFO named as the model file says what it is."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from graphviz_core.cli import main

MODELS = """
import sys
import time

import torch


class Stop(BaseException):
    pass


class Net(torch.nn.Module):
    def __init__(self, raise_in_forward=None):
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)
        self.raise_in_forward = raise_in_forward

    def forward(self, x):
        if self.raise_in_forward is not None:
            self.raise_in_forward()
        return self.linear(x)


def loss(out):
    return out.sum()


def interrupt():
    raise KeyboardInterrupt


def exit_quietly():
    sys.exit()


def exit_3():
    sys.exit(3)


def stop():
    raise Stop("the factory gave up")


def interrupt_in_forward():
    return Net(interrupt), torch.randn(3, 4), loss


def exit_in_forward():
    return Net(exit_3), torch.randn(3, 4), loss


def stop_in_forward():
    return Net(stop), torch.randn(3, 4), loss


def slow():
    def wait():
        print("forward started", flush=True)
        for _ in range(600):  # short sleeps, as a forward's many ops: CPython runs a signal's handler in the main
            time.sleep(0.1)   # thread once it runs again, which a single long sleep may not do if another thread took it

    return Net(wait), torch.randn(3, 4), loss
"""


@pytest.fixture
def models(tmp_path):
    path = tmp_path / "models.py"
    path.write_text(textwrap.dedent(MODELS))
    return path


@pytest.mark.parametrize(
    ("factory", "words"),
    [
        # before: KeyboardInterrupt and Stop escaped main() (a traceback); sys.exit() left with exit 0 and no word
        ("interrupt", "raised KeyboardInterrupt while loading it (importing the file and calling interrupt())"),
        ("exit_quietly", "called sys.exit() while loading it (importing the file and calling exit_quietly())"),
        ("exit_3", "called sys.exit(3) while loading it"),
        ("stop", "raised Stop while loading it (importing the file and calling stop()): the factory gave up"),
        ("interrupt_in_forward", "raised KeyboardInterrupt during the capture (forward, loss and backward)"),
        ("exit_in_forward", "called sys.exit(3) during the capture (forward, loss and backward)"),
        ("stop_in_forward", "raised Stop during the capture (forward, loss and backward): the factory gave up"),
    ],
)
def test_user_code_that_stops_the_program_is_one_sentence_and_exit_2(models, factory, words, capsys):
    assert main(["graph", "--model-file", f"{models}:{factory}"]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err
    assert err[0].startswith(f"graphviz-core: {models}:{factory} ") and "a model file must return" in err[0]
    assert captured.out == ""


def test_the_same_in_a_real_process_prints_no_traceback(models):
    # the exit status and stderr of the real program, as a shell sees them (sys.exit(0) used to look like success)
    for factory in ("exit_quietly", "interrupt_in_forward"):
        done = subprocess.run([sys.executable, "-m", "graphviz_core", "graph", "--model-file", f"{models}:{factory}"],
                              capture_output=True, text=True, timeout=300, env={**os.environ, "GRAPHVIZ_CORE_DEVICE": "cpu"})
        assert done.returncode == 2, (factory, done.stderr)
        assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
        assert done.stdout == ""


def test_a_real_ctrl_c_still_interrupts(models):
    # A SIGINT that really arrived is the user's Ctrl-C, wherever it lands (here: inside the user's forward, which
    # sleeps): it stops the program with exit 130, not with the exit 2 of a model that raised KeyboardInterrupt.
    process = subprocess.Popen([sys.executable, "-m", "graphviz_core", "graph", "--model-file", f"{models}:slow"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "GRAPHVIZ_CORE_DEVICE": "cpu"})
    # what the model file prints goes to stderr (stdout is the tool's own channel, test_hostile_inputs)
    deadline = time.time() + 240
    line = ""
    while time.time() < deadline and "forward started" not in line:
        line = process.stderr.readline()
    assert "forward started" in line
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=120)  # left alone, the forward would end after 60 s and the run exit 0
    assert process.returncode == 130, (process.returncode, err)
    assert err.strip().splitlines()[-1] == "graphviz-core: interrupted (Ctrl-C)." and "Traceback" not in err
    assert out == ""


def test_a_folder_or_a_fifo_named_as_the_model_file_says_what_it_is(tmp_path, capsys):
    # both used to read "model file ... does not exist", which is false
    folder = tmp_path / "nets"
    folder.mkdir()
    assert main(["graph", "--model-file", f"{folder}:make"]) == 2
    assert capsys.readouterr().err.strip() == f"graphviz-core: model file {folder} is a folder, not a Python file."
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    assert main(["graph", "--model-file", f"{fifo}:make"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"graphviz-core: model file {fifo} is not a regular file (a FIFO, socket or device), not a Python file.")
    assert main(["graph", "--model-file", f"{tmp_path}/nope.py:make"]) == 2
    assert capsys.readouterr().err.strip() == f"graphviz-core: model file {tmp_path}/nope.py does not exist."
