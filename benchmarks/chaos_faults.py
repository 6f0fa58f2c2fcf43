"""Faults (chaos.py --faults): every probe of issue 42's "Why" list re-run as a new user or a faulty machine would,
each on the tiny config of tests/conftest.py (`tiny_config_text`), with the acceptance checks of the issue.

  nice -n 10 .venv/bin/python benchmarks/chaos.py --faults [--probe NAME ...] [--work DIR] [--out PATH]
  nice -n 10 .venv/bin/python benchmarks/chaos.py --faults --list

Each probe is a few `posttrain` commands (`python -m flows.cli` of this checkout) in its own folder under --work;
probes that need a cached run start from a copy of warm/artifacts' stage folders (one uninterrupted tiny run,
made once per --work; its MLflow and Prefect stores are not copied). A probe's checks are rows of the table:

  exit code   2 for bad input (config, data, reward function, a full disk), 130/143 for SIGINT/SIGTERM, 0 where
              the run goes on (transform.on_bad_rows: drop, score.reward_on_invalid, a damaged cache folder)
  message     the last stderr line (the "(the run is recorded as failed ...)" hint left out) names the function,
              file, row or path; no "Traceback" anywhere in the output
  rerun       after the fault is removed (the reward fixed, a bigger disk, a resume after a signal) the next run
              completes: nothing cached trips it (a failed score round leaves no score artifact)

A probe whose feature is not in this checkout yet reports "not built" (found by what its code says, e.g. the
reward server's --max-request-mb), a probe the machine cannot run (no vLLM, mount not allowed) "skipped".
Probes: see PROBES (or --list). A tmpfs probe mounts and unmounts small tmpfs folders (root only).
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import re
import shlex
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

import yaml

from chaos_common import ROOT, env_for, reap_survivors, verify_manifests

EXPERIMENT = "test-tiny"
PREPARE_STAGES = ("demo_data", "transform", "base_model", "sft", "eval")
"""Stage folders a probe that starts at the rounds copies from warm/ (eval: the base model's eval; the rounds'
and the final evals have other keys)."""
HINT = "(the run is recorded as failed"
"""The line posttrain prints after an error's one line (flows/launch.py report_errors): not the message."""
RUN_TIMEOUT_S = 1200


def tiny_config() -> dict:
    """tests/conftest.py `tiny_config_text` as a dict (read from its source, so the two stay the same)."""
    source = (ROOT / "tests" / "conftest.py").read_text()
    body = re.search(r'def tiny_config_text\(.*?\):\n.*?return f"""(.*?)"""', source, re.S).group(1)
    body = body.replace("{tmp_path / 'artifacts'}", "artifacts").replace("{{", "{").replace("}}", "}")
    return yaml.safe_load(body)


