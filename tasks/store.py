"""The artifact store: the one place that maps a stage and its inputs to a folder.

`artifacts/<stage>/<key>/`, key = content hash of (stage name, stage code version,
canonical JSON of the stage's config section, input artifact keys). A folder is written
in a temp folder beside it, `_manifest.json` last, then renamed into place; a folder
without a valid manifest does not exist and is recomputed.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import inspect
import json
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

MANIFEST = "_manifest.json"
PRODUCERS = ("torch", "transformers", "trl", "peft", "pyarrow")


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def code_version(*modules) -> str:
    """Hash of the modules' source: editing a stage's code changes its artifact keys."""
    digest = hashlib.sha256()
    for module in modules:
        digest.update(inspect.getsource(module).encode())
    return digest.hexdigest()[:12]


@dataclass(frozen=True)
class Artifact:
    """A finished stage output: its folder and manifest."""

    stage: str
    key: str
    path: Path
    manifest: dict

    def file(self, name: str) -> Path:
        return self.path / name


class ArtifactStore:
    """Resolves, reads and atomically writes stage folders under `root`."""

    def __init__(self, root: Path | str):
        self.root = Path(root).resolve()

    def key(self, stage: str, version: str, config: Any, input_keys: list[str]) -> str:
        payload = canonical_json({"stage": stage, "version": version, "config": config, "inputs": list(input_keys)})
        return hashlib.sha256(payload.encode()).hexdigest()[:20]

    def path(self, stage: str, key: str) -> Path:
        return self.root / stage / key

    def get(self, stage: str, key: str) -> Artifact | None:
        """The finished artifact, or None if its folder or manifest is missing or does not match the files."""
        folder = self.path(stage, key)
        try:
            manifest = json.loads((folder / MANIFEST).read_text())
        except (OSError, ValueError):
            return None
        for name, meta in manifest.get("files", {}).items():
            f = folder / name
            if not f.is_file() or f.stat().st_size != meta["size"]:
                return None
        return Artifact(stage, key, folder, manifest)

    def write(self, stage: str, key: str, produce: Callable[[Path], dict], *, inputs: dict[str, str],
              config: Any) -> Artifact:
        """Run produce(tmp_dir) -> summary dict, then publish the folder with its manifest."""
        final = self.path(stage, key)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f".tmp-{key}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        started = time.time()
        try:
            summary = produce(tmp) or {}
            manifest = {
                "stage": stage,
                "key": key,
                "inputs": inputs,
                "config": config,
                "summary": summary,
                "files": self._describe_files(tmp),
                "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "wall_time_s": round(time.time() - started, 3),
                "producers": {p: _version(p) for p in PRODUCERS},
            }
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, default=str))
            if final.exists():  # an unfinished folder from a killed run: it never had a manifest
                shutil.rmtree(final)
            os.replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return Artifact(stage, key, final, manifest)

    @staticmethod
    def _describe_files(folder: Path) -> dict:
        files = {}
        for f in sorted(p for p in folder.rglob("*") if p.is_file()):
            meta = {"size": f.stat().st_size, "sha256": sha256_file(f)}
            if f.suffix == ".parquet":
                import pyarrow.parquet as pq

                meta["rows"] = pq.ParquetFile(f).metadata.num_rows
                meta["schema"] = f.stem
            files[str(f.relative_to(folder))] = meta
        return files


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None
