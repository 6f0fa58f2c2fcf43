"""EBFT strided mode (stages/training/ebft_strided.py): the strided attention pattern against a hand-written one,
block-parallel generation against each block sampled on its own, the config, the document data path,
and a tiny run whose feature-matching reward rises."""

import pyarrow.parquet as pq
import pytest
import torch

from test_ebft import _config

from flows.config import ConfigError
from stages.rollout.engines import Policy
from stages.training import ebft, ebft_strided, grpo


def test_anchors_leave_room_for_a_whole_block():
    assert ebft_strided.anchors(40, 8, 8, 8) == [8, 16, 24, 32]
    assert ebft_strided.anchors(39, 8, 8, 8) == [8, 16, 24]  # a block from 32 would end past the document
    assert ebft_strided.anchors(30, 6, 5, 4) == [6, 11, 16, 21, 26]
    assert ebft_strided.anchors(15, 8, 8, 8) == []


def test_strided_attention_hand_example():
    """A document of 4 tokens, blocks at anchors 2 and 3, two generated tokens each. Layout: doc 0-3, then
    step 0 of block 0 (4) and of block 1 (5), step 1 of block 0 (6) and of block 1 (7). Block 0 reads
    doc[:2] and its own tokens; block 1 reads doc[:3] and its own; positions continue from the anchors."""
    allowed, positions = ebft_strided.strided_attention(4, [2, 3], steps=2)
    expected = [
        # 0  1  2  3  4  5  6  7
        [1, 0, 0, 0, 0, 0, 0, 0],  # doc: causal
        [1, 1, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0, 0],
        [1, 1, 0, 0, 1, 0, 0, 0],  # block 0, step 0
        [1, 1, 1, 0, 0, 1, 0, 0],  # block 1, step 0
        [1, 1, 0, 0, 1, 0, 1, 0],  # block 0, step 1
        [1, 1, 1, 0, 0, 1, 0, 1],  # block 1, step 1
    ]
    assert allowed.int().tolist() == expected
    assert positions.tolist() == [0, 1, 2, 3, 2, 3, 3, 4]