def merged(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        out[key] = merged(out.get(key) or {}, value) if isinstance(value, dict) else value
    return out


# --- running posttrain ---------------------------------------------------------------------------------------

@dataclass
class Ran:
    code: int | None
    out: str  # stdout and stderr
    err: str
    wall_s: float

    @property
    def message(self) -> str:
        """The last stderr line, the "recorded as failed" hint left out."""
        lines = [line for line in self.err.splitlines() if line.strip() and not line.startswith(HINT)]
        return lines[-1].strip() if lines else ""

    @property
    def traceback(self) -> bool:
        return "Traceback" in self.out


def launch(args: list[str], artifacts: Path, log: Path, env: dict | None = None) -> tuple[subprocess.Popen, list]:
    """`posttrain ARGS` from this checkout in its own process group; stdout and stderr to log.out / log.err."""
    log.parent.mkdir(parents=True, exist_ok=True)
    files = [open(log.with_suffix(".out"), "w"), open(log.with_suffix(".err"), "w")]
    process = subprocess.Popen([sys.executable, "-m", "flows.cli", *args], cwd=ROOT,
                               env={**env_for(artifacts), **(env or {})}, stdout=files[0], stderr=files[1],
                               start_new_session=True)
    return process, files


def finish(process: subprocess.Popen, files: list, log: Path, began: float, timeout: float = RUN_TIMEOUT_S) -> Ran:
    """Wait for a launched command (SIGKILL of its group past `timeout`: code None); what it printed."""
    try:
        code = process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        code = None
    for f in files:
        f.close()
    out, err = (log.with_suffix(s).read_text(errors="replace") for s in (".out", ".err"))
    return Ran(code, out + err, err, round(time.perf_counter() - began, 1))


def posttrain(args: list[str], artifacts: Path, log: Path, env: dict | None = None,
              timeout: float = RUN_TIMEOUT_S) -> Ran:
    began = time.perf_counter()
    process, files = launch(args, artifacts, log, env)
    return finish(process, files, log, began, timeout)


def run_args(config: Path, *overrides: str) -> list[str]:
    return ["run", str(config), "--quiet", *overrides]


# --- checks ------------------------------------------------------------------------------------------------------

class Probe:
    """One probe's folder, config and table rows."""

    def __init__(self, name: str, work: Path):
        self.name, self.dir, self.rows = name, work / name, []
        if self.dir.exists():
            shutil.rmtree(self.dir)
        self.dir.mkdir(parents=True)
        self.artifacts = self.dir / "artifacts"
        self.runs = 0

    def config(self, extra: dict | None = None, name: str = "tiny.yaml", artifacts: Path | None = None) -> Path:
        path = self.dir / name
        cfg = merged(tiny_config(), {"artifacts_dir": str(artifacts or self.artifacts), **(extra or {})})
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        return path

    def log(self, what: str) -> Path:
        self.runs += 1
        return self.dir / "logs" / f"{self.runs:02d}-{what}"

    def env(self, extra: dict | None = None) -> dict:
        """The probe's folder on PYTHONPATH, as README's examples put a user's reward module (`posttrain` started
        as a console script has neither the config's folder nor the cwd on sys.path)."""
        extra = dict(extra or {})
        return {**extra, "PYTHONPATH": os.pathsep.join(filter(None, [extra.get("PYTHONPATH"), str(self.dir)]))}

    def posttrain(self, args: list[str], what: str, env: dict | None = None, artifacts: Path | None = None,
                  timeout: float = RUN_TIMEOUT_S) -> Ran:
        return posttrain(args, artifacts or self.artifacts, self.log(what), self.env(env), timeout)

    def row(self, check: str, expected: str, got: str, ok: bool | str) -> None:
        status = ok if isinstance(ok, str) else "pass" if ok else "FAIL"
        got = " | ".join(line.strip() for line in got.strip().splitlines())
        self.rows.append({"probe": self.name, "check": check, "expected": expected, "got": got[:400],
                          "status": status, "folder": str(self.dir)})
        print(f"  [{status}] {self.name}: {check}: {got[:200]}", flush=True)

    def error_row(self, check: str, ran: Ran, names: list[str], code: int = 2) -> bool:
        """exit `code`, the message names every one of `names` (case-insensitive), no traceback."""
        missing = [n for n in names if n.lower() not in ran.message.lower()]
        ok = ran.code == code and not missing and not ran.traceback
        got = (f"exit {ran.code}{', Traceback printed' if ran.traceback else ''}"
               f"{', message lacks ' + ', '.join(map(repr, missing)) if missing else ''}: {ran.message}")
        self.row(check, f"exit {code}, one line naming {', '.join(names)}, no traceback", got, ok)
        return ok

    def completes_row(self, check: str, ran: Ran, expected: str = "exit 0, no traceback") -> bool:
        ok = ran.code == 0 and not ran.traceback
        got = f"exit {ran.code}{', Traceback printed' if ran.traceback else ''} ({ran.wall_s} s)"
        self.row(check, expected, got if ok else f"{got}: {ran.message}", ok)
        return ok


def not_built(path: str, marker: str) -> bool:
    """Whether this checkout's `path` lacks `marker` (the feature a probe needs has not landed)."""
    file = ROOT / path
    return not file.is_file() or marker not in file.read_text()


def sha256s(folder: Path) -> dict[str, str]:
    manifest = json.loads((folder / "_manifest.json").read_text())
    return {name: meta["sha256"] for name, meta in manifest["files"].items()
            if Path(name).name not in ("README.md", "adapter_config.json")}


def stage_folders(root: Path, stage: str) -> list[Path]:
    return sorted(p.parent for p in (root / stage).glob("*/_manifest.json"))


def parent_run_ids(db: Path) -> list[str]:
    """MLflow parent run ids in the sqlite store `db`, oldest first."""
    try:
        with closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)) as con:
            return [r[0] for r in con.execute(
                "SELECT r.run_uuid FROM runs r WHERE NOT EXISTS (SELECT 1 FROM tags t WHERE t.run_uuid = r.run_uuid "
                "AND t.key = 'mlflow.parentRunId') ORDER BY r.start_time")]
    except sqlite3.Error:
        return []


# --- the warm run -----------------------------------------------------------------------------------------------

