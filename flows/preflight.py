"""Preflight: what a run would trip on, found in seconds before its first stage (`posttrain validate`, and
`posttrain run` / the flow itself before anything is computed).

It checks, without training or loading a model:
- every file and folder the config names exists and is readable (transform.paths and datasets, preferences'
  files, model.path, reward-model folders);
- the transform runs on the first rows of each split, and its output has what each enabled stage needs: the
  splits (train, eval, SFT's), SFT's completion column, eval's answers, the columns each reward function names;
- every `module.fn` (score.reward_funcs, transform.type, preferences.type, rollout.rollout_func) imports and
  is a callable with a signature that takes what the stage passes (a reward: TRL's keywords);
- model.path resolves: a folder with config.json and a tokenizer, a .gguf file, or a hub id in the hub cache
  (or, online, on the hub: the run downloads it, which `notes` says).

Each problem is one line naming the config key and what to do; `check` raises PreflightError (a ConfigError:
exit 2, no traceback) with all of them.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from flows.config import ConfigError, PipelineConfig, code_dirs

HEAD_ROWS = 32
"""Rows of each split the transform is tried on."""

TRL_KEYWORDS = ("prompts", "completions", "completion_ids", "prompt_id")
"""What every reward call passes besides the prompts table's own columns (stages/scoring/score.py `run`)."""

BUILTIN_COLUMNS = {"accuracy": "answer", "stated_accuracy": "answer", "code_execution": "test_cases",
                   "reasoning_gym": "reasoning_gym", "human_eval": "human_eval"}
"""The column each built-in reward needs on every row (their signatures default it to None)."""
BUILTIN_COLUMN_FIX = {"reasoning_gym": "read the rows from a reasoning-gym source (datasets: - path: reasoning_gym, "
                                       "name: TASK; docs/your-own/data.md), which writes it",
                      "human_eval": "read the rows from HumanEval (datasets: - path: human_eval; "
                                    "docs/your-own/data.md), which writes it"}
"""How a user gives a built-in its column, where that is not mapping one of their columns to it."""

ROLLOUT_FUNC_KEYWORDS = ("prompts", "engine", "policy", "sampling", "tokenizer")
"""What rollout.rollout_func is called with (stages/rollout/rollout.py `_user_rollout`)."""
AXOLOTL_ROLLOUT_KEYWORDS = ("model", "processing_class", "prompts")
"""What a rollout_func with axolotl's guide's parameters is called with (generation_config too where it takes one)."""


class PreflightError(ConfigError):
    """Problems a run would trip on; one line each, naming the config key and the fix."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


@dataclass
class Report:
    problems: list[str] = field(default_factory=list)
    """One line per thing the run would trip on."""
    notes: list[str] = field(default_factory=list)
    """What the run will do that the config does not spell out (SFT on or off, a download)."""
    splits: dict[str, list[dict]] | None = None
    """The first transformed rows of each split of your own data; None for the demo task's."""
    functions: list[str] = field(default_factory=list)
    """Every `module.fn` of user code the config names that imported (the run logs their modules' source)."""

    def problem(self, key: str, message: str) -> None:
        self.problems.append(f"{key}: {message}")


_PASSED: dict[tuple, Report] = {}  # (config hash, sys.path) -> report, of configs that passed in this process


def check(cfg: PipelineConfig, config_path: str | Path) -> Report:
    """Run every check; raise PreflightError listing the problems. A config that passed in this process
    (same config, same sys.path) is not checked again (the CLI checks before the flow does)."""
    key = (cfg.hash(), tuple(sys.path))
    if key in _PASSED:
        return _PASSED[key]
    report = inspect_config(cfg, config_path)
    if report.problems:
        raise PreflightError(report.problems)
    _PASSED[key] = report
    return report


