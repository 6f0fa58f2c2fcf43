"""The artifact store: content keys, atomic writes, manifests as the only proof of existence."""

import json
import threading
import time

import pytest

from tasks.store import LOCKS, MANIFEST, ArtifactStore


def produce_file(text):
    def produce(out):
        (out / "data.txt").write_text(text)
        return {"n": len(text)}

    return produce


def test_key_depends_on_every_part(tmp_path):
    store = ArtifactStore(tmp_path)
    base = store.key("s", "v1", {"a": 1, "b": [1, 2]}, ["in1"])
    assert base == store.key("s", "v1", {"b": [1, 2], "a": 1}, ["in1"])  # canonical JSON
    assert base != store.key("s2", "v1", {"a": 1, "b": [1, 2]}, ["in1"])
    assert base != store.key("s", "v2", {"a": 1, "b": [1, 2]}, ["in1"])
    assert base != store.key("s", "v1", {"a": 2, "b": [1, 2]}, ["in1"])
    assert base != store.key("s", "v1", {"a": 1, "b": [1, 2]}, ["in2"])


def test_write_publishes_folder_with_manifest(tmp_path):
    store = ArtifactStore(tmp_path)
    art = store.write("s", "k1", produce_file("hello"), inputs={"x": "y"}, config={"a": 1})
    assert art.path == tmp_path / "s" / "k1"
    manifest = json.loads((art.path / MANIFEST).read_text())
    assert manifest["files"]["data.txt"]["size"] == 5
    assert len(manifest["files"]["data.txt"]["sha256"]) == 64
    assert manifest["summary"] == {"n": 5} and manifest["inputs"] == {"x": "y"}
    assert store.get("s", "k1").manifest == manifest
    assert not [p for p in (tmp_path / "s").iterdir() if p.name.startswith(".tmp")]


def test_folder_without_manifest_does_not_exist_and_is_replaced(tmp_path):
    store = ArtifactStore(tmp_path)
    half = tmp_path / "s" / "k1"
    half.mkdir(parents=True)
    (half / "data.txt").write_text("partial")
    assert store.get("s", "k1") is None
    art = store.write("s", "k1", produce_file("whole"), inputs={}, config={})
    assert (art.path / "data.txt").read_text() == "whole"


def test_truncated_file_invalidates_manifest(tmp_path):
    store = ArtifactStore(tmp_path)
    art = store.write("s", "k1", produce_file("hello"), inputs={}, config={})
    (art.path / "data.txt").write_text("he")
    assert store.get("s", "k1") is None
    found, damage = store.lookup("s", "k1")  # what materialize reads: the damage named, to recompute
    assert found is None and len(damage) == 1 and "data.txt" in damage[0]
    assert store.lookup("s", "absent") == (None, [])  # never computed: no damage to report


def test_failed_producer_leaves_nothing(tmp_path):
    store = ArtifactStore(tmp_path)

    def boom(out):
        (out / "data.txt").write_text("partial")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        store.write("s", "k1", boom, inputs={}, config={})
    assert store.get("s", "k1") is None
    assert [p.name for p in (tmp_path / "s").iterdir()] == []  # nothing half-written left
    assert [p.name for p in (tmp_path / LOCKS / "s").iterdir()] == ["k1.lock"]