def _random_model(attn_implementation: str):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, intermediate_size=64, attn_implementation=attn_implementation)
    return Qwen2ForCausalLM(config).eval()


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_block_parallel_generation_equals_each_block_on_its_own(attn_implementation):
    """Every block's sampling log-probs are those of doc[:anchor] + the block read causally on its own, and
    the hidden states of the strided pass over all blocks are those of each block's own pass; greedy
    blocks are what greedy decoding of doc[:anchor] writes."""
    model = _random_model(attn_implementation)
    doc = torch.randint(0, 50, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    anchors = ebft_strided.anchors(len(doc), 6, 5, 4)
    tokens, logprobs = ebft_strided.generate_blocks(model, doc, anchors, 4, 3, temperature=0.7,
                                                    generator=torch.Generator().manual_seed(0))
    assert tokens.shape == logprobs.shape == (3, len(anchors), 4)
    with torch.no_grad():
        for s in range(3):
            for b, a in enumerate(anchors):
                logits = model(torch.tensor([doc[:a] + tokens[s, b].tolist()])).logits[0, a - 1 : a + 3] / 0.7
                own = torch.log_softmax(logits, -1).gather(-1, tokens[s, b].unsqueeze(-1)).squeeze(-1)
                torch.testing.assert_close(logprobs[s, b], own, atol=1e-5, rtol=0)
        allowed, positions = ebft_strided.strided_attention(len(doc), anchors, 4)
        sequence = torch.cat([torch.tensor(doc), tokens[0].T.reshape(-1)]).unsqueeze(0)
        hidden = model.model(input_ids=sequence, attention_mask=ebft_strided.additive_mask(allowed, 1, torch.float32),
                             position_ids=positions.unsqueeze(0)).last_hidden_state[0]
        for b, a in enumerate(anchors):
            own = model.model(input_ids=torch.tensor([doc[:a] + tokens[0, b].tolist()])).last_hidden_state[0, a:]
            torch.testing.assert_close(hidden[len(doc) + torch.arange(4) * len(anchors) + b], own, atol=1e-5, rtol=0)
        greedy, _ = ebft_strided.generate_blocks(model, doc, anchors, 4, 1, greedy=True)
        for b, a in enumerate(anchors):
            written = model.generate(torch.tensor([doc[:a]]), max_new_tokens=4, min_new_tokens=4, do_sample=False,
                                     pad_token_id=0)[0, a:]
            assert greedy[0, b].tolist() == written.tolist()


def test_config_strided_options(tmp_path):
    cfg = _config(tmp_path, "rl: ebft\nebft: {mode: strided}\n")
    assert (cfg.ebft.stride, cfg.ebft.context_length, cfg.ebft.generate_max_len) == (8, 8, 8)  # axolotl's
    assert cfg.rollout.max_completion_length == 8
    cfg = _config(tmp_path, "rl: ebft\nebft: {mode: strided, stride: 4, context_length: 16}\n"
                            "rollout: {max_completion_length: 6}\n")
    assert (cfg.ebft.stride, cfg.ebft.context_length, cfg.ebft.generate_max_len) == (4, 16, 6)
    with pytest.raises(ConfigError, match="ebft.stride belongs to mode: strided"):
        _config(tmp_path, "rl: ebft\nebft: {stride: 8}\n")
    with pytest.raises(ConfigError, match="ebft.context_length belongs to mode: strided"):
        _config(tmp_path, "rl: ebft\nebft: {context_length: 8}\n")
    assert _config(tmp_path, "rl: ebft\nebft: {mode: strided, embed_method: mean_pooling}\n").ebft.pooling == \
        "completion_mean"  # axolotl's strided mean_pooling: the block's tokens, not the document prefix
    assert _config(tmp_path, "rl: ebft\nebft: {embed_method: mean_pooling}\n").ebft.pooling == "mean_pooling"
    with pytest.raises(ConfigError, match="ebft.embed_method: concat is not used in mode: strided"):
        _config(tmp_path, "rl: ebft\nebft: {mode: strided, embed_method: concat}\n")
    with pytest.raises(ConfigError, match="ebft.ground_truth belongs to mode: structured"):
        _config(tmp_path, "rl: ebft\nebft: {mode: strided, ground_truth: '{text}'}\n")
    with pytest.raises(ConfigError, match="rollout.engine must be transformers"):
        _config(tmp_path, "rl: ebft\nebft: {mode: strided}\nrollout: {engine: vllm}\n")
    with pytest.raises(ConfigError, match="rollout.worker_process must be false"):
        _config(tmp_path, "rl: ebft\nebft: {mode: strided}\nrollout: {worker_process: true}\n")
    with pytest.raises(ConfigError, match=r"grpo.reroll_start_fraction must be 1.0 \(off\)"):
        _config(tmp_path, "rl: ebft\nebft: {mode: strided}\ngrpo: {reroll_start_fraction: 0.5}\n")
    with pytest.raises(ConfigError, match="ebft.mode: got 'stride'.*'strided'"):
        _config(tmp_path, "rl: ebft\nebft: {mode: stride}\n")
    with pytest.raises(ConfigError, match="did you mean 'ebft.context_length'"):
        _config(tmp_path, "rl: ebft\nebft: {mode: strided, context_len: 8}\n")
    with pytest.raises(ConfigError, match="ebft.stride"):
        _config(tmp_path, "rl: ebft\nebft: {mode: strided, stride: 0}\n")


def test_text_transform_and_demo_documents(tmp_path):
    """transform.type text keeps a document column as `text` with no prompt; a row without one is named;
    demo_data.records_per_document writes documents whose sft split states the teacher's answers."""
    import json

    from stages.data import demo_data, transform

    raw = tmp_path / "docs.jsonl"
    raw.write_text(json.dumps({"body": "one two"}) + "\n" + json.dumps({"body": ""}) + "\n")
    cfg = transform.TransformConfig(type="text", text_field="body")
    with pytest.raises(transform.BadRowsError, match=r"docs.jsonl \(train\) row 1: missing or empty field body"):
        transform.run(cfg, {"train": raw}, tmp_path)
    raw.write_text(json.dumps({"body": "one two", "source": "a"}) + "\n")
    transform.run(cfg, {"train": raw}, tmp_path)
    assert pq.read_table(tmp_path / "train.parquet").to_pylist() == [
        {"prompt_id": "train-000000", "prompt": [], "answer": "", "source": "a", "text": "one two"}]
    demo = demo_data.DemoDataConfig(records_per_document=3, num_sft=4, num_train=4, num_eval=2, teacher_accuracy=0.0)
    out = tmp_path / "demo"
    out.mkdir()
    assert demo_data.run(demo, out) == {"eval": 2, "sft": 4, "train": 4}
    for split in demo_data.SPLITS:
        for row in pq.read_table(out / f"{split}.parquet").to_pylist():
            lines = row["text"].splitlines()
            assert len(lines) == 3 and all(line.startswith("The largest of ") for line in lines)
            for line in lines:
                numbers = [int(n) for n in line.removeprefix("The largest of ").split(" is ")[0].split(", ")]
                stated = int(line.rsplit(" is ", 1)[1].rstrip("."))
                assert stated == (sorted(numbers)[-2] if split == "sft" else max(numbers))  # teacher: always wrong


@pytest.fixture(scope="module")
def digit_documents(tmp_path_factory):
    """A tiny untrained policy (root / "model") whose tokenizer learned random digit strings "3 7 1 ...", those
    strings as text rows (root / "sft"), and ten documents that only repeat "7", of 16 to 25 digits (root / "docs")."""
    import json
    import random

    from conftest import tiny_model

    from stages.data import transform

    root = tmp_path_factory.mktemp("strided")
    rng = random.Random(0)
    random_digits = [" ".join(str(rng.randrange(10)) for _ in range(24)) for _ in range(300)]
    tiny_model(root, random_digits)
    (root / "sft.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in random_digits))
    (root / "sft").mkdir()
    transform.run(transform.TransformConfig(type="text"), {"sft": root / "sft.jsonl"}, root / "sft")
    (root / "docs.jsonl").write_text("\n".join(json.dumps({"text": " ".join(["7"] * (16 + i))}) for i in range(10)))
    (root / "docs").mkdir()
    transform.run(transform.TransformConfig(type="text"), {"train": root / "docs.jsonl"}, root / "docs")
    return root


@pytest.fixture(scope="module")
def sevens(digit_documents):
    """digit_documents with root / "policy": its model trained by language modelling (sft.run on the raw digit
    strings), a policy that writes random digits, for the strided rounds."""
    from stages.training import sft

    root = digit_documents
    sft.run(sft.SFTConfig(completion_field="text", num_train_epochs=15, learning_rate=1e-2, save_steps=None),
            root / "model", root / "sft" / "sft.parquet", root / "policy")
    return root


@pytest.mark.slow  # a whole run or process kill: `make test`, not `make test-fast`
def test_tiny_strided_run_lowers_the_feature_matching_distance(sevens):
    """Strided rollout -> EBFT score (the frozen starting policy's features against each block's real
    continuation) -> GRPO optimize, 8 rounds, on documents of sevens, from a policy that writes random digits:
    the feature-matching distance falls (measured 0.016 -> 0.010 over the last three rounds) and blocks that
    equal the document's continuation get more frequent (0.3% -> 3.4%). learning_rate 5e-3: at 1e-2 one round
    spiked (distance 0.29 at round 4) on an AVX-512 machine, and the last rounds had not recovered. The mean reward
    is not the yardstick
    here: alignment minus diversity is ~0 both for unrelated samples and for n samples that all equal the
    reference. The rows keep where each block came from (document, anchor, the document's own text)."""
    from stages.rollout.rollout import RolloutConfig

    root = sevens
    model = root / "policy"
    cfg = ebft.EBFTConfig(mode="strided", stride=4, context_length=8, generate_max_len=4,
                          embed_method="completion_mean", advantage_estimator="grpo")
    rollout_cfg = RolloutConfig(num_generations=8, prompts_per_round=10, max_completion_length=4)
    grpo_cfg = grpo.GRPOConfig(learning_rate=5e-3, micro_batch_size=64, gradient_accumulation_steps=1, lora_r=8,
                               lora_alpha=16)
    adapter, distances, exact = None, [], []
    for r in range(8):
        d = root / f"r{r}"
        d.mkdir()
        summary = ebft_strided.rollout(cfg, rollout_cfg, Policy(model, adapter_dir=adapter, version=r),
                                       root / "docs" / "train.parquet", r, d)
        assert summary["documents"] == 10 and summary["documents_too_short"] == 0
        distances.append(ebft.run(cfg, d / "rollouts.parquet", model, 8, "group", d)["ebft/feature_distance"])
        rows = pq.read_table(d / "scored.parquet").to_pylist()
        exact.append(sum(r["completion_token_ids"] == r["reference_token_ids"] for r in rows) / len(rows))
        grpo.run(grpo_cfg, model, adapter, d / "scored.parquet", r, 1.0, 4, d)
        adapter = d
    first = pq.read_table(root / "r0" / "scored.parquet").to_pylist()[0]
    assert first["prompt_id"] == f"{first['document_id']}@{first['anchor']}" and first["anchor"] == 8
    assert len(first["prompt_token_ids"]) == 8 and len(first["completion_token_ids"]) == 4
    assert first["reference"] == "7 7 " and set(dict(first["rewards"])) == {"alignment", "diversity"}
    assert sum(distances[-3:]) / 3 < 0.75 * distances[0], distances
    assert sum(exact[-3:]) / 3 > exact[0] + 0.01, exact


def test_documents_that_do_not_fit_are_named(digit_documents, tmp_path):
    """Prompt rows without a document column, and documents too short for one block, fail with the file
    and what to change; a short document among others is skipped and counted."""
    from stages.rollout.rollout import RolloutConfig

    policy = Policy(digit_documents / "model")  # untrained: what fits is a matter of tokens
    rollout_cfg = RolloutConfig(num_generations=2, prompts_per_round=10, max_completion_length=4)
    docs = digit_documents / "docs" / "train.parquet"
    too_long = ebft.EBFTConfig(mode="strided", stride=4, context_length=60, generate_max_len=4)
    with pytest.raises(ValueError, match=r"train.parquet: none of the round's 10 documents has room for one block "
                                         r".*context_length \+ ebft.generate_max_len = 64 tokens"):
        ebft_strided.rollout(too_long, rollout_cfg, policy, docs, 0, tmp_path)
    some = ebft.EBFTConfig(mode="strided", stride=4, context_length=40, generate_max_len=4)  # 16-25 digits:
    # 31-49 tokens
    summary = ebft_strided.rollout(some, rollout_cfg, policy, docs, 0, tmp_path)
    assert summary["documents"] == 3 and summary["documents_too_short"] == 7
    questions = digit_documents / "sft" / "sft.parquet"
    pq.write_table(pq.read_table(questions).drop(["text"]), tmp_path / "questions.parquet")
    with pytest.raises(ValueError, match=r"questions.parquet: ebft.mode strided reads documents from column 'text'"):
        ebft_strided.rollout(some, rollout_cfg, policy, tmp_path / "questions.parquet", 0, tmp_path)


AXOLOTL_STRIDED_STRUCTURED = '''
def transform(cfg, *args, **kwargs):
    seq_len = cfg.sequence_len

    def transform_fn(example, tokenizer=None):
        prompt_text = example.get("input", example.get("prompt", example.get("question", "")))
        completion_text = example.get("output", example.get("completion", example.get("answer", "")))
        if tokenizer is None:
            return {"prompt": prompt_text}
        pad_id = tokenizer.pad_token_id or tokenizer.eos_token_id
        prompt_enc = tokenizer(prompt_text, truncation=False, add_special_tokens=True, return_tensors=None)
        completion_enc = tokenizer(completion_text, truncation=False, add_special_tokens=False, return_tensors=None)
        prompt_ids = prompt_enc["input_ids"]
        completion_ids = completion_enc["input_ids"]
        total_len = len(prompt_ids) + len(completion_ids)
        if total_len > seq_len:
            max_completion = seq_len - len(prompt_ids)
            if max_completion < 1:
                prompt_ids = prompt_ids[: seq_len - 1]
                completion_ids = completion_ids[:1]
            else:
                completion_ids = completion_ids[:max_completion]
        input_ids = prompt_ids + completion_ids
        prompt_length = len(prompt_ids)
        labels = [-100] * prompt_length + completion_ids
        pad_len = seq_len - len(input_ids)
        attention_mask = [1] * len(input_ids) + [0] * pad_len
        labels = labels + [-100] * pad_len
        input_ids = input_ids + [pad_id] * pad_len
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels,
                "prompt_length": prompt_length}

    return transform_fn, {"remove_columns": "__all__"}
'''
"""axolotl's examples/ebft/ebft_strided_structured.py (its comments left out): what the built-in of that name must
tokenize as."""


@pytest.fixture(scope="module")
def digits_model(tmp_path_factory):
    """tiny_model (untrained) with a tokenizer trained on digit strings, under <root>/model."""
    import random

    from conftest import tiny_model

    root = tmp_path_factory.mktemp("digits")
    rng = random.Random(0)
    tiny_model(root, [" ".join(str(rng.randrange(10)) for _ in range(24)) for _ in range(100)])
    return root / "model"


def test_prompt_completion_rows_are_tokenized_as_axolotls_transform_does(digits_model, tmp_path, monkeypatch):
    """The built-in ebft_strided_structured.transform's rows, tokenized by the strided rollout, are the tokens and
    prompt length axolotl's own transform makes with the same tokenizer and sequence_len (uncut, completion cut,
    prompt cut); the anchors start min_completion_prefix tokens into the completion (context_length when that is
    further), and the axolotl names of raw fields are read in its order."""
    import json
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from stages.data import transform

    (tmp_path / "axolotl_strided.py").write_text(AXOLOTL_STRIDED_STRUCTURED)
    monkeypatch.syspath_prepend(str(tmp_path))
    from axolotl_strided import transform as axolotl_transform

    tokenizer = AutoTokenizer.from_pretrained(digits_model)
    raw = [{"input": "3 1 4", "output": "7 7 7 7 7 7 7 7 7 7 7 7 7 7 7 7 7 7 7 7", "question": "not read"},
           {"prompt": "2 7 1 8 2 8 1 8 2 8 4 5 9 0", "completion": "7 7 7 7 7 7 7 7 7 7 7 7 7 7 7 7"},
           {"question": "5 5", "answer": "7 7 7 7 7 7 7 7 7 7 7 7 7 7 7 7 7 7 7 7 7 7 7 7 7 7 7 7"}]
    (tmp_path / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in raw))
    transform.run(transform.TransformConfig(type="ebft_strided_structured.transform"),
                  {"train": tmp_path / "rows.jsonl"}, tmp_path)
    rows = pq.read_table(tmp_path / "train.parquet").to_pylist()
    assert [r["document_prompt"] for r in rows] == ["3 1 4", "2 7 1 8 2 8 1 8 2 8 4 5 9 0", "5 5"]
    for cap in (64, 20, 6):  # uncut; the completion cut; the prompt cut (one completion token kept)
        theirs, _ = axolotl_transform(SimpleNamespace(sequence_len=cap))
        for example, row in zip(raw, rows):
            made = theirs(example, tokenizer=tokenizer)
            ids, prompt_tokens = ebft_strided.document_ids(tokenizer, row, "rows", max_tokens=cap)
            assert ids == made["input_ids"][: sum(made["attention_mask"])]
            assert prompt_tokens == made["prompt_length"]
    cfg = ebft.EBFTConfig(mode="strided", stride=4, context_length=8, generate_max_len=4, min_completion_prefix=2)
    ids, prompt_tokens = ebft_strided.document_ids(tokenizer, rows[1], "rows")
    assert prompt_tokens == len(tokenizer(rows[1]["document_prompt"])["input_ids"]) > 8
    blocks = ebft_strided.document_anchors(cfg, len(ids), prompt_tokens)
    assert blocks[0] == prompt_tokens + 2 and {b - a for a, b in zip(blocks, blocks[1:])} == {4}
    assert blocks[-1] + 4 <= len(ids) < blocks[-1] + 8  # every block that fits, the last one included
    ids, prompt_tokens = ebft_strided.document_ids(tokenizer, rows[0], "rows")
    assert prompt_tokens + 2 < 8 and ebft_strided.document_anchors(cfg, len(ids), prompt_tokens)[0] == 8  # context


def test_a_strided_round_on_prompt_completion_rows_writes_blocks_in_the_completion(digits_model, tmp_path):
    """The rollout's blocks on prompt + completion rows: each block's prompt is the row's prompt and a part of its
    completion (at least min_completion_prefix tokens of it), and its reference is the completion's next tokens."""
    import json

    from stages.data import transform
    from stages.rollout.rollout import RolloutConfig

    raw = [{"input": "1 2 3 4 5 6 7 8 9 0", "output": " ".join(["7"] * (12 + i))} for i in range(4)]
    (tmp_path / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in raw))
    transform.run(transform.TransformConfig(type="ebft_strided_structured.transform"),
                  {"train": tmp_path / "rows.jsonl"}, tmp_path)
    cfg = ebft.EBFTConfig(mode="strided", stride=4, context_length=4, generate_max_len=4, min_completion_prefix=3)
    summary = ebft_strided.rollout(cfg, RolloutConfig(num_generations=2, prompts_per_round=4, max_completion_length=4),
                                   Policy(digits_model), tmp_path / "train.parquet", 0, tmp_path)
    assert summary["documents"] == 4
    rows = pq.read_table(tmp_path / "rollouts.parquet").to_pylist()
    from transformers import AutoTokenizer

    prompt = AutoTokenizer.from_pretrained(digits_model)(raw[0]["input"])["input_ids"]
    assert min(r["anchor"] for r in rows) == len(prompt) + 3
    for r in rows:
        assert r["prompt_token_ids"][: len(prompt)] == prompt and len(r["prompt_token_ids"]) == r["anchor"]
        assert set(r["reference"].split()) == {"7"} and "document_prompt" not in r
    with pytest.raises(ConfigError, match=r"ebft.min_completion_prefix: 3 places blocks after a prompt, and "
                                          r"transform.type text makes raw documents"):
        _config(tmp_path, "rl: ebft\nebft: {mode: strided, min_completion_prefix: 3}\ntransform: {type: text}\n")
    with pytest.raises(ConfigError, match="ebft.min_completion_prefix belongs to mode: strided"):
        _config(tmp_path, "rl: ebft\nebft: {min_completion_prefix: 3}\n")