def inspect_config(cfg: PipelineConfig, config_path: str | Path) -> Report:
    """Every check, its problems and notes collected (nothing raised)."""
    report = Report(notes=cfg.translation_notes)  # what axolotl's length keys became (flows/axolotl.py)
    where = " or ".join(dict.fromkeys(code_dirs(config_path)))
    _model(cfg, report)
    _transform(cfg, report, where)
    _stages_read_the_splits(cfg, report)
    if cfg.uses_rounds and cfg.rl != "ebft" and cfg.rollout.source != "atropos":
        for i, name in enumerate(cfg.score.reward_funcs):
            _reward(name, f"score.reward_funcs.{i}", report, where)
        _nemo_gym_heads(cfg, report)
    for i, name in enumerate(cfg.eval.reward_funcs or ()):  # the eval's own verifier, when named
        _reward(name, f"eval.reward_funcs.{i}", report, where)
    if cfg.uses_rounds and cfg.rollout.rollout_func:
        fn = _function(cfg.rollout.rollout_func, "rollout.rollout_func", report, where)
        if fn is not None:
            from stages.rollout.rollout import is_axolotl_rollout_func

            axolotl = is_axolotl_rollout_func(fn)
            passed = ROLLOUT_FUNC_KEYWORDS if not axolotl else AXOLOTL_ROLLOUT_KEYWORDS + (
                ("generation_config",) if "generation_config" in inspect.signature(fn).parameters else ())
            _takes_keywords(fn, cfg.rollout.rollout_func, "rollout.rollout_func", passed, report)
            if axolotl:
                report.notes.append(f"rollout.rollout_func: {cfg.rollout.rollout_func} takes axolotl's guide's "
                                    "(model, processing_class, prompts, generation_config): it gets the round's policy "
                                    "as a transformers model and returns completion strings; their log-probs are the "
                                    "policy's, computed after it")
    if cfg.preferences is not None:
        _preferences(cfg, report, where)
    return report


# --- model ---------------------------------------------------------------------------------------------------


def _model(cfg: PipelineConfig, report: Report) -> None:
    """model.path: a folder with config.json and a tokenizer, a .gguf file, or a hub id (cached, or on the hub)."""
    from stages.data import hub, model_source

    name = cfg.model.path
    if not name:
        return
    local = Path(name).expanduser()
    if name.endswith(".gguf") or local.exists() or not hub.is_repo_id(name):
        try:
            source = model_source.resolve(name, cfg.model.revision)  # a local path: no network
        except model_source.ModelSourceError as e:
            report.problem("model.path", _first_sentence_fix(str(e)) + _near_miss(local))
            return
        if not os.access(source.path, os.R_OK):
            report.problem("model.path", f"{source.path} is not readable (permissions); make it readable")
        elif source.kind == "folder":
            if not (source.path / "config.json").is_file():
                report.problem("model.path", f"folder {source.path} has no config.json: it is not a transformers "
                                             "model; point it at a folder saved with save_pretrained, a .gguf "
                                             "file or a hub id")
            elif not any((source.path / f).is_file() for f in model_source.TOKENIZER_FILES):
                report.problem("model.path", f"folder {source.path} has no tokenizer ({', '.join(model_source.TOKENIZER_FILES)}); "
                                             "save the model's tokenizer into it (tokenizer.save_pretrained)")
        return
    _hub_model(name, cfg.model.revision, report, local)


