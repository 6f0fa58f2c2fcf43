"""transform.datasets (axolotl's `datasets:`): local files and folders, and hub datasets resolved offline from a
hub cache laid out as huggingface_hub lays it out, each with its own split slice, type and field names; the
eval split from test_datasets or val_set_size; axolotl's top-level keys; the errors a person gets. Nothing
is downloaded and the hub is not mocked."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from flows.config import ConfigError, PipelineConfig, load_config
from stages.data import sources, transform
from stages.data.sources import DatasetSource, SourceError
from stages.data.transform import BadRowsError, TransformConfig
from tasks import stage_tasks
from tasks.store import ArtifactStore

COMMITS = ("c" * 40, "d" * 40)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_parquet(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def chat(question: str, answer: str) -> list[dict]:
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


@pytest.fixture
def files(tmp_path) -> dict[str, Path]:
    """qa.jsonl (question/answer, 6 rows), chats.parquet (messages under `chat`, 4 rows), test.jsonl (`q`/`a`)."""
    return {"qa": write_jsonl(tmp_path / "qa.jsonl", [{"question": f"add {i} and 1", "answer": str(i + 1)}
                                                       for i in range(6)]),
            "chats": write_parquet(tmp_path / "chats.parquet", [{"chat": chat(f"double {i}", str(2 * i)), "level": i}
                                                                 for i in range(4)]),
            "test": write_jsonl(tmp_path / "test.jsonl", [{"q": f"halve {2 * i}", "a": str(i)} for i in range(3)])}


def two_sources(files, **section) -> TransformConfig:
    return TransformConfig(datasets=[{"path": str(files["qa"]), "split": "train[:4]"},
                                     {"path": str(files["chats"]), "type": "messages", "messages_field": "chat"}],
                           **section)


def test_two_local_sources_of_different_types_make_the_train_split(files, tmp_path, out_dir):
    cfg = two_sources(files, system_prompt="Answer briefly.",
                      test_datasets=[{"path": str(files["test"]), "question_field": "q", "answer_field": "a"}])
    summary = transform.run(cfg, None, out_dir)

    train = pq.read_table(out_dir / "train.parquet").to_pylist()
    assert [r["prompt"][-1]["content"] for r in train] == [f"add {i} and 1" for i in range(4)] + \
        [f"double {i}" for i in range(4)]  # the slice, then the second source, in order
    assert all(r["prompt"][0] == {"role": "system", "content": "Answer briefly."} for r in train)  # inherited
    assert [r["answer"] for r in train[4:]] == ["0", "2", "4", "6"] and train[5]["level"] == 1
    assert len({r["prompt_id"] for r in train}) == 8  # unique across sources
    evals = pq.read_table(out_dir / "eval.parquet").to_pylist()
    assert [(r["prompt"][-1]["content"], r["answer"]) for r in evals] == [("halve 0", "0"), ("halve 2", "1"),
                                                                          ("halve 4", "2")]
    assert (summary["train"], summary["eval"]) == (8, 3)
    assert [(s["key"], s["source"], s["rows"], s["splits"]) for s in summary["sources"]] == [
        ("datasets.0", f"{files['qa']} (split=train[:4])", 4, {"train": 4}),
        ("datasets.1", f"{files['chats']} (split=train)", 4, {"train": 4}),
        ("test_datasets.0", f"{files['test']} (split=train)", 3, {"eval": 3})]


def test_val_set_size_holds_out_rows_of_the_train_sources_by_seed(files, tmp_path):
    def held_out(name: str, **section) -> tuple[list[str], dict]:
        out = tmp_path / name
        out.mkdir()
        summary = transform.run(two_sources(files, **section), None, out)
        return [r["prompt"][-1]["content"] for r in pq.read_table(out / "eval.parquet").to_pylist()], summary

    fraction, summary = held_out("a", val_set_size=0.25)  # ceil(0.25 * 8) = 2 of the 8 rows
    assert len(fraction) == 2 and (summary["train"], summary["eval"]) == (6, 2)
    assert sum(s["splits"].get("eval", 0) for s in summary["sources"]) == 2
    assert held_out("b", val_set_size=0.25)[0] == fraction  # the same seed draws the same rows
    assert held_out("c", val_set_size=3)[1]["eval"] == 3  # a count
    seeds = {tuple(held_out(f"seed{seed}", val_set_size=2, val_set_seed=seed)[0]) for seed in range(4)}
    assert len(seeds) > 1  # val_set_seed picks the rows
    with pytest.raises(ValueError, match=r"val_set_size 8: 8 of the datasets' 8 rows held out"):
        held_out("all", val_set_size=8)


def test_a_bad_row_is_named_by_its_source_and_row(files, tmp_path, out_dir):
    bad = write_parquet(tmp_path / "chats.parquet", [{"chat": chat("double 0", "0"), "level": 0},
                                                     {"chat": chat("double 1", "2")[:1], "level": 1},  # no answer
                                                     {"chat": chat("double 2", "4"), "level": 2}])
    test = [{"path": str(files["test"]), "question_field": "q", "answer_field": "a"}]
    with pytest.raises(BadRowsError) as info:
        transform.run(two_sources({**files, "chats": bad}, test_datasets=test), None, out_dir)
    assert [(source, index) for source, index, _ in info.value.bad] == [(f"{bad} (split=train)", 1)]
    assert f"{bad} (split=train) row 1: missing or empty field chat" in str(info.value)
    assert not list(out_dir.iterdir())

    summary = transform.run(two_sources({**files, "chats": bad}, test_datasets=test, on_bad_rows="drop"), None,
                            out_dir)
    assert summary["train"] == 6 and summary["dropped"]["train"]["rows"] == 1
    assert summary["dropped"]["train"]["indices"] == [1]
    assert summary["dropped"]["train"]["reasons"][0].startswith(f"{bad} (split=train) row 1: missing")
    assert [(s["rows"], s["dropped"]) for s in summary["sources"][:2]] == [(4, 0), (2, 1)]


def test_data_files_and_folders(tmp_path, out_dir):
    folder = tmp_path / "folder"
    write_parquet(folder / "data" / "train-00000-of-00001.parquet", [{"question": f"q{i}", "answer": str(i)}
                                                                      for i in range(5)])
    write_parquet(folder / "data" / "test-00000-of-00001.parquet", [{"question": "t", "answer": "0"}])
    (tmp_path / "csv").mkdir()
    (tmp_path / "csv" / "extra.csv").write_text('question,answer\n"q",007\n')
    cfg = TransformConfig(datasets=[{"path": str(folder), "split": "train[40%:]"},  # datasets finds the splits
                                    {"path": "csv", "data_files": [str(tmp_path / "csv" / "extra.csv")]}],
                          test_datasets=[{"path": str(folder), "split": "test"}])
    summary = transform.run(cfg, None, out_dir)
    train = pq.read_table(out_dir / "train.parquet").to_pylist()
    assert [r["answer"] for r in train] == ["2", "3", "4", "007"]  # read_rows keeps CSV text as text
    assert summary["eval"] == 1
    assert sources.local_paths(cfg.datasets[1]) == [tmp_path / "csv" / "extra.csv"]
    # a folder read through data_files has no dataset config: a `name` there would be ignored, so it is refused
    named = TransformConfig(datasets=[{"path": str(tmp_path / "csv"), "name": "extra", "data_files": ["extra.csv"]}],
                            val_set_size=1)
    with pytest.raises(sources.SourceError, match="remove name"):
        transform.run(named, None, out_dir)


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    """An offline hub cache holding the dataset `org/sums` at two commits (data/train.parquet, data/test.parquet
    with different rows), refs/main on the first; blobs linked into the snapshots as huggingface_hub does."""
    cache = tmp_path / "hub"
    repo = cache / "datasets--org--sums"
    for n, commit in enumerate(COMMITS):
        for split, size in (("train", 6), ("test", 2)):
            blob = write_parquet(repo / "blobs" / f"{commit[:8]}-{split}", [{"problem": f"{split} {i} + {n}",
                                                                             "solution": str(i + n)}
                                                                            for i in range(size)])
            link = repo / "snapshots" / commit / "data" / f"{split}.parquet"
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(blob)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMITS[0])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets-cache"))
    return cache


HUB_SOURCES = {"datasets": [{"path": "org/sums", "split": "train[:3]"}],
               "test_datasets": [{"path": "org/sums", "split": "test"}],
               "question_field": "problem", "answer_field": "solution"}


@pytest.fixture
def transform_key(key_of):
    """transform_key(transform_section): the transform key the task would look up (no stage runs)."""
    return lambda section: key_of(stage_tasks.transform_task, {"transform": section, "sft": {"enabled": False}}, None)


def test_bytes_that_are_not_utf8_in_data_files_and_folders_are_bad_rows(files, tmp_path, out_dir):
    """A line with a byte that is not UTF-8, in a data_files file or a folder datasets reads, is a bad row naming
    its file and line (or its row and column), dropped and counted under `on_bad_rows: drop`."""
    lines = b'{"question": "q0", "answer": "1"}\n{"question": "bad \xff", "answer": "2"}\n'
    (tmp_path / "folder").mkdir()
    for path in (tmp_path / "bad.jsonl", tmp_path / "folder" / "train.jsonl"):
        path.write_bytes(lines)
    cfg = TransformConfig(datasets=[{"path": "json", "data_files": [str(files["qa"]), str(tmp_path / "bad.jsonl")]},
                                    {"path": str(tmp_path / "folder")}], test_datasets=[{"path": str(files["qa"])}])

    with pytest.raises(BadRowsError) as info:
        transform.run(cfg, None, out_dir)
    assert [(source, index) for source, index, _ in info.value.bad] == [("json (split=train)", 7),
                                                                         (f"{tmp_path / 'folder'} (split=train)", 1)]
    assert f"{tmp_path / 'bad.jsonl'}:2: bytes that are not UTF-8" in str(info.value)
    assert "row 1: column question: bytes that are not UTF-8" in str(info.value)

    summary = transform.run(cfg.model_copy(update={"on_bad_rows": "drop"}), None, out_dir)
    assert [(s["rows"], s["dropped"]) for s in summary["sources"][:2]] == [(7, 1), (1, 1)]


def test_a_hub_dataset_is_read_offline_from_the_cache_and_keyed_by_its_commit(hub_cache, transform_key, out_dir):
    cfg = TransformConfig(**HUB_SOURCES)
    assert sources.kind(cfg.datasets[0]) == "hub" and sources.hub_revision(cfg.datasets[0]) == COMMITS[0]
    summary = transform.run(cfg, None, out_dir)
    train = pq.read_table(out_dir / "train.parquet").to_pylist()
    assert [(r["prompt"][0]["content"], r["answer"]) for r in train] == [("train 0 + 0", "0"), ("train 1 + 0", "1"),
                                                                         ("train 2 + 0", "2")]
    assert summary["eval"] == 2 and summary["sources"][0]["source"] == "org/sums (split=train[:3])"

    first = transform_key(HUB_SOURCES)
    assert transform_key({**HUB_SOURCES, "val_set_seed": 1}) != first  # (options are keyed too)
    pinned = [{**s, "revision": COMMITS[0]} for s in HUB_SOURCES["datasets"]]
    assert transform_key({**HUB_SOURCES, "datasets": pinned}) == first  # the commit is keyed, not the branch name
    (hub_cache / "datasets--org--sums" / "refs" / "main").write_text(COMMITS[1])  # main moved to a new commit
    assert transform_key(HUB_SOURCES) != first
    transform.run(TransformConfig(**HUB_SOURCES), None, out_dir)
    assert pq.read_table(out_dir / "train.parquet").to_pylist()[0]["answer"] == "1"  # the new commit's rows


def test_a_hub_dataset_not_in_the_cache_offline_says_how_to_get_it(hub_cache, out_dir):
    cfg = TransformConfig(datasets=[{"path": "org/absent"}], val_set_size=0.5)
    with pytest.raises(SourceError, match=r"'org/absent' is not in the hub cache .*HF_HUB_OFFLINE is set.*"
                                          r"hf download org/absent --repo-type dataset"):
        transform.run(cfg, None, out_dir)
    missing = TransformConfig(datasets=[{"path": "data/nope.jsonl"}], val_set_size=0.5)
    with pytest.raises(FileNotFoundError, match=r"data/nope.jsonl does not exist"):
        transform.run(missing, None, out_dir)


def test_source_types_are_the_built_ins():
    assert tuple(transform.BUILTINS) == sources.BUILTIN_TYPES
    assert set(transform.SOURCE_FIELDS) <= set(TransformConfig.model_fields) & set(DatasetSource.model_fields)


def test_axolotl_top_level_keys_move_into_their_sections():
    cfg = PipelineConfig.model_validate({
        "base_model": "org/tiny", "revision_of_model": "v1", "datasets": [{"path": "org/sums"}],
        "test_datasets": [{"path": "org/sums", "split": "test"}], "sft": {"enabled": False}})
    assert (cfg.model.path, cfg.model.revision) == ("org/tiny", "v1")
    assert cfg.transform.datasets == [DatasetSource(path="org/sums")]
    assert cfg.transform.test_datasets[0].split == "test"
    held = PipelineConfig.model_validate({"datasets": [{"path": "a.jsonl"}], "val_set_size": 0.1,
                                          "transform": {"type": "messages"}, "sft": {"enabled": False}})
    assert (held.transform.val_set_size, held.transform.type) == (0.1, "messages")


@pytest.mark.parametrize("config, message", [
    ({"datasets": [{"path": "a.jsonl"}], "transform": {"datasets": [{"path": "b.jsonl"}], "val_set_size": 0.1}},
     r"<top level>: datasets \(axolotl's top-level key\) and transform.datasets are the same setting"),
    ({"base_model": "org/a", "model": {"path": "org/b"}}, r"base_model .* and model.path are the same setting"),
    ({"transform": {"datasets": [{"path": "a.jsonl"}], "paths": {"train": "a.jsonl"}, "val_set_size": 0.1}},
     r"transform: transform.datasets and transform.paths both name the rows"),
    ({"datasets": [{"path": "a.jsonl"}], "val_set_size": 0.1, "test_datasets": [{"path": "b.jsonl"}]},
     r"test_datasets and transform.val_set_size both make the eval split"),
    ({"test_datasets": [{"path": "b.jsonl"}]}, r"transform.test_datasets needs transform.datasets"),
    ({"datasets": [{"path": "tatsu-lab/alpaca", "type": "alpaca"}], "val_set_size": 0.1},
     r"transform.datasets.0: source 'tatsu-lab/alpaca': type 'alpaca' is not supported; use one of "
     r"question_answer, messages, text, nemo_gym, or your own transform as module.fn"),
    ({"datasets": [{"path": "a.jsonl", "type": "chat_template.default"}], "val_set_size": 0.1},
     r"type 'chat_template.default' is not supported"),
    ({"datasets": [{"path": "a.jsonl", "type": "completion"}], "val_set_size": 0.1},
     r"axolotl's completion is type: text here"),
    ({"datasets": [{"path": "a.jsonl"}], "val_set_size": 0.1, "sft": {"enabled": True}},  # asked for, no split
     r"sft.split is 'sft', but transform.datasets makes the prompts splits train, eval. Set sft.enabled: false"),
    ({"datasets": [{"path": "a.jsonl"}], "val_set_size": 1.5, "sft": {"enabled": False}},
     r"val_set_size 1.5: a fraction below 1 or a whole row count"),
])
def test_config_errors_name_the_keys(tmp_path, config, message):
    path = tmp_path / "config.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    with pytest.raises(ConfigError, match=message) as info:
        load_config(path)
    assert str(path) in str(info.value)


@pytest.fixture
def tracked(tmp_path, monkeypatch):
    """tracked(config) -> (RunContext, parent run id): a pipeline run's context on a store and MLflow under tmp."""
    from tasks.lineage import Lineage
    from tasks.reporting import Reporter

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    root = tmp_path / "artifacts"

    def tracked(config: dict):
        lineage = Lineage(root, "sources")
        parent = lineage.parent_id = lineage.client.create_run(lineage.experiment_id, run_name="sources").info.run_id
        config = PipelineConfig.model_validate({"artifacts_dir": str(root), **config})
        return stage_tasks.RunContext(config, ArtifactStore(root), lineage, Reporter(root, quiet=True)), parent

    return tracked


