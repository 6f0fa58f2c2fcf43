"""`posttrain verify`: check every artifact folder against its manifest, sha256 included.

  posttrain verify [--artifacts artifacts] [--stage STAGE] [--repair]

Runs check sizes and sha256 before reusing a folder, but hash only files changed since they last matched
(tasks/store.py); this reads every byte of every file. A damaged folder (a file missing, truncated or
changed, or its manifest missing or unreadable) is listed with what is wrong; `--repair` moves it to
`<stage>/.damaged/<key>-<time>/` (kept for inspection, never read), so the next run recomputes that
stage alone. Exit code 0: all intact (or all damaged ones moved); 1: damage found and left in place.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tasks.store import ArtifactStore, check_folder, set_aside


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--artifacts", default="artifacts", help="artifacts folder (default: artifacts)")
    parser.add_argument("--stage", default=None, help="only this stage's folders (e.g. rollout)")
    parser.add_argument("--repair", action="store_true",
                        help="move damaged folders aside so the next run recomputes those stages")
    return parser


def damaged_folders(store: ArtifactStore, stage: str | None = None) -> tuple[int, list[tuple[Path, list[str]]]]:
    """(folders checked, [(damaged folder, its problems)]), every file hashed; a key folder without a valid
    manifest is damaged too (a run would recompute it)."""
    checked, damaged = 0, []
    for folder_stage, _, folder in store.key_folders():
        if stage and folder_stage != stage:
            continue
        checked += 1
        _, problems = check_folder(folder, full=True)
        if problems:
            damaged.append((folder, problems))
    return checked, damaged


def verify_command(args) -> int:
    store = ArtifactStore(args.artifacts)
    if not store.root.is_dir():
        print(f"error: {store.root} is not a folder", file=sys.stderr)
        return 2
    checked, damaged = damaged_folders(store, args.stage)
    for folder, problems in damaged:
        print(f"damaged: {folder.relative_to(store.root)}: {'; '.join(problems)}")
        if args.repair:
            print(f"  moved to {set_aside(folder).relative_to(store.root)}; the next run recomputes it")
    print(f"{checked} artifact folders checked, {len(damaged)} damaged"
          + ("" if not damaged or args.repair else " (--repair moves them aside so the next run recomputes them)"))
    return 1 if damaged and not args.repair else 0
