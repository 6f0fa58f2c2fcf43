"""What the chaos benchmark's modes share (benchmarks/chaos.py, benchmarks/chaos_faults.py): this checkout's
root on sys.path, a run's environment, the processes a kill left behind, and the manifest checks."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tasks.store of this checkout, not of the installed one

from tasks.store import MANIFEST, check_folder  # noqa: E402

NOT_STAGES = {"runs", "mlruns", "prefect", ".locks", ".work", ".verified"}
"""Top-level folders of an artifacts root that hold no stages (.verified: the reuse check's stamps)."""


def env_for(artifacts: Path) -> dict:
    """An ephemeral Prefect and the sqlite MLflow store of this artifacts folder, whatever the shell has set;
    POSTTRAIN_CHAOS marks every process of the run (to find any that outlive a kill)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API", "PREFECT_HOME", "MLFLOW_TRACKING"))}
    return {**env, "PREFECT_HOME": str(artifacts / "prefect"), "POSTTRAIN_CHAOS": str(artifacts)}


def reap_survivors(artifacts: Path) -> list[str]:
    """SIGKILL processes of this run still alive after a kill (their environment names this artifacts folder,
    e.g. ones that left the process group); their command lines."""
    marker, found = f"POSTTRAIN_CHAOS={artifacts}\0".encode(), []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if marker in (proc / "environ").read_bytes():
                found.append((proc / "cmdline").read_bytes().replace(b"\0", b" ")[:200].decode(errors="replace"))
                os.kill(int(proc.name), signal.SIGKILL)
        except OSError:
            pass
    return found


def verify_manifests(artifacts: Path) -> dict:
    """Every manifest's files (size, sha256) and inputs; temp folders; key folders without a manifest."""
    checked, corrupted, dangling = 0, [], []
    for manifest in sorted(artifacts.rglob(MANIFEST)):
        folder = manifest.parent
        if any(part.startswith(".tmp-") for part in folder.relative_to(artifacts).parts):
            continue  # a killed writer's temp folder: never read (counted below)
        checked += 1
        meta, problems = check_folder(folder, full=True)  # the check `posttrain verify` runs
        corrupted += [{"folder": str(folder), "problem": problem} for problem in problems]
        if meta is None:
            continue
        dangling += [{"folder": str(folder), "input": name, "ref": ref} for name, ref in meta.get("inputs", {}).items()
                     if ".tmp-" in ref or not (artifacts / ref / MANIFEST).is_file()]
    keyed = [f for stage in artifacts.iterdir() if stage.is_dir() and stage.name not in NOT_STAGES
             for f in (stage.glob("*/*") if stage.name == "data" else stage.iterdir())]
    return {"manifests_checked": checked, "corrupted": corrupted, "dangling_inputs": dangling,
            "stale_temp_folders": sum(t.is_dir() for t in artifacts.rglob(".tmp-*")),
            "key_folders_without_manifest": [str(f.relative_to(artifacts)) for f in keyed if f.is_dir()
                                             and not f.name.startswith(".") and not (f / MANIFEST).is_file()]}