def test_a_datasets_config_runs_through_the_prefect_tasks(prefect_harness, files, tracked):
    """prepare_policy with transform.datasets: the real transform task (cached on the second call, recomputed
    when a source file changes), per-source counts as tags on the run, and the base model built on its rows."""
    from flows.run import prepare_policy

    ctx, parent = tracked({
        "datasets": [{"path": str(files["qa"])}, {"path": str(files["chats"]), "type": "messages",
                                                  "messages_field": "chat"}],
        "val_set_size": 2, "sft": {"enabled": False},
        "model": {"hidden_size": 64, "num_attention_heads": 1, "num_key_value_heads": 1, "intermediate_size": 128,
                  "num_hidden_layers": 1, "vocab_size": 300}})
    lineage = ctx.lineage

    prompts, base, policy = prepare_policy(ctx, parent)
    assert (prompts.manifest["summary"]["train"], prompts.manifest["summary"]["eval"]) == (8, 2)
    assert policy is base
    tags = lineage.client.get_run(parent).data.tags
    assert int(tags["transform.source_rows.datasets.0"]) + int(tags["transform.source_rows.datasets.1"]) == 10
    assert tags["transform.source.datasets.1"] == f"{files['chats']} (split=train)"

    assert stage_tasks.transform_task(ctx, None).reused  # the real Prefect task: the same key, cached
    write_jsonl(files["qa"], [{"question": "add 9 and 1", "answer": "10"}] * 6)  # an edited source
    again = stage_tasks.transform_task(ctx, None)
    assert not again.reused and again.key != prompts.key