def _hub_model(repo_id: str, revision: str, report: Report, local: Path, key: str = "model.path") -> None:
    """A hub id (named by `key`): found in the hub cache (what an offline run reads), else asked of the hub (the
    run downloads it)."""
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    from stages.data import hub, model_source

    try:
        snapshot_download(repo_id, revision=revision, cache_dir=hub.cache_dir(), local_files_only=True,
                          ignore_patterns=model_source.IGNORED_HUB_FILES)
        report.notes.append(f"{key}: hub id {repo_id} ({revision}) is in the hub cache {hub.cache_dir()}")
        return
    except Exception:  # not there, or only part of it
        pass
    if hub.offline():
        report.problem(key, f"{repo_id!r} is no local folder ({local.absolute()}) and, as a hub id, is not in "
                                     f"the hub cache {hub.cache_dir()} (HF_HUB_OFFLINE is set); fix the path, or "
                                     f"`hf download {repo_id}` on a machine with a network" + _near_miss(local))
        return
    try:
        HfApi().model_info(repo_id, revision=revision, timeout=10)
    except RevisionNotFoundError:
        report.problem("model.revision", f"the hub has no revision {revision!r} of {repo_id}; set one that exists")
    except GatedRepoError:
        report.problem(key, f"hub model {repo_id} is gated: accept its terms on https://huggingface.co/"
                                     f"{repo_id} and `hf auth login`")
    except RepositoryNotFoundError:
        report.problem(key, f"{repo_id!r} is no local folder ({local.absolute()}) and no model on the hub "
                                     "(or a private one: `hf auth login`); fix the path or the id" + _near_miss(local))
    except (LocalEntryNotFoundError, OSError, Exception) as e:  # no network: the run could not get it either
        report.problem(key, f"{repo_id!r} is no local folder ({local.absolute()}) and, as a hub id, is not "
                                     f"in the hub cache {hub.cache_dir()}, and the hub cannot be reached "
                                     f"({type(e).__name__}); fix the path, or connect (or `hf download {repo_id}` "
                                     "elsewhere and copy the cache, HF_HUB_CACHE)" + _near_miss(local))
    else:
        report.notes.append(f"{key}: hub id {repo_id} is not in the hub cache yet; the run downloads it into "
                            f"{hub.cache_dir()}")


def _near_miss(path: Path) -> str:
    """`; did you mean models/tiny-model?` when the folder above `path` has a name close to its last part."""
    parent = path.parent if str(path.parent) else Path(".")
    try:
        names = [p.name for p in parent.iterdir()] if parent.is_dir() else []
    except OSError:
        return ""
    close = difflib.get_close_matches(path.name, names, n=1, cutoff=0.6)
    return f" (did you mean {str(parent / close[0]) if str(parent) != '.' else close[0]!s}?)" if close else ""


def _first_sentence_fix(message: str) -> str:
    return message.removeprefix("model.path ").rstrip(".")


# --- data ----------------------------------------------------------------------------------------------------


def _readable_file(path: Path, key: str, report: Report) -> bool:
    if not path.exists():
        report.problem(key, f"{path} does not exist ({path.absolute()}); fix the path (relative paths are read from "
                            f"the working folder {Path.cwd()})" + _near_miss(path))
        return False
    if not os.access(path, os.R_OK) or (path.is_file() and not _can_open(path)):
        report.problem(key, f"{path} is not readable (permissions); make it readable")
        return False
    return True