class Warm:
    """One uninterrupted tiny run under work/warm (made on first use, kept in --work): its stage folders are the
    cache a probe starts from, its export the bytes a resumed run must end with."""

    def __init__(self, work: Path):
        self.dir, self.root = work / "warm", work / "warm" / "artifacts"
        self.failed: str | None = None

    def ready(self) -> bool:
        """Whether the warm run is there for this checkout's commit (made now if not)."""
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        done = self.dir / "done.json"
        if self.failed or (done.is_file() and json.loads(done.read_text()).get("commit") == commit):
            return not self.failed
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir.mkdir(parents=True)
        config = self.dir / "tiny.yaml"
        config.write_text(yaml.safe_dump(merged(tiny_config(), {"artifacts_dir": str(self.root)}), sort_keys=False))
        print("warm: an uninterrupted tiny run (the cache probes start from) ...", flush=True)
        ran = posttrain(run_args(config), self.root, self.dir / "logs" / "warm")
        if ran.code != 0:
            self.failed = f"the warm tiny run failed (exit {ran.code}): {ran.message}"
            return False
        done.write_text(json.dumps({"wall_s": ran.wall_s, "commit": commit}))
        return True

    def copy(self, dest: Path, stages: tuple[str, ...] | None = None) -> None:
        """The warm run's stage folders (all, or `stages`) and their .locks entries into `dest`, as a run leaves
        them, without its MLflow and Prefect stores."""
        dest.mkdir(parents=True, exist_ok=True)
        for folder in self.root.iterdir():
            if folder.is_dir() and not folder.name.startswith(".") and folder.name not in (
                    "runs", "mlruns", "prefect") and (stages is None or folder.name in stages):
                shutil.copytree(folder, dest / folder.name)
                if (self.root / ".locks" / folder.name).is_dir():
                    shutil.copytree(self.root / ".locks" / folder.name, dest / ".locks" / folder.name)

    def export(self) -> Path:
        return stage_folders(self.root, "export")[0]


def needs_warm(probe: Probe, warm: Warm) -> bool:
    if warm.ready():
        return True
    probe.row("warm run", "exit 0", warm.failed, "FAIL")
    return False


# --- probes ------------------------------------------------------------------------------------------------------

def probe_vllm_prefetch(p: Probe, warm: Warm) -> None:
    """Item 1: vLLM + async prefetch with an eval after every round completes, and reruns from cache."""
    try:
        import vllm  # noqa: F401
    except Exception as e:
        return p.row("run", "exit 0", f"vLLM not importable here ({type(e).__name__})", "skipped")
    if not needs_warm(p, warm):
        return
    warm.copy(p.artifacts, PREPARE_STAGES)
    overrides = ["rollout.engine=vllm", "rollout.async_prefetch=true", "eval.every_rounds=1", "grpo.rounds=4",
                 "rollout.vllm.kv_cache_space_gib=0.25"]
    config = p.config()
    if p.completes_row("run (4 rounds, eval every round)", p.posttrain(run_args(config, *overrides), "run")):
        p.completes_row("cached rerun", p.posttrain(run_args(config, *overrides), "rerun"))


REWARDS = {"nan": "float('nan')", "inf": "float('inf')", "none": "None"}
FIXED = "len(str(c)) % 3 / 2"  # not constant: a constant reward trips the zero-std health check


def reward_module(folder: Path, value: str) -> None:
    (folder / "faulty_rewards.py").write_text(
        f"def graded(prompts, completions, **kwargs):\n    return [{value} for c in completions]\n")


def probe_reward(kind: str):
    def probe(p: Probe, warm: Warm) -> None:
        """Item 2: a reward of NaN, inf or None for every sample stops score naming the function, writes no score
        artifact; fixed (or with score.reward_on_invalid) the run completes."""
        if not needs_warm(p, warm):
            return
        warm.copy(p.artifacts, PREPARE_STAGES)
        reward_module(p.dir, REWARDS[kind])
        config = p.config({"score": {"reward_funcs": ["faulty_rewards.graded"]}})
        p.error_row("run", p.posttrain(run_args(config), "run"), ["graded"])
        written = stage_folders(p.artifacts, "score")
        p.row("no score artifact cached", "no score/<key>/ with a manifest", f"{len(written)} written", not written)
        if kind == "none":
            p.completes_row("run with score.reward_on_invalid=0",
                            p.posttrain(run_args(config, "score.reward_on_invalid=0"), "on-invalid"),
                            "exit 0 (recorded, with a warning)")
        else:
            reward_module(p.dir, FIXED)
            p.completes_row("rerun with the function fixed", p.posttrain(run_args(config), "fixed"))
    return probe