def test_a_data_version_replaces_the_train_sources_and_keeps_test_datasets(prefect_harness, files, tracked, tmp_path):
    from flows import retrain

    version = write_jsonl(tmp_path / "new.jsonl", [{"question": f"new {i}", "answer": str(i)} for i in range(5)])
    test = [{"path": str(files["test"]), "question_field": "q", "answer_field": "a"}]
    ctx, parent = tracked({"datasets": [{"path": str(files["qa"])}], "test_datasets": test,
                           "sft": {"enabled": False}, "data": {"version": "latest"}})
    retrain.add_data(ctx.config, version)

    prompts = retrain.data_version_prompts(ctx, parent, None, None)
    assert [r["prompt"][0]["content"] for r in pq.read_table(prompts.file("train.parquet")).to_pylist()] == \
        [f"new {i}" for i in range(5)]
    assert prompts.manifest["summary"]["eval"] == 3  # the config's test_datasets, as they were

    held, parent = tracked({"datasets": [{"path": str(files["qa"])}], "val_set_size": 2,
                            "sft": {"enabled": False}, "data": {"version": "latest"}})
    with pytest.raises(retrain.RetrainError, match=r"data.version with transform.datasets needs the held-out rows "
                                                   r"as transform.test_datasets"):
        retrain.data_version_prompts(held, parent, None, None)
