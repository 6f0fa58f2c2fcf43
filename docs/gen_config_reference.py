"""The config reference page, generated from the pydantic config models at build time.

MkDocs runs this file as a hook (mkdocs.yml `hooks:`): `on_files` adds `reference/config.md`, rendered from
`flows.config.PipelineConfig` and every section model it nests, so the page cannot drift from the code and is
never committed. Each field: its type, default, bounds, docstring, and the stages whose cache key it is in.

Which stage's key a field is in comes from two places in the code:
- which stage task reads which config section: every function decorated `@task(name=...)` in tasks/*.py is
  read (not imported) for `ctx.config.<section>[.<field>]`, following the module-level helpers it calls with
  `ctx`. A task keys what it reads (DESIGN.md: an argument never reaches a stage without reaching its key).
- what each field declares next to itself (stages/runtime/keys.py): `not_in_key` (in no key) or `key_when_set`
  (in the key once it is not None). A `train:` section (stages/runtime/devices.py DeviceConfig) is keyed only
  through `devices.key_fields`: by the tasks that call it, with the fields it returns.

A field without a docstring is a warning, and `mkdocs build --strict` (tests/test_docs.py, `make docs`) fails
on it; the fields in KNOWN_UNDOCUMENTED are listed on the page instead (a field that gains a docstring must
leave that list: also a warning).

Run it on its own to print the page: `.venv/bin/python docs/gen_config_reference.py`.
"""

from __future__ import annotations

import ast
import inspect
import json
import logging
import sys
import textwrap
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = "reference/config.md"
log = logging.getLogger("mkdocs.plugins.config_reference")

KNOWN_UNDOCUMENTED: set[str] = set()
"""Fields that had no docstring when this page was first generated (2026-11-27). Only ever shrinks: give the
field a docstring in its config class and take it out of here."""


# --- which task reads which section --------------------------------------------------------------------------

def _chain(node: ast.AST) -> list[str] | None:
    """`a.b.c` as ["a", "b", "c"]; None for anything that does not start at a name."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def _outside_lambdas(fn: ast.AST):
    """The nodes of `fn`, less those inside a lambda: a task's lambda says how its call runs (materialize's
    runner); what the key holds is the task's `Call` and its arguments (tasks/calls.py)."""
    pending = [fn]
    while pending:
        node = pending.pop()
        yield node
        pending += [child for child in ast.iter_child_nodes(node) if not isinstance(child, ast.Lambda)]