def flip_bytes(path: Path) -> None:
    """Same-size damage: 16 bytes in the middle of the file inverted (mtime kept)."""
    stat, data = path.stat(), bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 16] = bytes(b ^ 0xFF for b in data[middle:middle + 16])
    path.write_bytes(bytes(data))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def probe_damaged(stage: str, file: str):
    def probe(p: Probe, warm: Warm) -> None:
        """Item 3: a same-size byte flip in a cached file: the rerun recomputes that stage with a warning naming the
        file, and completes."""
        if not_built("tasks/store.py", ".damaged"):
            return p.row("rerun", "recomputed with a warning", "sha256 reuse check not in this checkout", "not built")
        if not needs_warm(p, warm):
            return
        warm.copy(p.artifacts)
        target = stage_folders(p.artifacts, stage)[0] / file
        flip_bytes(target)
        ran = p.posttrain(run_args(p.config()), "rerun")
        warned = [line.strip() for line in ran.out.splitlines() if "damaged" in line and file in line]
        p.completes_row("rerun completes", ran)
        p.row("warning names the file", f"a warning naming {stage}/<key>/{file}", warned[0] if warned else
              "no warning naming it", bool(warned))
        want = sha256s(stage_folders(warm.root, stage)[0])[file]
        recomputed = (target.parent / "_manifest.json").is_file() and sha256s(target.parent).get(file) == want \
            and hashlib.sha256(target.read_bytes()).hexdigest() == want
        aside = list((p.artifacts / stage / ".damaged").glob("*"))
        p.row("recomputed", f"{stage} rewritten (intact), damaged folder set aside",
              f"intact: {bool(recomputed)}, set aside: {len(aside)}", bool(recomputed) and bool(aside))
    return probe


def probe_verify_lost_manifest(p: Probe, warm: Warm) -> None:
    """Item 3: `posttrain verify` reports a key folder whose manifest was deleted."""
    if not needs_warm(p, warm):
        return
    warm.copy(p.artifacts)
    folder = stage_folders(p.artifacts, "sft")[0]
    (folder / "_manifest.json").unlink()
    name = str(folder.relative_to(p.artifacts))
    ran = p.posttrain(["verify", "--artifacts", str(p.artifacts)], "verify")
    named = [line for line in ran.out.splitlines() if name in line]
    p.row("verify", f"exit 1, a line naming {name}", f"exit {ran.code}: {named[0] if named else ran.out[-200:]}",
          ran.code == 1 and bool(named) and not ran.traceback)


def question_rows(n: int, seed: int = 0) -> list[dict]:
    import random

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        numbers = [rng.randint(0, 9) for _ in range(5)]
        rows.append({"question": f"Which is the largest of {', '.join(map(str, numbers))}?",
                     "answer": str(max(numbers))})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def data_config(p: Probe, train: Path) -> Path:
    """The tiny config reading `train` and an eval file of its own (transform.paths: no demo data, so no SFT warm
    start: sft.split's rows do not exist)."""
    evals = write_jsonl(p.dir / "eval.jsonl", question_rows(24, seed=1))
    return p.config({"transform": {"paths": {"train": str(train), "eval": str(evals)}}, "sft": {"enabled": False}})


def probe_jsonl_not_utf8(p: Probe, warm: Warm) -> None:
    """Item 4: a line that is not UTF-8 is a bad row naming file and line; under drop the run goes on."""
    train = write_jsonl(p.dir / "train.jsonl", question_rows(64))
    lines = train.read_bytes().split(b"\n")
    lines[2] = lines[2].replace(b"largest", b"largest \xff\xfe")
    train.write_bytes(b"\n".join(lines))
    config = data_config(p, train)
    p.error_row("run", p.posttrain(run_args(config), "run"), [str(train), ":3", "UTF-8"])
    ran = p.posttrain(run_args(config, "transform.on_bad_rows=drop"), "drop")
    p.completes_row("run with transform.on_bad_rows=drop", ran)
    dropped = [line.strip() for line in ran.out.splitlines() if "dropped 1 bad row" in line]
    p.row("drop announced", "a warning: dropped 1 bad row", dropped[0] if dropped else "none", bool(dropped))


def probe_jsonl_array(p: Probe, warm: Warm) -> None:
    """Item 4: a JSON array in a .jsonl file is "not JSON Lines" naming the file, under drop too."""
    train = p.dir / "train.jsonl"
    train.write_text(json.dumps(question_rows(64), indent=2))
    config = data_config(p, train)
    for label, overrides in (("run", []), ("run with drop", ["transform.on_bad_rows=drop"])):
        p.error_row(label, p.posttrain(run_args(config, *overrides), label.replace(" ", "-")),
                    [str(train), "not JSON Lines"])


