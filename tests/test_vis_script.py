"""Graph frames load vis-network from the app's static folder, under the server's base path, or inline it."""

import hashlib
import subprocess
import sys

import pytest
from streamlit import config

from graphviz_core.export import vis_asset
from graphviz_core.export.vis_asset import VIS_SCRIPT
from graphviz_core.ui import vis_script


@pytest.fixture
def options():
    saved = {name: config.get_option(name) for name in ("server.enableStaticServing", "server.baseUrlPath")}
    yield config.set_option
    for name, value in saved.items():
        config.set_option(name, value)


@pytest.mark.parametrize(("base", "url"), [("", "/app/static/vis-network.min.js?v="),
                                           ("team/backprop/", "/team/backprop/app/static/vis-network.min.js?v=")])
def test_the_script_url_follows_the_servers_base_path_and_names_the_content(options, base, url):
    options("server.enableStaticServing", True)
    options("server.baseUrlPath", base)
    # ?v= is the first 12 hex digits of the script's SHA-256: a new pyvis script gets a new URL
    assert vis_script.vis_src() == url + hashlib.sha256(VIS_SCRIPT.read_bytes()).hexdigest()[:12]
    assert (vis_script.STATIC / VIS_SCRIPT.name).read_bytes() == VIS_SCRIPT.read_bytes()


def test_without_static_serving_the_frames_inline_it(options):
    options("server.enableStaticServing", False)
    assert vis_script.vis_src() is None


def test_a_folder_that_cannot_be_written_means_inline(monkeypatch, tmp_path, options):
    options("server.enableStaticServing", True)
    blocked = tmp_path / "static"
    blocked.write_text("a file where the folder should be")  # mkdir and the copy both fail
    monkeypatch.setattr(vis_script, "STATIC", blocked)
    vis_script._published.cache_clear()
    try:
        assert vis_script.vis_src() is None
    finally:
        vis_script._published.cache_clear()


def test_publish_writes_once_and_leaves_a_current_copy_alone(tmp_path, monkeypatch):
    monkeypatch.setattr(vis_script, "STATIC", tmp_path / "static")
    digest = vis_script.publish()
    target = tmp_path / "static" / vis_script.VIS_SCRIPT.name
    assert digest and target.read_bytes() == vis_script.VIS_SCRIPT.read_bytes()

    def no_copy(*args, **kwargs):
        raise AssertionError("a current copy was written again")

    monkeypatch.setattr(vis_asset.shutil, "copy2", no_copy)  # a server finding make's copy writes nothing
    assert vis_script.publish() == digest
    target.write_bytes(b"// stale")
    with pytest.raises(AssertionError, match="written again"):  # a stale copy is replaced
        vis_script.publish()


def test_make_copies_the_script_without_importing_pyvis_streamlit_or_torch(tmp_path):
    # make's set-up step: importing those three with no bytecode yet took about 4 s of it
    probe = ("import sys, pathlib; from graphviz_core.export import vis_asset; "
             f"assert vis_asset.publish(pathlib.Path({str(tmp_path / 's')!r})); "
             "print(sorted(m for m in ('pyvis', 'streamlit', 'torch', 'networkx') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
    assert (tmp_path / "s" / VIS_SCRIPT.name).read_bytes() == VIS_SCRIPT.read_bytes()
