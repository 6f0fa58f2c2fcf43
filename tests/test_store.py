"""The artifact store: content keys, atomic writes, manifests as the only proof of existence."""

import json

import pytest

from tasks.store import MANIFEST, ArtifactStore


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


def test_failed_producer_leaves_nothing(tmp_path):
    store = ArtifactStore(tmp_path)

    def boom(out):
        (out / "data.txt").write_text("partial")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        store.write("s", "k1", boom, inputs={}, config={})
    assert store.get("s", "k1") is None
    assert list((tmp_path / "s").iterdir()) == []