def _function_reads(fn: ast.FunctionDef) -> tuple[set[tuple], set[str], set[str]]:
    """({(section, attribute or None)} read from `ctx.config` in `fn`, {functions `fn` calls}, {stage names
    in its `f(ctx, "<stage>", ...)` calls}), lambdas left out. An attribute is None when the whole section is
    read (passed on, dumped, keyed). A local name bound to `ctx.config` stands for it; one bound to
    `ctx.config.<section>` stands for the section where it is read whole, or where a field of it is handed to
    `key_fields` (its other field reads say how or where the stage runs, e.g. `cfg.worker_cpus`). A section
    handed over as `Config(section, only=...)` is read for those fields only (`only`'s own read)."""
    nodes = list(_outside_lambdas(fn))
    aliases = {}  # local name -> the chain it stands for
    for node in nodes:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            chain = _chain(node.value)
            if chain and chain[:2] == ["ctx", "config"] and len(chain) <= 3:
                aliases[node.targets[0].id] = chain
    keyed_args = {id(arg) for node in nodes if isinstance(node, ast.Call)
                  and (_chain(node.func) or [""])[-1] == "key_fields" for arg in node.args}
    inner = {id(n.value) for n in nodes if isinstance(n, ast.Attribute)}
    inner |= {id(node.args[0]) for node in nodes  # Config(section, only=...): read for `only`'s fields
              if isinstance(node, ast.Call) and node.args and (_chain(node.func) or [""])[-1] == "Config"
              and any(k.arg == "only" for k in node.keywords)}
    reads, calls, stage_names = set(), set(), set()
    for node in nodes:
        if isinstance(node, ast.Call):
            chain = _chain(node.func)
            if chain:
                calls.add(".".join(chain))
            if (len(node.args) >= 2 and isinstance(node.args[0], ast.Name) and node.args[0].id == "ctx"
                    and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
                stage_names.add(node.args[1].value)
        if not isinstance(node, ast.Attribute) or id(node) in inner:
            continue
        chain = _chain(node)
        if chain and chain[0] in aliases:
            if len(aliases[chain[0]]) == 3 and len(chain) > 1 and id(node) not in keyed_args:
                continue  # a field read off an alias for other uses than the key (e.g. where a worker runs)
            chain = aliases[chain[0]] + chain[1:]
        if chain and chain[:2] == ["ctx", "config"] and len(chain) >= 3:
            reads.add((chain[2], chain[3] if len(chain) > 3 else None))
    return reads, calls, stage_names


def task_reads(folder: Path = ROOT / "tasks") -> dict[str, tuple[set[tuple], set[str]]]:
    """{stage: (its config reads, the functions it calls)} for every `@task` function under `folder`, each with
    the reads and calls of the module-level helpers it calls, transitively. The stage is the one folder name
    the task hands to `materialize(ctx, "<stage>", ...)` (artifacts/<stage>/), else the task's name."""
    functions, stages = {}, {}
    for path in sorted(folder.glob("*.py")):
        for fn in ast.parse(path.read_text()).body:
            if not isinstance(fn, ast.FunctionDef):
                continue
            functions[fn.name] = _function_reads(fn)
            for deco in fn.decorator_list:
                if isinstance(deco, ast.Call) and _chain(deco.func) == ["task"]:
                    named = functions[fn.name][2]
                    name = next(iter(named)) if len(named) == 1 else next(
                        (k.value.value for k in deco.keywords if k.arg == "name"), fn.name)
                    stages.setdefault(name, []).append(fn.name)
    result = {}
    for stage, names in stages.items():
        reads, calls, pending, seen = set(), set(), list(names), set()
        while pending:
            name = pending.pop()
            if name in seen or name not in functions:
                continue
            seen.add(name)
            fn_reads, fn_calls, _ = functions[name]
            reads |= fn_reads
            calls |= fn_calls
            pending += [c for c in fn_calls if c in functions]
        result[stage] = (reads, calls)
    return result


# --- the models ----------------------------------------------------------------------------------------------

def _models_in(annotation) -> list[type]:
    from pydantic import BaseModel

    found = [annotation] if isinstance(annotation, type) and issubclass(annotation, BaseModel) else []
    for arg in typing.get_args(annotation):
        found += [m for m in _models_in(arg) if m not in found]
    return found


def field_docstrings(model: type) -> dict[str, str]:
    """{field: the string literal written under it} in `model` and its pydantic base classes (read from the
    source, as pydantic's `use_attribute_docstrings` does)."""
    from pydantic import BaseModel

    docs = {}
    for klass in reversed(model.__mro__):
        if not (isinstance(klass, type) and issubclass(klass, BaseModel)) or klass is BaseModel:
            continue
        try:
            body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        except (OSError, TypeError):
            continue
        for node, after in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                    and isinstance(after.value.value, str)):
                docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def type_text(annotation) -> str:
    """A field's type as a reader writes it in YAML terms: `int | null`, one of `a | b`, `list[str]`."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is type(None):
        return "null"
    if origin is typing.Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return " | ".join(type_text(a) for a in args)
    if origin in (list, tuple, set, dict):
        return f"{origin.__name__}[{', '.join(type_text(a) for a in args if a is not Ellipsis)}]"
    if isinstance(annotation, type):
        return {"str": "str", "int": "int", "float": "float", "bool": "bool"}.get(annotation.__name__,
                                                                                annotation.__name__)
    return str(annotation).replace("typing.", "")


def default_text(field) -> str | None:
    """The default as YAML would spell it, or None for a section (a nested model)."""
    from pydantic import BaseModel
    from pydantic_core import PydanticUndefined

    if field.default_factory is not None:
        value = field.default_factory()
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if isinstance(value, BaseModel):
        return None
    return json.dumps(value.model_dump(mode="json") if isinstance(value, BaseModel) else value, default=str)


def bounds_text(field) -> str:
    signs = {"gt": ">", "ge": ">=", "lt": "<", "le": "<=", "min_length": "min length", "max_length": "max length"}
    found = []
    for item in field.metadata:
        for name, sign in signs.items():
            if getattr(item, name, None) is not None:
                found.append(f"{sign} {getattr(item, name)}")
    return ", ".join(found)


def escape(text: str) -> str:
    """Markdown-safe docstring text: `<`, `>` and `*` outside code spans are literal; lines are joined into
    paragraphs (a blank line in the docstring starts a new one)."""
    paragraphs = [" ".join(line.strip() for line in block.splitlines()) for block in text.split("\n\n")]
    out = []
    for paragraph in paragraphs:
        parts = paragraph.split("`")
        for i in range(0, len(parts), 2):  # even parts are outside code spans
            parts[i] = parts[i].replace("<", "&lt;").replace(">", "&gt;").replace("*", r"\*")
        out.append("`".join(parts))
    return "\n\n".join(out)


# --- keys ----------------------------------------------------------------------------------------------------

class KeyIndex:
    """Which stages' keys hold a field, from the tasks' reads and the fields' own declarations."""

    def __init__(self, root_model):
        from stages.runtime import devices

        self.root = root_model
        self.reads = task_reads()
        self.devices = devices
        probe = devices.DeviceConfig(precision="bf16")
        self.device_key_fields = set(devices.key_fields(probe))  # what of a train: section a key holds
        self.device_keyed_by = sorted(stage for stage, (_, calls) in self.reads.items()  # a call's placement
                                      if {"devices.key_fields", "placement"} & calls)  # is keyed by key_fields
        self.methods = {}  # (section, method) -> the fields it returns (e.g. ebft.block_fields())

    def _fields_of(self, section: str, attribute: str) -> set[str] | None:
        """The fields `ctx.config.<section>.<attribute>` reads: {attribute} for a field; for a method that
        returns a dict of fields, those (called on the section's defaults); None: the whole section."""
        model = _models_in(self.root.model_fields[section].annotation)[0]
        if attribute in model.model_fields:
            return {attribute}
        method = getattr(model, attribute, None)
        if isinstance(method, tuple) and set(method) <= set(model.model_fields):  # e.g. EBFTConfig.BLOCK_FIELDS
            return set(method)
        if callable(method):
            try:
                value = method(model())
            except Exception:  # noqa: BLE001 - a method that needs more than defaults: the whole section
                return None
            if isinstance(value, dict) and set(value) <= set(model.model_fields):
                return set(value)
        return None

    def stages_reading(self, section: str, path: list[tuple[type, str]] | None = None) -> list[tuple[str, bool]]:
        """[(stage, only when set)] of the stages whose key holds the field at `path` (from the section's model
        down; None: any field of the section). A task that reads the whole section keys it as `key_fields` does
        (the declarations along the path apply); one that reads a field of it keys that field (the
        declarations below it apply)."""
        from stages.runtime.keys import key_rule

        model = _models_in(self.root.model_fields[section].annotation)[0]
        paths = [path] if path else [[(model, name)] for name in model.model_fields]
        found = {}
        for stage, (reads, _) in self.reads.items():
            for read_section, attribute in reads:
                if read_section != section:
                    continue
                for p in paths:
                    fields = None if attribute is None else self._fields_of(section, attribute)
                    if fields is None:  # the whole section (or all a method of it dumps)
                        rules = [key_rule(m, n) for m, n in p]
                    elif p[0][1] in fields:  # that field, taken as it is
                        rules = [key_rule(m, n) for m, n in p[1:]]
                    else:
                        continue
                    if False not in rules:
                        when_set = "when_set" in rules
                        found[stage] = found.get(stage, True) and when_set
        return sorted(found.items())

    def describe(self, path: list[tuple[type, str]]) -> str:
        """The key cell of the field at `path` [(model, field), ...] from the top-level config down."""
        from stages.runtime.keys import key_rule

        if len(path) == 1:  # a top-level option (name, rl, seed, ...)
            stages = sorted(stage for stage, (reads, _) in self.reads.items() if (path[0][1], None) in reads)
            return ", ".join(stages) or "—"
        section, section_model = path[0][1], path[1][0]
        if issubclass(section_model, self.devices.DeviceConfig):
            if path[1][1] in self.device_key_fields:
                return ", ".join(self.device_keyed_by) + " (the resolved precision, when not fp32)"
            return "—"
        stages = self.stages_reading(section, path[1:])
        if not stages:
            declared = [key_rule(m, n) for m, n in path[1:]]
            return "— (`not_in_key`)" if False in declared else "—"
        return ", ".join(f"{s} (when set)" if when_set else s for s, when_set in stages)