def probe_prompt_too_long(p: Probe, warm: Warm) -> None:
    """Item 6: a prompt far longer than the model's context stops round 0 naming the row; dropped under drop once
    that lands."""
    rows = question_rows(64)
    rows[5] = {"question": "Which is the largest of " + ", ".join("7" for _ in range(6667)) + "?", "answer": "7"}
    train = write_jsonl(p.dir / "train.jsonl", rows)  # row 5: 20,000 characters
    config = data_config(p, train)
    p.error_row("run", p.posttrain(run_args(config), "run"), ["row 5", str(p.artifacts / "transform")])
    ran = p.posttrain(run_args(config, "transform.on_bad_rows=drop"), "drop")
    if ran.code == 2 and "more than the model's context" in ran.message:
        return p.row("run with transform.on_bad_rows=drop", "exit 0, the row dropped",
                     f"exit 2, still refused: {ran.message}", "not built")
    p.completes_row("run with transform.on_bad_rows=drop", ran, "exit 0, the row dropped")
    left_out = [line.strip() for line in ran.out.splitlines() if "left out 1 prompt" in line]
    p.row("drop announced", "a warning: rollout left out 1 prompt", left_out[0] if left_out else "none",
          bool(left_out))


def mount_tmpfs(folder: Path, mb: int) -> str | None:
    """Mount a tmpfs of `mb` MiB at `folder`; None, or why not."""
    folder.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mb}m", "tmpfs", str(folder)], capture_output=True,
                          text=True)
    return None if done.returncode == 0 else (done.stderr.strip() or f"mount exit {done.returncode}")


def fill(disk: Path, leave: int = 0) -> Path:
    """Write a file until `disk` is full, then give `leave` bytes back (tmpfs frees whole pages)."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        for block in (1 << 16, 4096, 512):
            try:
                while True:
                    os.write(fd, b"x" * block)
            except OSError:
                pass
        if leave:
            os.ftruncate(fd, max(0, os.fstat(fd).st_size - leave))
    finally:
        os.close(fd)
    return filler


def pages(size: int) -> int:
    return -(-size // 4096) * 4096


def probe_disk_full(where: str):
    def probe(p: Probe, warm: Warm) -> None:
        """Item 5: a disk that fills during a write: one line naming the path, exit 2; resumed on a bigger disk,
        the run completes with intact artifacts. model: base_model's folder a tmpfs with room for its small files
        but not for model.safetensors; mlflow: MLflow's sqlite store on a tmpfs filled once base_model starts."""
        if not_built("tasks/store.py", "StorageError"):
            return p.row("run", "exit 2", "StorageError not in this checkout", "not built")
        if not needs_warm(p, warm):
            return
        env, db = {}, p.artifacts / "mlflow.db"
        if where == "model":
            disk = p.artifacts / "base_model"
            files = {f.name: f.stat().st_size for f in stage_folders(warm.root, "base_model")[0].iterdir()}
            small = sum(pages(n) for name, n in files.items() if name != "model.safetensors") + 3 * 4096
            assert files["model.safetensors"] > small + 8192, files  # else the room left is not a model's
        else:
            disk, db = p.dir / "mlflow-disk", p.dir / "mlflow-disk" / "mlflow.db"
            env = {"MLFLOW_TRACKING_URI": f"sqlite:///{db}"}
        refused = mount_tmpfs(disk, 8)
        if refused:
            return p.row("run", "exit 2 naming the path", f"cannot mount a tmpfs: {refused}", "skipped")
        try:
            if where == "model":
                fill(disk, leave=small)
            else:  # the experiment made here, its artifact root beside the run's artifacts (not the cwd's mlruns/)
                from mlflow import MlflowClient

                MlflowClient(env["MLFLOW_TRACKING_URI"]).create_experiment(
                    EXPERIMENT, artifact_location=(p.artifacts / "mlruns").as_uri())
            config, log, began = p.config(), p.log("run"), time.perf_counter()
            process, handles = launch(run_args(config), p.artifacts, log, p.env(env))
            if where == "mlflow":
                while process.poll() is None and not list(p.artifacts.glob("base_model/.tmp-*")):
                    time.sleep(0.01)  # the run is open: the next MLflow write finds the disk full
                fill(disk)
            ran = finish(process, handles, log, began)
            p.error_row(f"run ({where} write on a full disk)", ran, [str(disk), "space"])
            subprocess.run(["mount", "-o", "remount,size=512m", str(disk)], check=True)
            ids = parent_run_ids(db)
            if not ids:
                return p.row("resume on a bigger disk", "exit 0", "no parent run in the MLflow store", False)
            resumed = p.posttrain(["resume", ids[-1], "--artifacts", str(p.artifacts), "--quiet"], "resume", env)
            p.completes_row("resume on a bigger disk", resumed)
            checked = verify_manifests(p.artifacts)
            bad = len(checked["corrupted"]) + len(checked["dangling_inputs"])
            p.row("artifacts intact", "no corrupted manifest or dangling input",
                  f"{checked['manifests_checked']} checked, {bad} bad", bad == 0 and checked["manifests_checked"] > 0)
        finally:
            subprocess.run(["umount", "-l", str(disk)], capture_output=True)
    return probe