def _can_open(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            f.read(1)
        return True
    except OSError:
        return False


def _transform(cfg: PipelineConfig, report: Report, where: str) -> None:
    """The transform on the first rows of each split of your own data (transform.paths or datasets)."""
    from stages.data import sources, transform

    if not cfg.reads_prompts:  # a DPO-family run on your preferences: no transform stage
        return

    tcfg = cfg.transform
    types = [("transform.type", tcfg.type)] + [
        (f"transform.{name}.{i}.type", s.type) for name in ("datasets", "test_datasets")
        for i, s in enumerate(getattr(tcfg, name) or []) if s.type]
    loaded_ok = True
    for key, name in types:
        if name not in transform.BUILTINS:
            loaded_ok &= _function(name, key, report, where) is not None
        elif "." in name:  # axolotl's transforms by their names: a file of that name is the user's copy of one
            copies = [Path(folder) / f"{name.split('.')[0]}.py" for folder in where.split(" or ")]
            for copy in dict.fromkeys(c for c in copies if c.is_file()):
                report.notes.append(f"{key}: {name} is axolotl's strided EBFT transform, built in here (stages/data/"
                                    f"transform.py: the rollout tokenizes with the policy's tokenizer): "
                                    f"./{copy.name} is not imported ({copy.parent})")
    if not (tcfg.paths or tcfg.datasets):
        report.notes.append(f"transform: the built-in demo task's data (demo_data), splits {', '.join(_demo_splits())}")
        return
    parts: dict[str, list] = {}  # split -> [(key, source name, transform config, what, rows)]
    if tcfg.paths:
        for split, name in tcfg.paths.items():
            key, path = f"transform.paths.{split}", Path(name).expanduser()
            parts[split] = []  # the split exists, even when its file has a problem of its own
            if not _readable_file(path, key, report):
                continue
            try:
                rows = sources.read_rows(path)
            except (sources.SourceError, ValueError, OSError) as e:
                report.problem(key, str(e).removeprefix("transform.paths: "))
                continue
            if not rows:
                report.problem(key, f"{path} has no rows; give it at least one")
                continue
            parts.setdefault(split, []).append((key, f"{path} ({split})", tcfg, "transform.type", rows[:HEAD_ROWS]))
    else:
        for name, split in (("datasets", "train"), ("test_datasets", "eval")):
            for i, source in enumerate(getattr(tcfg, name) or []):
                key = f"transform.{name}.{i}"
                rows = _source_rows(source, key, report)
                if rows is None:
                    continue
                own = {f: getattr(source, f) for f in transform.SOURCE_FIELDS if getattr(source, f) is not None}
                what = f"{key}.type" if source.type else "transform.type"
                parts.setdefault(split, []).append((key, sources.describe(source), tcfg.model_copy(update=own), what,
                                                    rows))
    if not loaded_ok:
        return
    splits: dict[str, list[dict]] = {}
    for split, split_parts in parts.items():
        good_rows = []
        for key, source_name, part_cfg, what, rows in split_parts:
            try:
                good, bad = transform.split_rows(part_cfg, rows, split, source_name, what=what)
            except Exception as e:  # the type's builder failed
                report.problem(what, f"{part_cfg.type}(cfg) failed: {type(e).__name__}: {e}; fix the transform")
                return
            good_rows += good
            if bad and (tcfg.on_bad_rows == "fail" or not good):
                src, index, reason = bad[0]
                more = f" (and {len(bad) - 1} more of the first {len(rows)} rows)" if len(bad) > 1 else ""
                fix = ("fix the rows, point transform.question_field/answer_field at your columns, or set "
                       "transform.on_bad_rows: drop" if tcfg.on_bad_rows == "fail" else "no row is usable")
                report.problem(key, f"{src} row {index}: {reason}{more}; {fix}")
        splits[split] = good_rows
    if tcfg.datasets and tcfg.val_set_size and "train" in splits:  # held out of the same rows: checked once
        splits["eval"] = splits["train"]
    report.splits = splits


def _source_rows(source, key: str, report: Report) -> list | None:
    """The first rows of a datasets entry; a hub dataset only resolved (its rows would mean a download)."""
    from stages.data import sources

    try:
        which = sources.kind(source)
        if which == "hub":
            sources.hub_revision(source)
            report.notes.append(f"{key}: hub dataset {source.path}: resolved; its rows are checked by the run")
            return None
        for path in sources.local_paths(source):
            if not os.access(path, os.R_OK):
                report.problem(f"{key}.path", f"{path} is not readable (permissions); make it readable")
                return None
        return [row for _, row in sources.load(source)[:HEAD_ROWS]]
    except FileNotFoundError as e:
        report.problem(f"{key}.path", str(e).removeprefix("datasets: ") + "; fix the path")
    except (sources.SourceError, ValueError) as e:
        report.problem(key, str(e))
    return None


def _demo_splits() -> tuple[str, ...]:
    from stages.data.demo_data import SPLITS

    return SPLITS


def _columns(rows: list[dict]) -> set[str]:
    return {k for row in rows for k in row}


def _stages_read_the_splits(cfg: PipelineConfig, report: Report) -> None:
    """The splits and columns each enabled stage reads: SFT's split and completion column, the train split the
    rounds sample from, the eval split and its answers. The run's choice of SFT goes into the notes."""
    splits = report.splits
    have = sorted(splits) if splits is not None else list(_demo_splits())
    if cfg.rl == "reward_model":
        return
    if not cfg.reads_prompts:
        report.notes.append(f"prompts: none; rl: {cfg.rl} trains on your preferences from model.path (no demo data, "
                            "SFT or prompt eval; held-out preference accuracy on the preferences' eval split)")
        return
    if not cfg.runs_eval:
        report.notes.append("eval: none; your rows are a train split only, so the run reports training metrics "
                            "(transform.test_datasets, val_set_size or transform.paths.eval add a held-out eval)")
    if cfg.sft.enabled:
        report.notes.append(f"sft: warm start on split {cfg.sft.split!r}, column {cfg.sft.completion_field!r}")
        if cfg.sft.split not in have:
            report.problem("sft.split", f"the prompts have no split {cfg.sft.split!r} (they have {', '.join(have)}); "
                                        "set sft.enabled: false to start from the model as it is, or add "
                                        f"transform.paths.{cfg.sft.split} (or set sft.split: train with "
                                        "sft.completion_field: answer)")
        elif splits is not None and splits.get(cfg.sft.split):
            rows = splits[cfg.sft.split]
            text_rows = all(not r.get("prompt") for r in rows)
            if cfg.sft.completion_field not in _columns(rows) and not text_rows:
                report.problem("sft.completion_field", f"column {cfg.sft.completion_field!r} is not in the rows of "
                                                       f"split {cfg.sft.split!r} (columns: "
                                                       f"{', '.join(sorted(_columns(rows)))}); set it to the column "
                                                       "with the target text (e.g. answer), or sft.enabled: false")
    else:
        report.notes.append("sft: off; the policy starts from the model as it is (sft.enabled: true with sft.split "
                            "and sft.completion_field warm-starts it on your rows)")
    if splits is None:
        return
    if cfg.uses_rounds and "train" not in splits and not cfg.transform.datasets:
        report.problem("transform.paths", f"no train split (the rounds sample its prompts; splits: {', '.join(have)}); "
                                          "add transform.paths.train")
    if not cfg.runs_eval:
        return
    if cfg.eval.split not in splits:
        report.problem("eval.split", f"the prompts have no split {cfg.eval.split!r} (they have {', '.join(have)}); "
                                     "add transform.paths.eval, or set eval.split to one of them")
    elif cfg.transform.type != "text" and splits[cfg.eval.split] and _eval_needs_answers(cfg):
        unanswered = [r["prompt_id"] for r in splits[cfg.eval.split] if r.get("answer") is None]
        if unanswered:
            report.problem("transform.answer_field", f"rows of the eval split have no answer (e.g. "
                                                     f"{unanswered[0]}): the eval scores against gold answers; "
                                                     "point transform.answer_field at the column that has them")


def _eval_needs_answers(cfg: PipelineConfig) -> bool:
    """The eval's verifier compares against gold answers: it is a built-in accuracy (your own verifier reads
    whichever columns it needs)."""
    from stages.evaluation.evaluate import verifier_funcs

    return bool({"accuracy", "stated_accuracy"} & set(verifier_funcs(cfg.eval, cfg.score.reward_funcs)))


# --- user code -----------------------------------------------------------------------------------------------


def _function(dotted: str, key: str, report: Report, where: str):
    """`module.fn` imported, or None with a problem naming what failed and where modules are looked for."""
    module_name, _, fn_name = dotted.rpartition(".")
    if not module_name:
        report.problem(key, f"{dotted!r} is neither a built-in nor module.fn")
        return None
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and module_name != e.name and not module_name.startswith(e.name + "."):
            report.problem(key, f"importing {module_name!r} failed: it imports {e.name!r}, which is not installed "
                                f"(pip install it)")
        else:
            report.problem(key, f"cannot import module {module_name!r} (no {module_name.replace('.', '/')}.py "
                                f"beside the config or in the working folder: {where}, nor on sys.path); put it "
                                "there, fix the name, or install it")
        return None
    except Exception as e:  # a SyntaxError, an error raised while the module runs
        at = f" ({e.filename}:{e.lineno})" if isinstance(e, SyntaxError) else ""
        report.problem(key, f"importing {module_name!r} failed: {type(e).__name__}: {e}{at}; fix the module")
        return None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        names = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                 and getattr(v, "__module__", None) == module.__name__]
        close = difflib.get_close_matches(fn_name, names, n=1, cutoff=0.5)
        hint = f"; did you mean {module_name}.{close[0]}?" if close else (
            f"; it defines {', '.join(sorted(names)[:8])}" if names else "")
        what = "has no function" if fn is None else "has a non-callable"
        report.problem(key, f"module {module_name!r} ({getattr(module, '__file__', '?')}) {what} {fn_name!r}{hint}")
        return None
    if dotted not in report.functions:
        report.functions.append(dotted)
    return fn


