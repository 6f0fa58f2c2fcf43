"""Storage faults (issue 13, item 7): a full disk or a read-only artifacts folder gives one clear error
naming the path, and leaves nothing half-written and every finished artifact intact. Uses a small
tmpfs mounted by the test (skipped where mounting is not allowed)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tasks.store import ArtifactStore, StorageError, check_folder

ROOT = Path(__file__).resolve().parents[1]


class SmallDisk(type(Path())):
    """A folder with a 2 MiB tmpfs mounted on it."""

    def read_only(self) -> None:
        subprocess.run(["mount", "-o", "remount,ro", str(self)], check=True)


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs at tmp_path/disk (SmallDisk.read_only switches it to read-only)."""
    disk = SmallDisk(tmp_path / "disk")
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    yield disk
    subprocess.run(["umount", "-l", str(disk)])


def write_bytes(size: int):
    def produce(out: Path) -> dict:
        (out / "data.bin").write_bytes(b"x" * size)
        return {}

    return produce


def write_tensor(numel: int):
    """A produce that fails the way torch does on a full disk (not always an OSError)."""
    def produce(out: Path) -> dict:
        import torch

        torch.save(torch.zeros(numel), out / "weights.pt")
        return {}

    return produce


def write_safetensors(numel: int):
    """A produce that saves weights as base_model and export do: safetensors reports a full disk as its own
    SafetensorError and deletes the half-written file (so the disk is not full any more when it is caught)."""
    def produce(out: Path) -> dict:
        import torch
        from safetensors.torch import save_file

        save_file({"weight": torch.zeros(numel)}, str(out / "model.safetensors"))
        return {}

    return produce


@pytest.mark.parametrize("produce", [write_bytes(4 << 20), write_tensor(1 << 20), write_safetensors(1 << 20)],
                         ids=["file", "torch.save", "safetensors"])
def test_full_disk_names_the_path_and_keeps_what_was_written(small_disk, produce):
    store = ArtifactStore(small_disk)
    first = store.write("rollout", "k1", write_bytes(100_000), inputs={}, config={})

    with pytest.raises(StorageError) as error:
        store.write("score", "k2", produce, inputs={}, config={})
    message = str(error.value)
    assert "stage score (k2)" in message and str(small_disk) in message and "No space left" in message
    assert store.get("score", "k2") is None
    assert not list((small_disk / "score").glob(".tmp-*"))  # nothing half-written left behind
    assert check_folder(first.path, full=True)[1] == []  # the finished artifact is intact
    del error  # its traceback holds torch's open file, whose space the kernel frees only once it is closed
    import gc

    gc.collect()
    store.write("score", "k2", write_bytes(1000), inputs={}, config={})  # with room again it works


def test_read_only_folder_names_the_path(small_disk):
    store = ArtifactStore(small_disk)
    first = store.write("rollout", "k1", write_bytes(1000), inputs={}, config={})
    small_disk.read_only()
    with pytest.raises(StorageError, match="Read-only file system"):
        store.write("score", "k2", write_bytes(1000), inputs={}, config={})
    assert store.get("rollout", "k1") == first


def test_cli_on_a_read_only_artifacts_folder_prints_one_clear_error(small_disk, tiny_config_text, tmp_path):
    config = tmp_path / "ro.yaml"
    config.write_text(tiny_config_text.replace(str(tmp_path / "artifacts"), str(small_disk / "artifacts")))
    (small_disk / "artifacts").mkdir()
    small_disk.read_only()
    out = subprocess.run([sys.executable, "-m", "flows.cli", "run", str(config)], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) <= 3 and "Traceback" not in out.stderr, out.stderr
    assert str(small_disk / "artifacts") in out.stderr and "Read-only file system" in out.stderr


def test_a_stage_that_cannot_read_its_input_is_not_called_a_storage_error(tmp_path):
    store = ArtifactStore(tmp_path / "artifacts")

    def unreadable_input(out: Path) -> dict:
        raise PermissionError(13, "Permission denied", str(tmp_path / "data" / "train.jsonl"))

    with pytest.raises(PermissionError):
        store.write("transform", "k1", unreadable_input, inputs={}, config={})


def fill(disk: Path) -> Path:
    """Write a file until `disk` is full; delete it to free the space again."""
    import os

    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"x" * 4096)
    except OSError:
        pass
    finally:
        os.close(fd)
    return filler


def test_mlflow_store_on_a_full_disk_names_the_database_in_one_line(small_disk, tmp_path, monkeypatch, capfd):
    """Issue 42, item 5: sqlite's "database or disk is full" is a StorageError naming mlflow.db (no SQL dump),
    what was logged before is kept, and logging goes on once there is room again."""
    from tasks.lineage import Lineage

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    config_yaml = tmp_path / "config.yaml"
    config_yaml.write_text("a: 1\n")
    lineage = Lineage(small_disk, "full")
    run_id = lineage.start("full-run", {}, {"a": 1}, config_yaml)
    lineage.log_metrics(run_id, {"kept": 1.0})
    capfd.readouterr()
    filler = fill(small_disk)
    with pytest.raises(StorageError) as error:
        for step in range(100):
            lineage.log_metrics(run_id, {f"m{i}": float(i) for i in range(200)}, step=step)
    assert str(small_disk / "mlflow.db") in str(error.value) and "No space left" in str(error.value)
    assert "SQLAlchemy" not in capfd.readouterr().err  # MLflow's own traceback log of the error is dropped
    lineage.finish("FAILED")  # a failed run's last word on a full disk does not hide the error it failed with
    filler.unlink()
    lineage.log_metrics(run_id, {"after": 2.0}, step=1)
    metrics = lineage.client.get_run(run_id).data.metrics
    assert metrics["kept"] == 1.0 and metrics["after"] == 2.0


def test_a_library_error_on_a_full_artifacts_disk_is_one_line(small_disk, monkeypatch, capsys):
    """Prefect's temporary server keeps its database in the artifacts folder and answers a write it cannot make
    with HTTP 500: the run ends with one line naming the disk and how to resume (exit 2), not the library's
    traceback. Any other error on a disk with room left goes on as it was."""
    from flows import run as run_module
    from flows.launch import report_errors

    monkeypatch.setattr(run_module, "OPENED", [("tiny-20261127-101500", small_disk)])

    def server_error():
        raise RuntimeError("Server error '500 Internal Server Error' for url 'http://127.0.0.1:4242/api/task_runs/'")

    with pytest.raises(RuntimeError):  # room left: not a disk problem
        report_errors(server_error, debug=False)
    filler = fill(small_disk)
    assert report_errors(server_error, debug=False) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"the disk holding {small_disk} refused a write" in err[0]
    assert f"posttrain resume tiny-20261127-101500 --artifacts {small_disk}" in err[0]
    filler.unlink()