def test_keys_cover_the_blocks_and_the_feature_model(monkeypatch, tmp_path):
    """A strided rollout's key changes with what decides its blocks (stride, context_length, generate_max_len)
    and not with the score-only options; a strided eval's key changes with the frozen feature model."""
    from conftest import Quiet
    from test_cache_keys import artifact

    from flows.config import PipelineConfig
    from tasks import stage_tasks
    from tasks.store import ArtifactStore

    monkeypatch.setattr(stage_tasks, "materialize", lambda ctx, stage, call, **_:
                        stage_tasks.artifact_key(ctx.store, stage, call))

    def context(ebft_options: dict):
        config = {"rl": "ebft", "ebft": {"mode": "strided", **ebft_options}}
        return stage_tasks.RunContext(PipelineConfig.model_validate(config), ArtifactStore(tmp_path / "artifacts"),
                                      lineage=None, reporter=Quiet())

    policy, prompts = artifact("sft", tmp_path), artifact("transform", tmp_path)
    def rollout_key(options: dict) -> str:
        return stage_tasks.strided_rollout_task.fn(context(options), policy, None, prompts, 0, 0)

    keys = {rollout_key({}), rollout_key({"stride": 4}), rollout_key({"context_length": 16}),
            rollout_key({"generate_max_len": 4})}
    assert len(keys) == 4
    assert rollout_key({"diversity_coef": 0.5}) == rollout_key({})  # scoring, not sampling
    eval_key = lambda feature_model: stage_tasks.strided_eval_task.fn(  # noqa: E731
        context({}), policy, prompts, label="final",
        feature_model=artifact(feature_model, tmp_path) if feature_model else None)
    assert len({eval_key(None), eval_key("sft"), eval_key("other_policy")}) == 2  # None: the evaluated model itself


