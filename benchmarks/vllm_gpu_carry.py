"""Pack CUDA vLLM for a lent GPU machine in parts that each fit one device call (issue 26, goal 3).

  python3 benchmarks/vllm_gpu_carry.py [--parts-mb 60]        # ~30 s here: downloads ~350 MB from PyPI

The lent machines (Python 3.12, torch 2.11.0+cu130, no package index) can receive 64 MiB per call, the working
tree included. vLLM 0.26.0 is the newest release that pins their torch (0.27.1+ pin 2.13.0); its wheel is
304 MB. This script

1. downloads the Python 3.12 wheels named in benchmarks/vllm_gpu_wheels.txt (vllm and the packages it needs
   that the machine's image lacks);
2. slims vLLM's wheel to what a dense model on a Hopper GPU loads: without FlashAttention 2's kernels (Hopper
   runs FlashAttention 3, which stays), the MoE kernels, the Rust frontend binary and deep_gemm's builds for
   other Pythons (their RECORD lines go too). vLLM imports each of these only where it is present;
3. tars the wheels and splits the tar into parts of at most --parts-mb MB, one per git-ignored folder
   `.vllm-carry-N/` (with a manifest: the tar's sha256 and the number of parts).

Then one device call per part, back to back (a machine stays warm 30 s after a call, and a cold one has lost
what the calls before it left in /tmp):

  run(command="bash benchmarks/gpu_vllm_lease.sh stash", carry=[".vllm-carry-1"])      # and so on, then
  run(command="bash benchmarks/gpu_vllm_lease.sh", carry=[".vllm-carry-N", ".whl"], timeout_s=600)
  run(command="bash benchmarks/gpu_vllm_lease.sh rounds", timeout_s=600)

(the part-N call stashes its part too, then assembles, installs and times generation; the last call the GRPO
rounds against TRL's: benchmarks/gpu_vllm_lease.sh).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHEEL_LIST = ROOT / "benchmarks" / "vllm_gpu_wheels.txt"
# pip matches a manylinux tag's glibc version exactly: name every one these wheels use.
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34, 35)] + ["manylinux2014_x86_64",
                                                                                  "manylinux1_x86_64"]
# Members of vLLM's wheel a dense model on an H100/H200 never loads (each import is guarded by vLLM).
DROPPED = re.compile(r"vllm/(vllm_flash_attn/_vllm_fa2_C\.abi3\.so|_moe_C_stable_libtorch\.abi3\.so|vllm-rs"
                     r"|third_party/deep_gemm/_C\.cpython-3(10|11|13|14)-x86_64-linux-gnu\.so)$")


def download(folder: Path) -> None:
    """The wheels of WHEEL_LIST for CPython 3.12 on x86-64 Linux, without their dependencies (the list is
    the whole set)."""
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
               "--python-version", "3.12", "--implementation", "cp", "-d", str(folder), "-r", str(WHEEL_LIST)]
    for platform in PLATFORMS:
        command += ["--platform", platform]
    subprocess.run(command, check=True)


def slim_vllm(wheel: Path) -> tuple[int, int]:
    """Rewrite vLLM's wheel in place without the DROPPED members and their RECORD lines: (bytes before, after)."""
    before = wheel.stat().st_size
    slim = wheel.with_suffix(".slim")
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(slim, "w", zipfile.ZIP_DEFLATED) as target:
        for info in source.infolist():
            if DROPPED.search(info.filename):
                continue
            data = source.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                data = "".join(line for line in data.decode().splitlines(keepends=True)
                               if not DROPPED.search(line.split(",")[0])).encode()
            target.writestr(info, data, compress_type=info.compress_type)
    slim.replace(wheel)
    return before, wheel.stat().st_size


def split_into_parts(tar: Path, part_bytes: int, out_root: Path) -> list[Path]:
    """`tar` cut into `.vllm-carry-N/part` files of at most part_bytes each, each folder with the manifest."""
    for old in out_root.glob(".vllm-carry-*"):
        shutil.rmtree(old)
    digest = hashlib.sha256(tar.read_bytes()).hexdigest()
    size = tar.stat().st_size
    count = -(-size // part_bytes)
    folders = []
    with tar.open("rb") as source:
        for index in range(1, count + 1):
            folder = out_root / f".vllm-carry-{index}"
            folder.mkdir()
            (folder / f"part-{index:02d}").write_bytes(source.read(part_bytes))
            (folder / "manifest.json").write_text(json.dumps({"sha256": digest, "parts": count, "bytes": size}))
            folders.append(folder)
    return folders


def ignore_carry_folders(repo: Path) -> None:
    """Add `/.vllm-carry-*/` to .git/info/exclude (once): the parts must not be committed, and only ignored
    paths can be carried."""
    exclude = repo / ".git" / "info" / "exclude"
    if not (repo / ".git").is_dir():
        return
    exclude.parent.mkdir(parents=True, exist_ok=True)
    text = exclude.read_text() if exclude.exists() else ""
    if "/.vllm-carry-*/" not in text.splitlines():
        exclude.write_text(text + ("" if text.endswith("\n") or not text else "\n") + "/.vllm-carry-*/\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts-mb", type=float, default=60.0,
                        help="largest part in MB (a call carries 64 MiB = 67.1 MB with the working tree)")
    parser.add_argument("--work", type=Path, default=ROOT / "artifacts" / "vllm-gpu-carry",
                        help="where the wheels are downloaded and the tar is made")
    args = parser.parse_args()

    wheels = args.work / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    download(wheels)
    [vllm_wheel] = sorted(wheels.glob("vllm-*.whl"))
    before, after = slim_vllm(vllm_wheel)
    print(f"{vllm_wheel.name}: {before / 1e6:.1f} MB -> {after / 1e6:.1f} MB")
    tar = args.work / "vllm-wheels.tar"
    with tarfile.open(tar, "w") as out:
        for wheel in sorted(wheels.glob("*.whl")):
            out.add(wheel, arcname=f"vllm-wheels/{wheel.name}")
    folders = split_into_parts(tar, int(args.parts_mb * 1e6), ROOT)
    ignore_carry_folders(ROOT)
    print(f"{len(list(wheels.glob('*.whl')))} wheels, {tar.stat().st_size / 1e6:.1f} MB in {len(folders)} parts:")
    for folder in folders:
        print(f"  {folder.name}: {sum(f.stat().st_size for f in folder.iterdir()) / 1e6:.1f} MB")
    print("device calls, back to back (benchmarks/gpu_vllm_lease.sh):")
    for folder in folders[:-1]:
        print(f'  run(command="bash benchmarks/gpu_vllm_lease.sh stash", carry=["{folder.name}"])')
    print(f'  run(command="bash benchmarks/gpu_vllm_lease.sh", carry=["{folders[-1].name}", ".whl"], timeout_s=600)')
    print('  run(command="bash benchmarks/gpu_vllm_lease.sh rounds", timeout_s=600)')


if __name__ == "__main__":
    main()
