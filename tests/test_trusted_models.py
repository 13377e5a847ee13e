"""The web app's trusted model folder: only files that lie inside it, links resolved, are listed or imported, and what
the server says about a trusted model's failure names no path on the server."""

from __future__ import annotations

import pytest

from graphviz_core.capture.engine import capture_backward
from graphviz_core.config import ModelConfig
from graphviz_core.models.custom import CUSTOM
from graphviz_core.models.model_files import TRUSTED_DIR_ENV, trusted_factories, trusted_source

# A factory that leaves a mark when it runs: the proof that code outside the folder was executed.
MARKING = """
import pathlib
import torch

def make():
    pathlib.Path({mark!r}).write_text("ran")
    model = torch.nn.Linear(4, 2)
    return model, torch.ones(3, 4), lambda out: out.sum()
"""

PLAIN = """
import torch

def make():
    return torch.nn.Linear(4, 2), torch.ones(3, 4), lambda out: out.sum()
"""


@pytest.fixture
def folders(tmp_path, monkeypatch):
    trusted, outside = tmp_path / "trusted", tmp_path / "elsewhere"
    trusted.mkdir()
    outside.mkdir()
    monkeypatch.setenv(TRUSTED_DIR_ENV, str(trusted))
    return trusted, outside


def test_a_link_out_of_the_trusted_folder_is_neither_listed_nor_run(folders, tmp_path):
    trusted, outside = folders
    mark = tmp_path / "ran-outside"
    (outside / "evil.py").write_text(MARKING.format(mark=str(mark)))
    (trusted / "evil.py").symlink_to(outside / "evil.py")  # a file link pointing out
    (tmp_path / "evil_dir").mkdir()
    (tmp_path / "evil_dir" / "inner.py").write_text(MARKING.format(mark=str(mark)))
    (trusted / "linked_dir.py").symlink_to(tmp_path / "evil_dir")  # a folder link named like a module
    (trusted / "net.py").write_text(PLAIN)
    (trusted / "alias.py").symlink_to(trusted / "net.py")  # a link that stays inside: still the operator's file
    assert trusted_factories() == ["alias.py:make", "net.py:make"]
    with pytest.raises(ValueError, match=r"'evil.py:make' is not a model in the trusted folder"):
        trusted_source("evil.py:make")
    with pytest.raises(ValueError, match="is not a model in the trusted folder"):
        capture_backward(ModelConfig(model=CUSTOM, preset="evil.py:make", device="cpu"))
    assert not mark.exists()
    # Linear(4, 2) and a sum: Addmm, T, 2 parameter leaves, Sum = 5 nodes
    assert capture_backward(ModelConfig(model=CUSTOM, preset="alias.py:make", device="cpu")).summary.nodes == 5


def test_a_link_swapped_after_the_listing_is_refused_at_import(folders, tmp_path):
    trusted, outside = folders
    mark = tmp_path / "ran-outside"
    (trusted / "net.py").write_text(PLAIN)
    assert trusted_factories() == ["net.py:make"]
    (outside / "net.py").write_text(MARKING.format(mark=str(mark)).replace("def make", "def other"))
    (outside / "net.py").write_text((outside / "net.py").read_text() + PLAIN)
    (trusted / "net.py").unlink()
    (trusted / "net.py").symlink_to(outside / "net.py")
    with pytest.raises(ValueError, match="is not a model in the trusted folder"):
        trusted_source("net.py:make")


FAILING = """
import torch

SECRET = {secret!r}

def at_import():
    return None

{at_import}

def in_factory():
    raise FileNotFoundError(f"[Errno 2] No such file or directory: '{{SECRET}}/weights.pt'")

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)

    def forward(self, x):
        raise RuntimeError(f"cannot read {{SECRET}}/shards/0.bin while tracing")

def in_forward():
    return Net(), torch.ones(3, 4), lambda out: out.sum()

def in_loss():
    return torch.nn.Linear(4, 2), torch.ones(3, 4), lambda out: open(f"{{SECRET}}/labels.csv")
"""


@pytest.mark.parametrize(
    ("factory", "at_import", "words"),
    [
        ("at_import", "open(SECRET + '/config.yaml')", "importing broken.py raised FileNotFoundError"),
        ("in_factory", "", "in_factory() raised FileNotFoundError"),
        ("in_forward", "", "raised RuntimeError during the capture: cannot read 0.bin while tracing"),
        ("in_loss", "", "raised FileNotFoundError during the capture"),
    ],
)
def test_what_a_trusted_model_raises_reaches_the_page_without_server_paths(folders, factory, at_import, words):
    trusted, outside = folders
    secret = str(outside / "private")
    (trusted / "broken.py").write_text(FAILING.format(secret=secret, at_import=at_import))
    config = ModelConfig(model=CUSTOM, preset=f"broken.py:{factory}", device="cpu")
    with pytest.raises(ValueError) as raised:
        capture_backward(config)
    message = str(raised.value)
    assert words in message
    assert str(trusted) not in message and str(outside) not in message and "/" + outside.name not in message, message