def free_port() -> int:
    with closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(port: int, path: str, body: bytes, timeout: float = 120) -> tuple[int, bytes, str]:
    """(status, reply body, how the send ended) of a POST sent in 64 KiB pieces; a server that answers before it
    has read the whole body (a 413 judged by Content-Length) may close the connection under the sender: the
    reply is read all the same."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    sent = "sent whole"
    try:
        connection.putrequest("POST", path)
        connection.putheader("Content-Type", "application/json")
        connection.putheader("Content-Length", str(len(body)))
        connection.endheaders()
        try:
            for i in range(0, len(body), 1 << 16):
                connection.send(body[i:i + (1 << 16)])
        except OSError as e:
            sent = f"send cut after {i >> 20} MB ({type(e).__name__})"
        try:
            reply = connection.getresponse()
            return reply.status, reply.read(), sent
        except (OSError, http.client.HTTPException) as e:
            return -1, f"{type(e).__name__}: {e}".encode(), sent
    finally:
        connection.close()


def verify_request(text: str, answer: str = "7", **extra) -> dict:
    return {"responses_create_params": {"input": [{"role": "user", "content": "Which is the largest of 7, 3?"}]},
            "response": {"output": [{"type": "message", "role": "assistant",
                                     "content": [{"type": "output_text", "text": text}]}]},
            "answer": answer, **extra}


def probe_serve_rewards(p: Probe, warm: Warm) -> None:
    """Item 7: the reward server answers a 20+ MB request 413, a malformed response.output 422 (no traceback),
    and a good one with the scores only (the request not echoed)."""
    if not_built("flows/serve_rewards.py", "max-request-mb"):
        for check in ("21 MB request", "malformed response.output", "reply without the echoed body"):
            p.row(check, "413 / 422 / scores only", "--max-request-mb not in flows/serve_rewards.py", "not built")
        return
    port, config = free_port(), p.config()
    log = p.log("serve")
    process, files = launch(["serve-rewards", str(config), "--port", str(port)], p.artifacts, log)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 300
        while time.time() < deadline and process.poll() is None:
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=5):
                    break
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(1)
        else:
            return p.row("server up", "/health answers", f"server exit {process.poll()}", False)
        big = json.dumps(verify_request("<answer>7</answer>", padding="x" * (21 << 20))).encode()
        code, reply, sent = post(port, "/verify", big)
        p.row("21 MB request", "413", f"{code} ({len(big) >> 20} MB, {sent}): {reply[:160].decode(errors='replace')}",
              code == 413)
        bad = verify_request("7")
        bad["response"]["output"] = "not a list"
        code, reply, _ = post(port, "/verify", json.dumps(bad).encode())
        p.row("malformed response.output", "422 naming response.output",
              f"{code}: {reply[:200].decode(errors='replace')}", code == 422 and b"response.output" in reply)
        code, reply, _ = post(port, "/verify", json.dumps(verify_request("<answer>7</answer>")).encode())
        try:
            keys = sorted(json.loads(reply))
        except ValueError:
            keys = []
        echoed = [k for k in ("responses_create_params", "response", "answer") if k in keys]
        p.row("reply without the echoed body", "200, the scores only", f"{code}, {len(reply)} bytes, keys {keys}",
              code == 200 and not echoed and "reward" in keys)
    finally:
        process.send_signal(signal.SIGINT)
        ran = finish(process, files, log, time.perf_counter(), timeout=30)
    p.row("server log", "no Traceback", "Traceback printed" if ran.traceback else "none", not ran.traceback)


def probe_signal(signum: int):
    def probe(p: Probe, warm: Warm) -> None:
        """Item 8: SIGINT (to the process group, as Ctrl-C) or SIGTERM (to the posttrain process, as `kill`) while
        a round scores: one line "... resume with: ...", exit 128 + the signal, no traceback, no process left; the
        resume it names ends with an export byte-identical to an uninterrupted run's."""
        name = signal.Signals(signum).name
        if not_built("flows/launch.py", "resume with"):
            return p.row(f"{name} mid-round", f"exit {128 + signum}, 'resume with'",
                         "flows/launch.py has no signal handling yet", "not built")
        if not needs_warm(p, warm):
            return
        warm.copy(p.artifacts, PREPARE_STAGES)
        config, log, began = p.config(), p.log("run"), time.perf_counter()
        process, files = launch(run_args(config), p.artifacts, log, p.env())
        while process.poll() is None and not list(p.artifacts.glob("score/.tmp-*")):
            time.sleep(0.05)
        time.sleep(0.5)  # the reward workers are scoring
        if process.poll() is not None:
            ran = finish(process, files, log, began)
            return p.row(f"{name} mid-round", "stopped", f"ended (exit {ran.code}) before score started", False)
        if signum == signal.SIGINT:
            os.killpg(process.pid, signum)
        else:
            os.kill(process.pid, signum)
        ran = finish(process, files, log, began, timeout=180)
        time.sleep(2)
        survivors = reap_survivors(p.artifacts)
        p.error_row(f"{name} mid-round", ran, ["resume with"], code=128 + signum)
        eof = "EOFError" in ran.out
        p.row("workers quiet, none left", "no EOFError, no surviving process",
              f"EOFError: {eof}, survivors: {len(survivors)} {survivors[:2]}", not eof and not survivors)
        command = ran.message.split("resume with:", 1)[-1].strip()
        if not command.startswith("posttrain resume"):
            return p.row("resume", "exit 0", f"no resume command in {ran.message!r}", False)
        resumed = p.posttrain([*shlex.split(command)[1:], "--quiet"], "resume")
        if not p.completes_row("resume (the command it printed)", resumed):
            return
        mine, want = stage_folders(p.artifacts, "export"), sha256s(warm.export())
        got = sha256s(mine[0]) if mine else {}
        differ = sorted(n for n in want if got.get(n) != want[n])
        p.row("export byte-identical", "every export file's sha256 = the uninterrupted run's",
              f"{len(want) - len(differ)}/{len(want)} equal" + (f", differ: {differ[:3]}" if differ else ""),
              bool(mine) and not differ)
    return probe


