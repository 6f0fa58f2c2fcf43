"""What a posttrain process skips at start (stages/runtime/startup.py, stages/runtime/http.py)."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHECK = """
import importlib.metadata, sys
import stages
from transformers import AutoModelForCausalLM
import transformers.generation.candidate_generator
from transformers.utils import is_sklearn_available
assert "sklearn" not in sys.modules, "transformers imported scikit-learn"
assert not is_sklearn_available()
importlib.metadata.packages_distributions()
assert importlib.metadata.packages_distributions.cache_info().hits >= 1  # transformers' call was the miss
from sklearn.metrics import roc_curve  # a user's own import still works
print("ok")
"""


def test_transformers_loads_without_scikit_learn_which_stays_importable():
    out = subprocess.run([sys.executable, "-c", CHECK], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_one_http_client_per_process():
    from stages.runtime.http import client

    seen = []
    threads = [threading.Thread(target=lambda: seen.append(client())) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(c is client() for c in seen)


def test_loading_a_config_imports_no_torch():
    """`posttrain validate` and a config error answer without torch (~3 s); so do a data stage and the stage tasks'
    modules (a decorator such as `@torch.no_grad()` at module level would import it)."""
    check = ("import sys\nfrom flows.config import load_config\n"
             "for name in sys.argv[1:]:\n    load_config(name)\n"
             "import tasks.stage_tasks  # every stage's module: the commands that only read (rescore, report) need them\n"
             "assert 'torch' not in sys.modules, 'imported torch'")
    configs = sorted(str(p) for p in (ROOT / "configs").glob("*.yaml"))
    out = subprocess.run([sys.executable, "-c", check, *configs], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