def test_write_returns_a_folder_another_writer_finished_meanwhile(tmp_path):
    """Two threads write one key at once: produce runs once, the second gets the first's folder."""
    store = ArtifactStore(tmp_path)
    calls, results = [], []

    def produce(out):
        calls.append(threading.get_ident())
        time.sleep(0.3)
        (out / "data.txt").write_text("once")
        return {}

    threads = [threading.Thread(target=lambda: results.append(store.write("s", "k1", produce, inputs={}, config={})))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert sorted(a.reused for a in results) == [False, True]
    assert results[0] == results[1] and results[0].manifest == results[1].manifest


def test_temp_folder_of_a_killed_writer_is_never_read_and_is_cleaned(tmp_path):
    store = ArtifactStore(tmp_path)
    stale = tmp_path / "s" / ".tmp-k1-99999-deadbeef"  # what a writer killed mid-produce leaves
    stale.mkdir(parents=True)
    (stale / "data.txt").write_text("half")
    (stale / MANIFEST).write_text("{}")
    assert store.get("s", "k1") is None
    art = store.write("s", "k1", produce_file("whole"), inputs={}, config={})
    assert not art.reused and (art.path / "data.txt").read_text() == "whole"
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == ["k1"]


def test_key_lock_is_reentrant_and_not_kept_by_forked_children(tmp_path):
    import fcntl
    import os

    from tasks.store import key_lock

    lock = tmp_path / "x.lock"
    ready_r, ready_w = os.pipe()
    with key_lock(lock):
        with key_lock(lock):  # the same thread again: no deadlock
            pass
        child = os.fork()
        if child == 0:  # a forked child (e.g. a worker pool) lives on after the parent lets go
            os.write(ready_w, b"1")  # past the at-fork handlers
            time.sleep(3)
            os._exit(0)
    os.read(ready_r, 1)
    fd = os.open(lock, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises BlockingIOError if the child kept it
    finally:
        os.close(fd)
        os.kill(child, 9)
        os.waitpid(child, 0)


def flip_byte(path, keep_mtime=False):
    """Change one byte of `path` in place (same size); with keep_mtime, put its mtime back as it was."""
    import os

    before = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(before.st_size // 2)
        byte = f.read(1)
        f.seek(before.st_size // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    if keep_mtime:
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


@pytest.mark.parametrize("keep_mtime", [False, True], ids=["in-place", "mtime-put-back"])
def test_same_size_change_is_found_before_reuse_and_the_folder_set_aside(tmp_path, keep_mtime):
    store = ArtifactStore(tmp_path)
    art = store.write("s", "k1", produce_file("hello"), inputs={}, config={})
    assert store.get("s", "k1") == art
    flip_byte(art.path / "data.txt", keep_mtime)
    found, damage = store.lookup("s", "k1")
    assert found is None and damage and "data.txt" in damage[0] and "sha256" in damage[0]
    again = store.write("s", "k1", produce_file("hello"), inputs={}, config={})
    assert not again.reused and (again.path / "data.txt").read_text() == "hello"
    [aside] = (tmp_path / "s" / ".damaged").iterdir()  # kept for inspection, as `posttrain verify --repair` does
    assert aside.name.startswith("k1-") and (aside / "data.txt").read_bytes() != b"hello"


def test_reuse_hashes_a_file_once_while_it_is_unchanged(tmp_path, monkeypatch):
    """The sha256 check costs a cached rerun nothing while a file keeps its (inode, size, mtime, ctime): the
    write records them, a changed file is hashed again."""
    from tasks import store as store_module

    store = ArtifactStore(tmp_path)
    art = store.write("s", "k1", produce_file("hello"), inputs={}, config={})
    hashed = []
    real = store_module.sha256_file
    monkeypatch.setattr(store_module, "sha256_file", lambda p: hashed.append(p.name) or real(p))
    assert store.get("s", "k1") == art and hashed == []
    (art.path / "data.txt").write_text("hello")  # same bytes, a new ctime: hashed again, then trusted
    assert store.get("s", "k1") == art and store.get("s", "k1") == art and hashed == ["data.txt"]


def test_verify_reports_a_folder_whose_manifest_was_deleted(tmp_path, capsys):
    from flows.cli import main as cli

    store = ArtifactStore(tmp_path)
    store.write("s", "k1", produce_file("hello"), inputs={}, config={})
    lost = store.write("s", "k2", produce_file("world"), inputs={}, config={}).path
    (lost / MANIFEST).unlink()
    (tmp_path / "runs" / "some-run").mkdir(parents=True)  # not a stage's folder
    store.write("data/cfg", "v1", produce_file("rows"), inputs={}, config={})  # a data version: two levels
    assert cli(["verify", "--artifacts", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert f"damaged: s/k2: {MANIFEST} is missing" in out and "3 artifact folders checked, 1 damaged" in out
    assert cli(["verify", "--artifacts", str(tmp_path), "--repair"]) == 0
    assert not lost.exists() and list((tmp_path / "s" / ".damaged").iterdir())
    assert cli(["verify", "--artifacts", str(tmp_path)]) == 0


class NoLineage:
    """What materialize logs to MLflow, dropped."""

    parent_id = None  # no pipeline run: a cached stage opens no MLflow run

    class client:
        set_terminated = staticmethod(lambda *args, **kwargs: None)

    def stage_run(self, *args, **kwargs):
        return "run"

    def log_metrics(self, *args, **kwargs):
        pass

    def set_tags(self, *args, **kwargs):
        pass


def test_same_size_damage_to_parquet_and_safetensors_is_recomputed_with_a_warning(tiny_config, tmp_path):
    """Issue 42, item 3: a flipped byte in transform's train.parquet and in base_model's model.safetensors (its
    mtime put back) is not served again: each stage is recomputed with a warning naming the file, to the same
    bytes."""
    from flows.config import load_config
    from tasks.reporting import Reporter
    from tasks.stage_tasks import RunContext, base_model_task, demo_data_task, transform_task

    root = tmp_path / "artifacts"
    reporter = Reporter(root, quiet=True)
    ctx = RunContext(load_config(tiny_config), ArtifactStore(root), NoLineage(), reporter)

    def stages():
        prompts = transform_task.fn(ctx, demo_data_task.fn(ctx))
        return prompts, base_model_task.fn(ctx, prompts)

    prompts, model = stages()
    files = [prompts.file("train.parquet"), model.file("model.safetensors")]
    original = [f.read_bytes() for f in files]
    flip_byte(files[0])
    flip_byte(files[1], keep_mtime=True)
    again = stages()
    assert [a.reused for a in again] == [False, False]
    assert [f.read_bytes() for f in files] == original
    for f in files:
        assert [w for w in reporter.warnings if f.name in w and "recomputing" in w], reporter.warnings
        assert list((f.parent.parent / ".damaged").glob(f"*/{f.name}"))