def probe_namespace_library(p: Probe, warm: Warm) -> None:
    """Item 9: a reward module importing, inside its function, a library on PYTHONPATH whose __init__ imports a
    namespace subpackage (no __init__.py): the run completes."""
    if not needs_warm(p, warm):
        return
    lib = p.dir / "lib" / "nsgym"
    (lib / "induction").mkdir(parents=True)
    (lib / "__init__.py").write_text("from nsgym.induction import tasks\n\n\ndef score(text):\n"
                                     "    return tasks.score(text)\n")
    (lib / "induction" / "tasks.py").write_text(f"def score(c):\n    return {FIXED}\n")
    (p.dir / "ns_rewards.py").write_text("def graded(prompts, completions, **kwargs):\n    import nsgym\n\n"
                                         "    return [nsgym.score(c) for c in completions]\n")
    warm.copy(p.artifacts, PREPARE_STAGES)
    config = p.config({"score": {"reward_funcs": ["accuracy", "ns_rewards.graded"]}})
    p.completes_row("run", p.posttrain(run_args(config), "run", {"PYTHONPATH": str(lib.parent)}))


def probe_reward_memory(p: Probe, warm: Warm) -> None:
    """Item 10: a reward function allocating 10 GB under score.reward_memory_mb=2048 is reported like a timeout
    naming the function (the sample gets reward_on_error and an errors entry); the run goes on. The pages touched
    stop at 3 GB (past the cap, whether the OS counts address space or pages), so an unenforced limit shows
    without taking the machine's memory."""
    if not_built("stages/scoring/score.py", "reward_memory_mb"):
        return p.row("10 GB reward", "reported like a timeout, naming the function",
                     "score.reward_memory_mb not in stages/scoring/score.py", "not built")
    if not needs_warm(p, warm):
        return
    warm.copy(p.artifacts, PREPARE_STAGES)
    (p.dir / "hog_rewards.py").write_text(
        "import mmap\n\n\ndef hog(prompts, completions, **kwargs):\n"
        "    # 10 GB, private and lazily backed: as malloc gets a large block (mmap's default, MAP_SHARED, is shmem)\n"
        "    block = mmap.mmap(-1, 10 << 30, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)\n"
        "    for i in range(0, 3 << 30, 4096):  # 3 GB of it touched: past the cap, whatever the OS counts\n"
        "        block[i] = 1\n"
        "    return [1.0 for c in completions]\n")
    # every sample breaches the cap: past score.max_error_rate (issue 44) that stops the run, so it is lifted here
    config = p.config({"score": {"reward_funcs": ["format", "hog_rewards.hog"], "reward_memory_mb": 2048,
                                 "max_error_rate": 1.0}, "grpo": {"rounds": 1}})
    ran = p.posttrain(run_args(config), "run")
    p.completes_row("run goes on", ran)
    import pyarrow.parquet as pq

    errors = [e for folder in stage_folders(p.artifacts, "score")
              for row in pq.read_table(folder / "scored.parquet", columns=["errors"]).to_pylist()
              for e in (row["errors"] or [])]
    named = [e for e in errors if "hog" in e and "memory" in e.lower()]
    p.row("breach recorded per sample", "errors naming hog and memory",
          f"{len(named)}/{len(errors)} such errors" + (f", e.g. {named[0]}" if named else ""), bool(named))