@pytest.mark.slow
def test_strided_pipeline_end_to_end_then_cached(prefect_harness, tiny_config, tmp_path):
    """ebft.mode: strided through the flow, on the demo task written as documents: language-modelling SFT,
    strided rollouts whose rows name their document and anchor, eval on the held-out documents' blocks
    (eval/accuracy, eval/feature_distance in MLflow), and a rerun that computes nothing."""
    import json

    from mlflow import MlflowClient

    from conftest import computed
    from flows.pipeline import posttrain_pipeline
    from tasks.store import MANIFEST

    root = tmp_path / "artifacts"
    overrides = ["rl=ebft", "ebft.mode=strided", "grpo.rounds=2", "transform.type=text",
                 "demo_data.records_per_document=2", "demo_data.num_sft=150", "demo_data.num_train=32",
                 "demo_data.num_eval=12", "sft.completion_field=text"]
    first = posttrain_pipeline(str(tiny_config), overrides, quiet=True)
    assert [row["stage"] for row in first["stages"]] == [
        "demo_data", "transform", "base_model", "sft", "eval base", "rollout r0", "score r0", "optimize r0",
        "rollout r1", "score r1", "optimize r1", "export", "eval final"]
    for folder in (root / "rollout").iterdir():
        rows = pq.read_table(folder / "rollouts.parquet").to_pylist()
        assert {r["engine"] for r in rows} == {"transformers+strided"}
        assert all(r["prompt_id"] == f"{r['document_id']}@{r['anchor']}" and len(r["completion_token_ids"]) == 8
                   and len(r["reference_token_ids"]) == 8 for r in rows)
    final = json.loads((root / "eval" / first["stages"][-1]["path"].rsplit("/", 1)[-1] / MANIFEST).read_text())
    assert {"accuracy", "feature_distance", "exact_blocks", "constant_baseline", "num_blocks"} <= set(final["summary"])
    assert final["inputs"]["feature_model"].startswith("sft/")
    assert first["final_accuracy"] == final["summary"]["accuracy"] and first["eval_prompts"] == 12
    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    for name in ("eval/accuracy", "eval/feature_distance"):
        assert [m.step for m in client.get_metric_history(first["mlflow_run_id"], name)] == [0, 2], name
    second = posttrain_pipeline(str(tiny_config), overrides, quiet=True)
    assert computed(second) == []
