"""A stage's outputs depend on its inputs only, not on what else the process does meanwhile.

The pipeline runs a rollout in a Prefect task thread beside an eval (eval.every_rounds) or, with
rollout.async_prefetch, beside an optimize round; a resumed run recomputes a stage alone in a new process.
Both must give the uninterrupted run's bytes (the chaos benchmark compares final metrics).
"""

from __future__ import annotations

import threading

import pytest

from tests.conftest import output_logits_logps, tiny_say_policy

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    """The tiny "say i" model and a LoRA adapter on it with non-zero B (so it changes the samples)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    root = tiny_say_policy(tmp_path_factory.mktemp("det"), 8)
    torch.manual_seed(1)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(root / "model"),
                           LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    model.save_pretrained(root / "adapter")
    return root


def _prompts(n: int = 24) -> list[list[dict]]:
    return [[{"role": "user", "content": f"say {i % 8}"}] for i in range(n)]


def _sample(root, sampling, adapter=True):
    from stages.rollout.engines import Policy
    from stages.rollout.engines.hf import TransformersEngine

    engine = TransformersEngine(batch_size=8)
    policy = Policy(base_dir=root / "model", adapter_dir=root / "adapter" if adapter else None)
    return [(o["completion_token_ids"], o["sampling_logprobs"]) for o in engine.generate(policy, _prompts(), sampling)]


def _sampling(temperature: float = 1.0, top_p: float = 1.0):
    from stages.rollout.engines import Sampling

    return Sampling(max_new_tokens=12, do_sample=True, temperature=temperature, top_p=top_p, seed=7)


def test_samples_are_those_of_the_seeded_global_rng(policy):
    """The rollout's own generator gives the tokens that torch.manual_seed(seed) + HF's sampling gave
    (BENCHMARKS.md was measured with that stream)."""
    from stages.rollout.engines.hf import _generate
    from stages.runtime.policy import load_policy

    for sampling in (_sampling(), _sampling(temperature=0.7, top_p=0.9)):
        model, tokenizer = load_policy(policy / "model", policy / "adapter")
        torch.manual_seed(sampling.seed)
        old = [o["completion_token_ids"] for o in _generate(model, tokenizer, _prompts(), sampling, 8, None)]
        assert [ids for ids, _ in _sample(policy, sampling)] == old


def test_sampling_logprobs_are_the_raw_logits_log_softmax_of_each_sampled_token(policy):
    """The engine's recorded log-probs (SampledTokenLogps, a logits processor keeping one step at a time) are
    log softmax(raw logits / temperature)[token] of every step's raw logits as `output_logits` returns them,
    bit for bit, and the tokens are those sampled without it: transformers runs the caller's processors
    before its temperature and top-p warpers (a transformers that did not would fail here)."""
    from stages.runtime.policy import load_policy

    model, tokenizer = load_policy(policy / "model", policy / "adapter")
    for sampling in (_sampling(), _sampling(temperature=0.7, top_p=0.9)):
        recorded = _sample(policy, sampling)[:8]  # the first batch of 8
        new, expected = output_logits_logps(model, tokenizer, _prompts()[:8], sampling)
        for row, (ids, logps) in enumerate(recorded):
            assert ids == new[row, : len(ids)].tolist()
            assert logps == expected(row, ids)


def test_token_prompts_sample_as_their_conversations(policy):
    """A prompt given as its token ids ({"prompt_token_ids": ...}, what the Atropos policy server's /generate
    sends) samples what the conversation it came from samples; the padded batch is the one tokenizing the
    chat-templated texts gives."""
    from stages.rollout.engines import prompt_token_ids
    from stages.runtime.policy import load_policy

    _, tokenizer = load_policy(policy / "model", None)
    texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in _prompts(5)]
    ids = prompt_token_ids(tokenizer, _prompts(5))
    by_text = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    by_ids = tokenizer.pad({"input_ids": ids}, return_tensors="pt")
    assert torch.equal(by_text["input_ids"], by_ids["input_ids"])
    assert torch.equal(by_text["attention_mask"], by_ids["attention_mask"])

    from stages.rollout.engines import Policy
    from stages.rollout.engines.hf import TransformersEngine

    tokens = [{"prompt_token_ids": i} for i in prompt_token_ids(tokenizer, _prompts())]
    engine, model = TransformersEngine(batch_size=8), Policy(base_dir=policy / "model", adapter_dir=policy / "adapter")
    assert engine.generate(model, tokens, _sampling()) == engine.generate(model, _prompts(), _sampling())
    with pytest.raises(ValueError, match="prompt_token_ids, a non-empty list of ints"):
        prompt_token_ids(tokenizer, [{"prompt_token_ids": []}])


def test_rollout_ignores_other_threads(policy):
    """Samples are the same whether or not another thread reseeds, draws from torch's global RNG and loads
    LoRA policies meanwhile (an eval beside a rollout, an optimize round beside a prefetched rollout)."""
    from stages.runtime.policy import load_policy

    alone = _sample(policy, _sampling())
    stop, disturbances = threading.Event(), []

    def disturb():
        while not stop.is_set():
            torch.manual_seed(len(disturbances))
            torch.rand(1000)
            load_policy(policy / "model", policy / "adapter")
            disturbances.append(1)

    thread = threading.Thread(target=disturb)
    thread.start()
    try:
        beside = _sample(policy, _sampling())
    finally:
        stop.set()
        thread.join()
    assert disturbances
    assert beside == alone


def test_loading_and_eval_draw_nothing_from_the_global_rng(policy, tmp_path):
    """load_policy (PEFT would otherwise initialize the adapter's layers randomly before loading them) and
    the greedy eval leave torch's global RNG as it was, so they cannot shift a concurrent optimize round's."""
    from stages.data import transform# noqa: F401
    from stages.evaluation import evaluate# noqa: F401
    from stages.runtime.policy import load_policy

    state = torch.get_rng_state()
    load_policy(policy / "model", policy / "adapter")
    (tmp_path / "out").mkdir()
    evaluate.run(evaluate.EvalConfig(split="train", max_completion_length=4), policy / "model", policy / "adapter",
                 policy / "prompts" / "train.parquet", tmp_path / "out")
    assert torch.equal(torch.get_rng_state(), state)


def test_max_prompt_length_keeps_the_end_of_each_prompt(policy, tmp_path):
    """rollout.max_prompt_length: the engine samples from the last N chat-templated prompt tokens (TRL's former
    left truncation), the rollouts record those tokens, and the round counts the prompts cut."""
    import pyarrow.parquet as pq
    from pydantic import ValidationError

    from stages.rollout import rollout
    from stages.rollout.engines import Policy, prompt_token_ids
    from stages.runtime.policy import load_policy

    cfg = rollout.RolloutConfig(num_generations=2, prompts_per_round=4, max_completion_length=4, max_prompt_length=5)
    metrics = rollout.run(cfg, Policy(policy / "model"), policy / "prompts" / "train.parquet", 0, tmp_path)

    rows = pq.read_table(tmp_path / "rollouts.parquet").to_pylist()
    _, tokenizer = load_policy(policy / "model", None)
    full = prompt_token_ids(tokenizer, [r["prompt"] for r in rows])
    assert all(len(f) > 5 for f in full) and metrics["prompts_truncated_frac"] == 1.0
    assert [r["prompt_token_ids"] for r in rows] == [f[-5:] for f in full]
    with pytest.raises(ValidationError, match="rollout.max_prompt_length cuts the prompts the engine samples"):
        rollout.RolloutConfig(max_prompt_length=5, rollout_func="mod.fn")