# --- the page ------------------------------------------------------------------------------------------------

INTRO = """\
# Config reference

Every option of a posttrain config, generated from the config models when the site is built
(`docs/gen_config_reference.py`, from `flows/config.py`'s `PipelineConfig` and the section models under
`stages/`), so it says what the code says. A YAML config sets any of these by its dotted path, and so does the
command line: `posttrain run configs/quickstart.yaml grpo.rounds=2 rollout.temperature=0.8`.
`posttrain validate CONFIG` prints a config with every default filled in.

**In the key of** names the stages whose cache key holds the option: change it and those stages are computed
again, and with them every stage after them (their inputs' keys change); every other finished stage is
reused. It is derived from which stage task reads which section (`tasks/stage_tasks.py`) and from what each
field declares next to itself (`stages/runtime/keys.py`): `—` means in no stage's key (a change reuses every
finished stage, though it may change which stages run, as `rl` does); `not_in_key` marks an option that says
when, where or how fast a stage runs, not what it computes; "when set" is an option that joins the key once
it is not `null`. A few options reach a key as a recipe's argument rather than through their section (e.g.
`ebft.ce_coef` and `ebft.rl_coef` in the optimize key); their descriptions say so.
"""


def render() -> tuple[str, list[str]]:
    """The page's markdown and the warnings (fields without a docstring, stale KNOWN_UNDOCUMENTED entries)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from flows.config import PipelineConfig

    keys = KeyIndex(PipelineConfig)
    lines, warnings, documented = [INTRO], [], set()
    if not keys.reads or not keys.device_keyed_by:  # the tasks changed shape: say so rather than print "—"
        warnings.append("docs/gen_config_reference.py found no `@task(name=...)` function in tasks/*.py reading "
                        "`ctx.config`, or none calling `devices.key_fields`: update `task_reads` to how the tasks "
                        "read the config now, so the reference's key column stays true")
    top_docs = field_docstrings(PipelineConfig)

    def field_block(path: list[tuple[type, str]], dotted: str, doc: str | None, field) -> None:
        anchor = dotted.replace("[]", "").replace("<name>", "name")
        lines.append(f"### `{dotted}` {{#{anchor}}}\n")
        facts = [f"type `{type_text(field.annotation)}`"]
        default = default_text(field)
        if default == "required":
            facts.append("required")
        elif default is not None:
            facts.append(f"default `{default}`")
        if bounds := bounds_text(field):
            facts.append(bounds)
        facts.append(f"in the key of: {keys.describe(path)}")
        lines.append(" · ".join(facts) + "\n")
        if doc:
            lines.append(escape(doc) + "\n")
        elif dotted in KNOWN_UNDOCUMENTED:
            lines.append("*No docstring yet.*\n")
        else:
            warnings.append(f"config field {dotted} ({path[-1][0].__name__}) has no docstring: write one under "
                            "the field in its config class")

    def walk(model: type, prefix: str, path: list[tuple[type, str]]) -> None:
        docs = field_docstrings(model)
        for name, field in model.model_fields.items():
            dotted = f"{prefix}{name}"
            here = [*path, (model, name)]
            nested = _models_in(field.annotation)
            doc = docs.get(name) or field.description
            if nested:  # a section: its own docstring, or its class's
                doc = doc or inspect.cleandoc(nested[0].__doc__ or "")
            if doc:
                documented.add(dotted)
            origin = typing.get_origin(field.annotation)
            if nested and origin is dict:
                dotted_child = f"{dotted}.<name>."
            elif nested and origin is list or (nested and list in {typing.get_origin(a) for a in
                                                                   typing.get_args(field.annotation)}):
                dotted_child = f"{dotted}[]."
            else:
                dotted_child = f"{dotted}."
            field_block(here, dotted, doc, field)
            for sub in nested:
                walk(sub, dotted_child, here)

    scalars = {n: f for n, f in PipelineConfig.model_fields.items() if not _models_in(f.annotation)}
    lines.append("## Top level\n")
    for name, field in scalars.items():
        doc = top_docs.get(name)
        if doc:
            documented.add(name)
        field_block([(PipelineConfig, name)], name, doc, field)
    for name, field in PipelineConfig.model_fields.items():
        if name in scalars:
            continue
        model = _models_in(field.annotation)[0]
        doc = top_docs.get(name) or inspect.cleandoc(model.__doc__ or "")
        lines.append(f"## `{name}` {{#{name}}}\n")
        lines.append(f"type `{type_text(field.annotation)}` · in the key of: {_section_stages(keys, name, model)}\n")
        if doc:
            documented.add(name)
            lines.append(escape(doc) + "\n")
        walk(model, f"{name}.", [(PipelineConfig, name)])
    for stale in sorted(KNOWN_UNDOCUMENTED & documented):
        warnings.append(f"config field {stale} has a docstring now: take it out of KNOWN_UNDOCUMENTED in "
                        "docs/gen_config_reference.py")
    return "\n".join(lines), warnings


def _section_stages(keys: KeyIndex, name: str, model: type) -> str:
    """The stages that read any of a section's fields (the section heading's key cell)."""
    if issubclass(model, keys.devices.DeviceConfig):
        return ", ".join(keys.device_keyed_by) + " (" + ", ".join(sorted(keys.device_key_fields)) + " only)"
    return ", ".join(stage for stage, _ in keys.stages_reading(name)) or "—"


def on_files(files, config):
    """MkDocs hook: add the generated page to the site's files."""
    from mkdocs.structure.files import File

    content, warnings = render()
    for warning in warnings:
        log.warning(warning)
    files.append(File.generated(config, PAGE, content=content))
    return files


if __name__ == "__main__":
    page, problems = render()
    print(page)
    for problem in problems:
        print("WARNING:", problem, file=sys.stderr)
