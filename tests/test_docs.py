"""The docs site (mkdocs.yml, docs/) builds with `mkdocs build --strict`: a broken link or anchor, or a config
field without a docstring (docs/gen_config_reference.py, which generates the config reference from the config
models at build time), fails it. `make docs` serves the same site."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_site_builds_strict(tmp_path):
    mkdocs = Path(sys.executable).with_name("mkdocs")
    run = subprocess.run([str(mkdocs), "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=ROOT,
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    warnings = [line for line in run.stderr.splitlines() if "WARNING" in line or "ERROR" in line]
    assert run.returncode == 0, "\n".join(warnings) or run.stderr[-3000:]
    page = (tmp_path / "site" / "reference" / "config" / "index.html").read_text()
    for option in ("grpo.learning_rate", "rollout.temperature", "score.reward_funcs", "health.max_kl"):
        assert f'id="{option}"' in page, option  # every field has its own anchor


def test_a_field_without_a_docstring_is_a_warning(monkeypatch):
    """What the strict build fails on: with the list of fields that had no docstring when the page was first
    generated emptied, each of them is reported by its dotted path."""
    sys.path.insert(0, str(ROOT / "docs"))
    try:
        import gen_config_reference as reference
    finally:
        sys.path.remove(str(ROOT / "docs"))
    known = set(reference.KNOWN_UNDOCUMENTED)
    monkeypatch.setattr(reference, "KNOWN_UNDOCUMENTED", set())
    page, warnings = reference.render()
    named = {re.match(r"config field (\S+) ", w).group(1) for w in warnings}
    assert known <= named and named - known == set(), named - known
    assert "### `grpo.learning_rate`" in page


def code_block(path: Path, language: str, containing: str) -> str:
    blocks = re.findall(rf"```{language}\n(.*?)```", path.read_text(), re.S)
    return next(b for b in blocks if containing in b)


@pytest.mark.parametrize("page", ["README.md", "docs/your-own/rewards.md"])
def test_the_reward_example_runs(page, tmp_path, monkeypatch):
    """The reward function a page shows scores a batch as the score stage hands it over (chat-message
    completions, the rollout rows' columns as keywords)."""
    (tmp_path / "my_rewards.py").write_text(code_block(ROOT / page, "python", "def brevity"))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_rewards", raising=False)
    import importlib

    module = importlib.import_module("my_rewards")
    completions = [[{"role": "assistant", "content": text}] for text in ("<answer>7</answer>", "w " * 30 + "7", "5")]
    scores = module.brevity(prompts=[[]] * 3, completions=completions, answer=["7"] * 3,
                            completion_ids=[[1]] * 3, prompt_id=["a", "b", "c"])
    assert scores == [1.0, 0.5, 0.0]


def test_the_readme_points_into_the_docs():
    """README.md stays a front page (<= 200 lines): what posttrain is, the two commands, the quickstart's result,
    one example, and links; every link it has leads to a file, "use my own reward function" in one click."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    assert "make run" in text and "make test" in text
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    for link in links:
        if not link.startswith("http"):
            assert (ROOT / link).exists(), link
    assert re.search(r"\[[^\]]*own reward function[^\]]*\]\(docs/your-own/rewards\.md\)", text)


def test_the_readme_config_loads(tmp_path, monkeypatch):
    """The README's example config is a valid config (its data files made up here)."""
    from flows.config import load_config

    (tmp_path / "data").mkdir()
    for split in ("train", "eval"):
        (tmp_path / "data" / f"{split}.jsonl").write_text('{"question": "Which is larger, 2 or 3?", "answer": "3"}\n')
    (tmp_path / "my.yaml").write_text(code_block(ROOT / "README.md", "yaml", "reward_funcs"))
    monkeypatch.chdir(tmp_path)
    config = load_config("my.yaml")
    assert config.score.reward_funcs == ["my_rewards.brevity", "format"] and not config.sft.enabled