def probe_config_inf(p: Probe, warm: Warm) -> None:
    """Item 10: grpo.learning_rate=inf is a config error naming the key (validate and run)."""
    config = p.config()
    for command in ("validate", "run"):
        p.error_row(command, p.posttrain([command, str(config), "grpo.learning_rate=inf"], command),
                    ["grpo.learning_rate"])


def probe_config_empty(p: Probe, warm: Warm) -> None:
    """Item 10: an empty YAML file is a config error naming it (validate and run)."""
    config = p.dir / "empty.yaml"
    config.write_text("")
    for command in ("validate", "run"):
        p.error_row(command, p.posttrain([command, str(config)], command), [str(config)])


PROBES = {
    "vllm-prefetch": probe_vllm_prefetch,
    "reward-nan": probe_reward("nan"),
    "reward-inf": probe_reward("inf"),
    "reward-none": probe_reward("none"),
    "damaged-safetensors": probe_damaged("base_model", "model.safetensors"),
    "damaged-parquet": probe_damaged("transform", "train.parquet"),
    "verify-lost-manifest": probe_verify_lost_manifest,
    "jsonl-not-utf8": probe_jsonl_not_utf8,
    "jsonl-array": probe_jsonl_array,
    "disk-full-model": probe_disk_full("model"),
    "disk-full-mlflow": probe_disk_full("mlflow"),
    "prompt-too-long": probe_prompt_too_long,
    "serve-rewards": probe_serve_rewards,
    "sigint": probe_signal(signal.SIGINT),
    "sigterm": probe_signal(signal.SIGTERM),
    "namespace-library": probe_namespace_library,
    "reward-memory": probe_reward_memory,
    "config-inf": probe_config_inf,
    "config-empty": probe_config_empty,
}
"""Probe name -> probe(Probe, Warm), in the issue's order (items 1-10)."""


def faults_mode(args, work: Path) -> dict:
    names = args.probe or list(PROBES)
    unknown = [n for n in names if n not in PROBES]
    if unknown:
        sys.exit(f"unknown probe(s) {', '.join(unknown)}; one of: {', '.join(PROBES)}")
    warm, rows, walls = Warm(work), [], {}
    for name in names:
        print(f"probe {name} ...", flush=True)
        probe, began = Probe(name, work), time.perf_counter()
        try:
            PROBES[name](probe, warm)
        except Exception as e:  # the probe's own failure: reported, the others still run
            probe.row("probe", "runs", f"the probe raised {type(e).__name__}: {e}", "FAIL")
        walls[name] = round(time.perf_counter() - began, 1)
        rows += probe.rows
    counts = {status: sum(r["status"] == status for r in rows) for status in ("pass", "FAIL", "not built", "skipped")}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    return {"mode": "faults", "commit": commit.strip(), "probes": names, "counts": counts, "probe_wall_s": walls,
            "rows": rows, "work": str(work)}


def print_faults_table(summary: dict) -> None:
    rows = [(r["probe"], r["check"], r["expected"], r["got"], r["status"]) for r in summary["rows"]]
    head = ("probe", "check", "expected", "got", "ok")
    cut = lambda text, n: text if len(text) <= n else text[:n - 1] + "…"  # noqa: E731
    widths = [max(len(cut(str(row[i]), (60, 160)[i == 3] if i >= 2 else 40)) for row in [head, *rows])
              for i in range(5)]
    for row in [head, *rows]:
        print("  ".join(cut(str(v), (60, 160)[i == 3] if i >= 2 else 40).ljust(widths[i]) for i, v in enumerate(row)))
    print(", ".join(f"{n} {status}" for status, n in summary["counts"].items()) + f" (at {summary['commit']})")


def list_probes() -> None:
    for name, probe in PROBES.items():
        doc = " ".join((probe.__doc__ or "").split())
        print(f"{name:22} {doc.split(': ')[0] if len(doc) > 100 else doc}")

