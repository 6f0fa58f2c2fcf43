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