def _parameters(fn):
    try:
        return inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check
        return None


def _takes_keywords(fn, name: str, key: str, passed, report: Report) -> None:
    """`fn` can be called with exactly the keywords in `passed`: no required parameter outside them, and every
    one of them accepted (by name, or by **kwargs)."""
    parameters = _parameters(fn)
    if parameters is None:
        return
    kinds = inspect.Parameter
    names = {p.name for p in parameters if p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY)}
    positional_only = [p.name for p in parameters if p.kind == kinds.POSITIONAL_ONLY and p.default is p.empty]
    if positional_only:
        report.problem(key, f"{name} has positional-only parameter(s) {', '.join(positional_only)}, but is called "
                            f"with keywords ({', '.join(sorted(passed))}); drop the `/`")
        return
    required = [p.name for p in parameters if p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY)
                and p.default is p.empty]
    missing = [n for n in required if n not in passed]
    if missing:
        report.problem(key, f"{name} needs {', '.join(repr(m) for m in missing)}, which the call does not pass "
                            f"(it passes {', '.join(sorted(passed))}); rename the parameter or give it a default")
    if not any(p.kind == kinds.VAR_KEYWORD for p in parameters):
        unaccepted = sorted(set(passed) - names)
        if unaccepted:
            report.problem(key, f"{name} does not accept {', '.join(unaccepted)}, which every call passes as "
                                "keywords; add **kwargs to its signature")


