"""Shipping this pipeline's code to Ray actors (stages/runtime/ray_cluster.py) without a Ray cluster: the files a
driver collects, and the folder an actor writes them into."""

from __future__ import annotations

import sys
from pathlib import Path

from stages.runtime import ray_cluster


def test_source_files_are_the_modules_and_their_project_closure():
    import stages.scoring.rewards.math as math_rewards

    files = ray_cluster.source_files(["stages.scoring.rewards.math"])
    assert files["stages/scoring/rewards/math.py"] == Path(math_rewards.__file__).read_text()
    assert all(not Path(p).is_absolute() and ".." not in Path(p).parts for p in files)  # relative to a path entry


def test_actors_share_one_folder_per_code_version_and_leave_no_other(tmp_path, monkeypatch):
    """Each actor used to write a folder of its own into the node's temp folder and leave it there (hundreds on a
    machine that ran the suite); now one folder per code version, whole or absent."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)  # tempfile reads TMPDIR again
    monkeypatch.setattr(sys, "path", list(sys.path))
    files = {"shipped_pkg/__init__.py": "", "shipped_pkg/mod.py": "VALUE = 1\n"}
    first = ray_cluster.install_code(files, "posttrain-test-code-")
    again = ray_cluster.install_code(files, "posttrain-test-code-")
    assert first == again and sys.path[:2] == [first, first]
    assert (Path(first) / "shipped_pkg" / "mod.py").read_text() == "VALUE = 1\n"
    other = ray_cluster.install_code({**files, "shipped_pkg/mod.py": "VALUE = 2\n"}, "posttrain-test-code-")
    assert other != first and (Path(other) / "shipped_pkg" / "mod.py").read_text() == "VALUE = 2\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([Path(first).name, Path(other).name])
