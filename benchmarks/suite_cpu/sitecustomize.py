"""Where the test suite's CPU goes, by process: with this folder on PYTHONPATH and PROC_LOG_DIR set, every Python
process (pytest's workers, `posttrain` runs, torchrun ranks, Ray workers, Prefect and vLLM servers, forked children)
writes its argv, the test it was started under (PYTEST_CURRENT_TEST, inherited from the pytest worker) and its CPU
seconds so far to PROC_LOG_DIR every 2 s. A process that lives under 2 s records ~0, and up to the last 2 s of each
process are lost: the totals are lower bounds. Read them with report.py (its docstring has the command)."""

import json
import os
import sys
import threading
import time

_DIR = os.environ.get("PROC_LOG_DIR")


def _record() -> None:
    if not _DIR:
        return
    info = {"pid": os.getpid(), "ppid": os.getppid(), "argv": list(getattr(sys, "argv", []))[:6],
            "test": os.environ.get("PYTEST_CURRENT_TEST"), "t0": time.time()}
    path = os.path.join(_DIR, f"{os.getpid()}-{int(time.time() * 1000)}.json")

    def loop() -> None:
        while True:
            try:
                times = os.times()
                info.update(cpu=times.user + times.system, last=time.time(),
                            argv=info["argv"] or list(getattr(sys, "argv", []))[:6])
                with open(path + ".tmp", "w") as f:
                    json.dump(info, f)
                os.replace(path + ".tmp", path)
            except Exception:  # a full disk or a removed folder must not break the process measured
                pass
            time.sleep(2.0)

    threading.Thread(target=loop, daemon=True, name="suite-cpu-recorder").start()


_record()
os.register_at_fork(after_in_child=_record)  # multiprocessing's forked children (vLLM's engine core, ...)