def _reward_model_name(name: str, key: str, report: Report) -> None:
    """A reward model named as TRL names one: a folder with a config.json, or a hub id the run can resolve (in the
    hub cache, or on the hub when online)."""
    from stages.data import hub

    local = Path(name).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            report.problem(key, f"reward model folder {local} has no config.json; point it at a sequence-"
                                "classification model saved with save_pretrained")
    elif hub.is_repo_id(name):
        _hub_model(name, "main", report, local, key)
    else:
        report.problem(key, f"{name!r}: no reward model folder there ({local.absolute()}) and not a hub id; fix the "
                            "path, or name the model by hub id (org/name)")


def _nemo_gym_heads(cfg: PipelineConfig, report: Report) -> None:
    """Each remote verifier with head_url that score.reward_funcs uses: its NeMo Gym head answers, and lists the
    resources server of every row tried (its `server`, or the rows' server_column)."""
    from stages.scoring.rewards.remote import REMOTE_PREFIX, HeadError, listed_servers

    for name, verifier in cfg.score.remote_verifiers.items():
        if verifier.head_url is None or REMOTE_PREFIX + name not in cfg.score.reward_funcs:
            continue
        key = f"score.remote_verifiers.{name}.head_url"
        try:
            listed = listed_servers(verifier.head_url)
        except HeadError as e:
            report.problem(key, str(e))
            continue
        rows = (report.splits or {}).get("train") or []
        wanted = [verifier.server] if verifier.server else [r.get(verifier.server_column) for r in rows]
        if missing := [s for s in dict.fromkeys(wanted) if s not in listed]:
            report.problem(key, f"the NeMo Gym head {verifier.head_url} lists no resources server {missing[0]!r} "
                                f"(it lists: {', '.join(sorted(listed)) or 'none'}); start it with ng_run, or fix the "
                                "server name")
        else:
            report.notes.append(f"{key}: NeMo Gym head {verifier.head_url} lists {', '.join(sorted(listed))}")


