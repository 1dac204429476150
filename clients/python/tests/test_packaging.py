"""The package installs under its PyPI name into a fresh virtualenv."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import venv
from pathlib import Path

from harness import REPO


def test_installs_in_a_fresh_venv_as_stepgate_client(tmp_path: Path):
    src = tmp_path / "src"
    shutil.copytree(REPO / "clients" / "python", src,
                    ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__", "tests"))
    # The system's site-packages for confluent-kafka (no index needed for it);
    # the package itself is installed into the venv.
    venv.EnvBuilder(with_pip=True, system_site_packages=True).create(tmp_path / "venv")
    py = str(tmp_path / "venv" / "bin" / "python")
    # Only the venv: not the PYTHONPATH the suite itself runs with.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    pip = subprocess.run([py, "-m", "pip", "install", "-q", "--no-deps", str(src)],
                         capture_output=True, text=True, timeout=600, env=env)
    assert pip.returncode == 0, pip.stderr
    probe = subprocess.run([py, "-c", """
import importlib.metadata as m, json, pathlib
import stepgate_client
dist = m.distribution("stepgate-client")
files = [str(f) for f in dist.files]
print(json.dumps({
    "version": stepgate_client.__version__,
    "dist_version": dist.version,
    "file": stepgate_client.__file__,
    "py_typed": any(f.endswith("stepgate_client/py.typed") for f in files),
    "top": sorted({f.split("/")[0] for f in files if "/" in f and not ".dist-info" in f}),
}))
"""], capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert probe.returncode == 0, probe.stderr
    got = json.loads(probe.stdout)
    assert got["version"] == got["dist_version"]
    assert str(tmp_path / "venv") in got["file"]
    assert got["py_typed"]
    # Nothing installed under the name of PyPI's unrelated `stepgate`.
    assert got["top"] == ["stepgate_client"]
    pip_show = subprocess.run([py, "-m", "pip", "show", "stepgate-client"],
                              capture_output=True, text=True, timeout=120, env=env)
    assert "Name: stepgate-client" in pip_show.stdout


def test_an_in_tree_install_leaves_the_source_tree_as_it_was(tmp_path: Path):
    """`pip install ./clients/python` from a checkout builds in the source
    tree itself: nothing may be left there (no `build/`, no `*.egg-info`)."""
    src = tmp_path / "clients" / "python"
    shutil.copytree(REPO / "clients" / "python", src,
                    ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info"))

    def tree():
        return sorted(str(p.relative_to(src)) for p in src.rglob("*")
                      if "__pycache__" not in p.parts)

    before = tree()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    pip = subprocess.run(["python3", "-m", "pip", "install", "-q", "--no-deps", "--target",
                          str(tmp_path / "site"), "./clients/python"],
                         capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert pip.returncode == 0, pip.stderr
    assert (tmp_path / "site" / "stepgate_client" / "py.typed").is_file()
    assert set(tree()) - set(before) == set(), "the build left files in the source tree"