def _reward(name: str, key: str, report: Report, where: str) -> None:
    """One score.reward_funcs entry: importable, callable with TRL's keywords and the rows' columns."""
    from stages.data.schemas import ROLLOUTS
    from stages.scoring.reward_workers import REWARD_MODEL_PREFIX, is_model_name, resolve_reward
    from stages.scoring.rewards import BUILTIN_REWARDS
    from stages.scoring.rewards.remote import REMOTE_PREFIX

    if name == "reward_model" or name.startswith(REMOTE_PREFIX):
        return  # this run's reward model stage; an HTTP service (its config is checked with the config)
    if name.startswith(REWARD_MODEL_PREFIX):
        try:
            resolve_reward(name, load=False)
        except ValueError as e:
            report.problem(key, str(e).removeprefix("reward_funcs: ") + "; fix the folder")
        return
    if is_model_name(name):  # TRL's and axolotl's spelling of a reward model: a folder, or a hub id
        _reward_model_name(name, key, report)
        return
    fn = BUILTIN_REWARDS.get(name) or _function(name, key, report, where)
    if fn is None:
        return
    rows = (report.splits or {}).get("train")
    if report.splits is None or not rows:
        return  # the demo task's rows (answer, prompt_id): the built-ins' own
    columns = _columns(rows) - set(ROLLOUTS.names)
    passed = set(TRL_KEYWORDS) | columns
    label = f"reward function {name}"
    if name in BUILTIN_COLUMNS:
        column = BUILTIN_COLUMNS[name]
        if any(r.get(column) is None for r in rows):
            fix = BUILTIN_COLUMN_FIX.get(name, "map your column to it in the transform (transform.answer_field)")
            report.problem(key, f"{name} needs column {column!r} on every row, which the train split's rows lack "
                                f"(columns: {', '.join(sorted(columns))}); {fix}, or use another reward")
        return
    parameters = _parameters(fn)
    if parameters is None:
        return
    kinds = inspect.Parameter
    lacking = [p.name for p in parameters if p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY)
               and p.default is p.empty and p.name not in passed]
    if lacking:
        report.problem(key, f"{label} names column(s) {', '.join(repr(c) for c in lacking)} that the rows lack "
                            f"(they have {', '.join(sorted(columns))}; it is also passed "
                            f"{', '.join(TRL_KEYWORDS)}); rename the parameter to a column, or add the column to "
                            "your data or transform")
        return
    _takes_keywords(fn, label, key, passed, report)


def _preferences(cfg: PipelineConfig, report: Report, where: str) -> None:
    """preferences: its files exist and are readable; a `module.fn` type imports."""
    prefs, before = cfg.preferences, len(report.problems)
    for split, name in (prefs.paths or {}).items():
        _readable_file(Path(name).expanduser(), f"preferences.paths.{split}", report)
    types = [("preferences.type", prefs.type)] + [
        (f"preferences.{n}.{i}.type", s.type) for n in ("datasets", "test_datasets")
        for i, s in enumerate(getattr(prefs, n) or []) if s.type]
    from stages.data.preferences import builtins

    known = builtins(prefs.namespace)
    for key, name in types:
        if isinstance(name, str) and name not in known and "." in name and not name.split(".")[0] in {
                k.split(".")[0] for k in known}:
            _function(name, key, report, where)
    if len(report.problems) == before:  # the files read and the types import: their first rows
        _preference_rows(prefs, report)


def _preference_rows(prefs, report: Report) -> None:
    """The preferences' first rows of each local source through their type, as the preferences stage takes
    them: the first bad row of each source named (row, field, reason). Hub datasets are left to the run."""
    from stages.data import sources
    from stages.data.preferences import _raw_parts, transform_rows

    if any(sources.kind(s) == "hub" for s in (prefs.datasets or []) + (prefs.test_datasets or [])):
        return
    try:
        parts = _raw_parts(prefs)
    except (sources.SourceError, ValueError, OSError) as e:
        report.problem("preferences", str(e))
        return
    named = set()  # a source held out (val_set_size) is in both splits: named once
    for split_parts in parts.values():
        for where, prefix, part_cfg, rows in split_parts:
            _, bad = transform_rows(part_cfg, rows[:HEAD_ROWS], where, prefix)
            if bad and where not in named and (prefs.on_bad_rows == "fail" or len(bad) == len(rows[:HEAD_ROWS])):
                named.add(where)
                _, index, field, reason = bad[0]
                more = f" (and {len(bad) - 1} more of the first {len(rows[:HEAD_ROWS])} rows)" if len(bad) > 1 else ""
                report.problem("preferences", f"{where} row {index}, field {field!r}: {reason}{more}; fix the rows "
                                              "or pick the type that fits them (docs/methods/dpo.md lists each "
                                              "type's fields)")
