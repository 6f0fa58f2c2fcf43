"""The optimize stage's options (issue 6 part 4): skip_zero_advantage_batches, mask_truncated_completions,
num_iterations, optim, the learning-rate schedule, optimizer state across rounds.

One tiny random policy (2 layers, width 64) samples one round of rollouts; each test rewrites that
round's advantages / finish reasons by hand into a scored parquet and calls grpo.run directly.
"""

from __future__ import annotations

import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import tiny_round, write_scored
from pydantic import ValidationError

from stages.data.schemas import REPLAYED, write_table
from stages.runtime import devices
from stages.training import grpo, logprobs

ROWS = 32  # 8 prompts x 4 generations
ADVANTAGES = [1.0, -0.5, 0.8, -1.3]  # per group index: both signs, none zero


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(root, rollout rows): a tiny policy and one round of its rollouts, unscored."""
    root = tmp_path_factory.mktemp("grpo_options")
    rows = tiny_round(root, num_prompts=16, prompts_per_round=8)
    assert len(rows) == ROWS
    return root, rows


def _scored(root, name, rows, advantage=None, finish_reason=None):
    """Write rows as a scored parquet; advantage(row) / finish_reason(row) set those columns."""
    rows = [{**row, "finish_reason": finish_reason(row) if finish_reason else row["finish_reason"]} for row in rows]
    path = root / f"{name}.parquet"
    write_scored(path, rows, [advantage(row) if advantage else ADVANTAGES[row["group_index"]] for row in rows])
    return path


def _run(root, scored, name, prev=None, round_index=0, **options):
    """grpo.run with small batches; returns (summary metrics, per-step metrics [(step, metrics)], out dir)."""
    options = {"micro_batch_size": 8, "gradient_accumulation_steps": 2, "learning_rate": 1e-2, **options}
    out = root / name
    out.mkdir()
    steps = []
    metrics = grpo.run(grpo.GRPOConfig(**options), root / "model", prev, scored, round_index, 1.0, 6, out,
                       on_metrics=lambda m, step: steps.append((step, m)))
    return metrics, steps, out


def _adapter(out):
    from safetensors.torch import load_file

    return load_file(str(out / "adapter_model.safetensors"))


def _optimizer_state(out):
    return torch.load(out / "optimizer.pt", weights_only=True)


def test_zero_advantage_round_takes_no_step(tiny):
    root, rows = tiny
    trained, _, first = _run(root, _scored(root, "signal", rows), "zero_r0")
    assert trained["optimizer_steps"] == 2 and trained["skipped_batches"] == 0
    zero = _scored(root, "zero", rows, advantage=lambda r: 0.0)

    skipped, steps, out = _run(root, zero, "zero_r1", prev=first, round_index=1)
    assert skipped["optimizer_steps"] == 0 and steps == []
    assert skipped["skipped_steps"] == 2 and skipped["skipped_batches"] == 4  # 32 rows / 8 per micro-batch
    assert skipped["optimizer_state"] == "loaded"
    before, after = _adapter(first), _adapter(out)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    old, new = _optimizer_state(first)["state_dict"], _optimizer_state(out)["state_dict"]
    for i, state in old["state"].items():  # AdamW's step count and moments untouched
        assert all(torch.equal(v, new["state"][i][k]) for k, v in state.items())

    # Stepping on the zero gradients instead: AdamW's momentum from round 0 still moves the weights.
    stepped, _, out = _run(root, zero, "zero_r1_stepped", prev=first, round_index=1,
                           skip_zero_advantage_batches=False)
    assert stepped["optimizer_steps"] == 2 and stepped["skipped_batches"] == 0
    assert any(not torch.equal(before[k], v) for k, v in _adapter(out).items())


def test_skipping_a_zero_micro_batch_leaves_the_gradient_as_it_was(tiny):
    """With beta = 0, a skipped micro-batch contributed exactly nothing: same gradient norm with and
    without skipping (dapo's normalizer still counts its tokens)."""
    root, rows = tiny
    half = _scored(root, "half_zero", rows, advantage=lambda r: ADVANTAGES[r["group_index"]]
                   if int(r["prompt_id"].rsplit("-", 1)[-1]) % 2 else 0.0)
    options = dict(micro_batch_size=2, gradient_accumulation_steps=16)  # one step of 16 micro-batches
    skipping, steps_a, _ = _run(root, half, "half_skip", **options)
    stepping, steps_b, _ = _run(root, half, "half_step", skip_zero_advantage_batches=False, **options)
    assert skipping["skipped_batches"] > 0 and stepping["skipped_batches"] == 0
    assert skipping["optimizer_steps"] == stepping["optimizer_steps"] == 1
    assert steps_a[0][1]["grad_norm"] == pytest.approx(steps_b[0][1]["grad_norm"], rel=1e-5)
    assert steps_a[0][1]["loss"] == pytest.approx(steps_b[0][1]["loss"], rel=1e-5, abs=1e-7)


def _replayed(root, name, rows, replayed: bool, logp_shift: float):
    """A scored parquet whose rows are marked replayed (or not) and were sampled by a policy whose
    log-probs were `logp_shift` below this one's: a stale group from the replay buffer."""
    path = _scored(root, f"{name}_scored", rows)
    table = pq.read_table(path)
    shifted = [[lp + logp_shift for lp in lps] for lps in table.column("sampling_logprobs").to_pylist()]
    table = (table.set_column(table.schema.get_field_index("sampling_logprobs"), "sampling_logprobs",
                              pa.array(shifted, type=pa.list_(pa.float32())))
             .append_column("replayed", pa.array([replayed] * len(rows), type=pa.bool_())))
    out = root / f"{name}.parquet"
    write_table(table, out, REPLAYED)
    return out


def test_replay_recompute_logps_treats_replayed_rows_as_on_policy(tiny):
    """The round-start policy's log-probs are the sampling log-probs of replayed rows: correction
    weights 1. Without recompute (or for fresh rows) the stale sampler's log-probs are kept, and the
    pi_old / pi_sampling = e^2 ratio is truncated at the cap."""
    root, rows = tiny
    stale = _replayed(root, "stale_replayed", rows, replayed=True, logp_shift=-2.0)
    recomputed, _, _ = _run(root, stale, "replay_recompute")
    assert recomputed["replayed_rows"] == ROWS
    assert recomputed["is_ratio_mean"] == pytest.approx(1.0) and recomputed["is_ratio_max"] == pytest.approx(1.0)
    kept, _, _ = _run(root, stale, "replay_kept", replay_recompute_logps=False)
    assert kept["is_ratio_max"] == pytest.approx(3.0) and kept["is_ratio_mean"] == pytest.approx(3.0)
    # rows sampled one round earlier (async prefetch): version 0, trained in round 1
    fresh, _, _ = _run(root, _replayed(root, "stale_fresh", rows, replayed=False, logp_shift=-2.0), "replay_fresh",
                       round_index=1)
    assert "replayed_rows" not in fresh and fresh["is_ratio_mean"] == pytest.approx(3.0)
    assert fresh["reused_sampling_logps"] == 0


def test_on_policy_rows_bring_pi_old_with_them(tiny):
    """Rows the transformers engine sampled from the round's starting policy skip the pi_old forward pass
    (reuse_sampling_logps); the round's loss and gradient equal the recomputed ones up to float rounding.
    Rows of another engine are recomputed."""
    root, rows = tiny
    scored = _scored(root, "reuse_scored", rows)
    reused, reused_steps, reused_out = _run(root, scored, "reuse_on")
    recomputed, recomputed_steps, recomputed_out = _run(root, scored, "reuse_off", reuse_sampling_logps=False)
    assert reused["reused_sampling_logps"] == ROWS and recomputed["reused_sampling_logps"] == 0
    for (_, a), (_, b) in zip(reused_steps, recomputed_steps):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    a, b = _adapter(reused_out), _adapter(recomputed_out)
    assert all(torch.allclose(a[k], b[k], atol=1e-4) for k in a)  # lr 1e-2: Adam steps of ~1e-2 per weight
    other_engine = _scored(root, "reuse_vllm", [{**r, "engine": "vllm"} for r in rows])
    assert _run(root, other_engine, "reuse_vllm_out")[0]["reused_sampling_logps"] == 0


def test_one_step_round_takes_pi_old_from_its_own_forward(tiny):
    """A round that is one optimizer step of one pass trains on pi_old itself: no pi_old pass, whatever engine
    sampled the rows (here vLLM's, which are otherwise recomputed); the same loss, gradient and weights as with
    the pass. A round of two steps still runs the pass for them."""
    root, rows = tiny
    scored = _scored(root, "one_step_scored", [{**r, "engine": "vllm"} for r in rows])
    one_step = dict(micro_batch_size=8, gradient_accumulation_steps=4)  # 32 rows: the whole round
    fast, fast_steps, fast_out = _run(root, scored, "one_step_fast", **one_step)
    slow, slow_steps, slow_out = _run(root, scored, "one_step_slow", reuse_sampling_logps=False, **one_step)
    assert (fast["pi_old_from_step"], slow["pi_old_from_step"]) == (1, 0)
    assert len(fast_steps) == len(slow_steps) == 1
    assert fast_steps[0][1]["loss"] == pytest.approx(slow_steps[0][1]["loss"], rel=1e-4, abs=1e-6)
    assert fast_steps[0][1]["grad_norm"] == pytest.approx(slow_steps[0][1]["grad_norm"], rel=1e-4)
    a, b = _adapter(fast_out), _adapter(slow_out)
    assert all(torch.allclose(a[k], b[k], atol=1e-4) for k in a)
    assert _run(root, scored, "two_steps", micro_batch_size=8,
                gradient_accumulation_steps=2)[0]["pi_old_from_step"] == 0


def test_masked_truncated_completions_contribute_no_gradient(tiny):
    """All rows in one optimizer step (dapo: the gradient does not depend on how rows fall into
    micro-batches): masking the truncated rows gives the gradient of the other rows alone."""
    root, rows = tiny
    truncated = {r["rollout_id"] for r in rows[::3]}
    reason = lambda r: "length" if r["rollout_id"] in truncated else "stop"  # noqa: E731
    full = _scored(root, "trunc_full", rows, finish_reason=reason)
    kept = _scored(root, "trunc_kept", [r for r in rows if r["rollout_id"] not in truncated], finish_reason=reason)
    options = dict(micro_batch_size=8, gradient_accumulation_steps=4)

    masked, masked_steps, masked_out = _run(root, full, "trunc_masked", mask_truncated_completions=True, **options)
    alone, alone_steps, alone_out = _run(root, kept, "trunc_alone", **options)
    unmasked, unmasked_steps, _ = _run(root, full, "trunc_unmasked", **options)
    assert masked["truncated_masked"] == len(truncated) and "truncated_masked" not in unmasked
    assert masked_steps[0][1]["grad_norm"] == pytest.approx(alone_steps[0][1]["grad_norm"], rel=1e-4)
    assert masked_steps[0][1]["loss"] == pytest.approx(alone_steps[0][1]["loss"], rel=1e-4, abs=1e-7)
    assert unmasked_steps[0][1]["grad_norm"] != pytest.approx(masked_steps[0][1]["grad_norm"], rel=1e-2)
    a, b = _adapter(masked_out), _adapter(alone_out)
    assert all(torch.allclose(a[k], b[k], atol=1e-4) for k in a)  # same update (lr 1e-2)

    # truncated-only micro-batches carry no signal: skipped
    all_truncated = _scored(root, "trunc_all", rows, finish_reason=lambda r: "length")
    nothing, _, _ = _run(root, all_truncated, "trunc_nothing", mask_truncated_completions=True)
    assert nothing["optimizer_steps"] == 0 and nothing["skipped_batches"] == 4


def test_num_iterations_makes_more_passes_clipped_against_the_round_start(tiny):
    root, rows = tiny
    scored = _scored(root, "iterations", rows)
    options = dict(micro_batch_size=16, gradient_accumulation_steps=1, learning_rate=5e-2)  # 2 steps per pass
    one, one_steps, _ = _run(root, scored, "mu1", **options)
    progress = []
    out = root / "mu2"
    out.mkdir()
    two_steps = []
    two = grpo.run(grpo.GRPOConfig(num_iterations=2, **options), root / "model", None, scored, 0, 1.0, 6, out,
                   on_step=lambda done, total: progress.append((done, total)),
                   on_metrics=lambda m, step: two_steps.append((step, m)))
    assert one["optimizer_steps"] == 2 and two["optimizer_steps"] == 4
    assert [s for s, _ in two_steps] == [0, 1, 2, 3] and progress[-1] == (4, 4)
    assert two_steps[0][1]["clip_ratio"] == 0.0  # the first step is on-policy: ratio 1
    # the second pass re-reads the same rollouts two updates later: ratios against pi_old leave the clip range
    assert max(m["clip_ratio"] for _, m in two_steps[2:]) > 0.0
    assert one_steps[0][1]["loss"] == pytest.approx(two_steps[0][1]["loss"], rel=1e-6)  # same first step


def test_adafactor_trains_and_its_state_carries_to_the_next_round(tiny, caplog):
    root, rows = tiny
    scored = _scored(root, "optim", rows)
    first, _, r0 = _run(root, scored, "adafactor_r0", optim="adafactor")
    assert first["optimizer_steps"] == 2 and first["optimizer_state"] == "new"
    assert any(torch.count_nonzero(w) > 0 for k, w in _adapter(r0).items() if "lora_B" in k)  # B starts at 0
    assert _optimizer_state(r0)["optim"] == "adafactor"

    second, _, r1 = _run(root, scored, "adafactor_r1", prev=r0, round_index=1, optim="adafactor")
    assert second["optimizer_state"] == "loaded"
    steps = [s["step"] for s in _optimizer_state(r1)["state_dict"]["state"].values()]
    assert steps and all(float(s) == 4 for s in steps)  # 2 steps per round, continued

    with caplog.at_level(logging.WARNING, logger="stages.training.grpo"):
        switched, _, r2 = _run(root, scored, "adamw_r2", prev=r1, round_index=2, optim="adamw")
    assert switched["optimizer_state"] == "reset" and switched["optimizer_steps"] == 2
    assert "grpo.optim is adamw" in caplog.text and "holds adafactor state" in caplog.text
    assert _optimizer_state(r2)["optim"] == "adamw"
    assert all(float(s["step"]) == 2 for s in _optimizer_state(r2)["state_dict"]["state"].values())  # fresh


def test_adamw_state_from_before_optim_existed_still_loads(tiny):
    """optimizer.pt used to be AdamW's bare state dict."""
    root, rows = tiny
    scored = _scored(root, "legacy", rows)
    _, _, r0 = _run(root, scored, "legacy_r0")
    torch.save(_optimizer_state(r0)["state_dict"], r0 / "optimizer.pt")
    again, _, _ = _run(root, scored, "legacy_r1", prev=r0, round_index=1)
    assert again["optimizer_state"] == "loaded"


def test_adam_betas_and_epsilon_reach_adamw_and_stay_out_of_the_default_key(tiny):
    """TRL/axolotl's adam_beta1, adam_beta2, adam_epsilon: AdamW gets them (its saved param_groups say so);
    unset they are torch's defaults and no key holds them; another optimizer refuses them."""
    from stages.runtime.keys import key_fields

    root, rows = tiny
    scored = _scored(root, "betas", rows)
    _, _, default = _run(root, scored, "betas_default")
    _, _, tuned = _run(root, scored, "betas_tuned", adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-6)
    group = _optimizer_state(tuned)["state_dict"]["param_groups"][0]
    assert tuple(group["betas"]) == (0.8, 0.95) and group["eps"] == 1e-6
    assert tuple(_optimizer_state(default)["state_dict"]["param_groups"][0]["betas"]) == (0.9, 0.999)
    assert not any(k.startswith("adam_") for k in key_fields(grpo.GRPOConfig()))
    assert key_fields(grpo.GRPOConfig(adam_beta2=0.95))["adam_beta2"] == 0.95
    with pytest.raises(ValidationError, match=r"adam_beta1: AdamW's options, but optim is sgd"):
        grpo.GRPOConfig(optim="sgd", adam_beta1=0.8)


def test_adamw_8bit_without_a_cuda_gpu_is_a_clear_error(tiny):
    root, rows = tiny
    with pytest.raises(ValueError, match=r"grpo.optim: adamw_8bit .*needs a CUDA GPU"):
        _run(root, _scored(root, "bnb", rows), "bnb", optim="adamw_8bit")


def test_warmup_starts_below_the_learning_rate_and_reaches_it(tiny):
    root, rows = tiny
    scored = _scored(root, "warmup", rows)
    options = dict(micro_batch_size=8, gradient_accumulation_steps=1, warmup_steps=3)  # 4 steps per round
    metrics, steps, _ = _run(root, scored, "warmup_r0", **options)
    rates = [m["learning_rate"] for _, m in steps]
    assert [s for s, _ in steps] == [0, 1, 2, 3]
    assert rates == pytest.approx([1e-2 / 3, 2e-2 / 3, 1e-2, 1e-2])
    assert all(m["grad_norm"] > 0 for _, m in steps)
    assert metrics["learning_rate"] == pytest.approx(1e-2)
    # round 1 continues the run's schedule: its steps are 4..7, past the warmup
    _, steps, _ = _run(root, scored, "warmup_r1", round_index=1, **options)
    assert [s for s, _ in steps] == [4, 5, 6, 7] and all(m["learning_rate"] == 1e-2 for _, m in steps)

    # linear decay over 2 rounds with a quarter of warmup: 8 steps, 2 warming up, 0 after the last
    _, steps, _ = _run(root, scored, "linear_r1", round_index=1, micro_batch_size=8, gradient_accumulation_steps=1,
                       lr_scheduler_type="linear", warmup_ratio=0.25, lr_schedule_rounds=2, rounds=2)
    assert [m["learning_rate"] for _, m in steps] == pytest.approx([1e-2 * f for f in (4 / 6, 3 / 6, 2 / 6, 1 / 6)])


@pytest.mark.parametrize("options, message", [
    (dict(lr_scheduler_type="cosine"), "a horizon: set lr_schedule_rounds"),
    (dict(warmup_ratio=0.1), "a horizon: set lr_schedule_rounds"),
    (dict(lr_scheduler_type="linear", lr_schedule_rounds=4, rounds=6), "set lr_schedule_rounds >= rounds"),
    (dict(warmup_steps=2, warmup_ratio=0.1), "set one"),
])
def test_schedule_options_are_checked(options, message):
    with pytest.raises(ValidationError, match=message):
        grpo.GRPOConfig(**options)
    assert grpo.GRPOConfig(warmup_steps=5).lr_schedule_rounds is None  # constant + warmup_steps: no horizon


def test_shared_prompt_pass_gives_the_plain_logps_and_gradients(tiny):
    """batch_logps runs each distinct prompt once and copies its KV cache to the group's rows: the
    log-probs, entropies and LoRA gradients are those of the plain forward over every row."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    root, rows = tiny
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(root / "model"),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    batch = grpo.collate([{**r, "advantage": 1.0} for r in sorted(rows, key=lambda r: r["prompt_id"])[:12]],
                         pad_token_id=0)  # 3 groups of 4
    results = []
    for fn in (lambda: logprobs.completion_logps(model, *logprobs.plain_inputs(batch), 0.7),
               lambda: logprobs.batch_logps(model, batch, 0.7)):
        model.zero_grad()
        logps, entropy = fn()
        (logps * batch["completion_mask"] * torch.linspace(-1, 1, logps.size(1))).sum().backward()
        results.append((logps.detach(), entropy, {n: p.grad.clone() for n, p in model.named_parameters()
                                                   if p.grad is not None}))
    (plain, plain_entropy, plain_grads), (shared, shared_entropy, shared_grads) = results
    mask = batch["completion_mask"].bool()
    assert torch.allclose(plain[mask], shared[mask], atol=1e-5)
    assert torch.allclose(plain_entropy[mask], shared_entropy[mask], atol=1e-5)
    assert plain_grads.keys() == shared_grads.keys() and plain_grads
    for name, grad in plain_grads.items():
        assert torch.allclose(grad, shared_grads[name], rtol=1e-3, atol=1e-6), name


def test_shared_prompt_pass_can_be_switched_off(tiny, monkeypatch):
    """grpo.shared_prompt_pass: false runs no shared prompt pass (batch_logps is never called) and trains the
    same round up to float rounding."""
    root, rows = tiny
    scored = _scored(root, "shared_scored", rows)
    calls = []
    shared_pass = logprobs.batch_logps
    monkeypatch.setattr(logprobs, "batch_logps", lambda *args: calls.append(1) or shared_pass(*args))
    _, shared_steps, shared_out = _run(root, scored, "shared_on")
    assert calls
    calls.clear()
    _, plain_steps, plain_out = _run(root, scored, "shared_off", shared_prompt_pass=False)
    assert not calls
    assert len(shared_steps) == len(plain_steps) == 2
    for (_, a), (_, b) in zip(shared_steps, plain_steps):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    a, b = _adapter(shared_out), _adapter(plain_out)
    # lr 1e-2: an Adam step moves a weight by ~1e-2; float noise in near-zero gradient entries moves it ~1e-4
    assert all(torch.allclose(a[k], b[k], atol=1e-3) for k in a)


def test_shared_prompt_pass_backward_adds_in_a_fixed_order(tiny):
    """The group's rows take their prompt's KV cache by index_select, whose backward adds the rows'
    gradients in order. Tensor indexing (DynamicCache.batch_select_indices) would backpropagate through
    IndexBackward0, whose CPU kernel adds with atomic float adds across threads: the sum's order, and so
    the trained adapter's bits, then depend on thread timing (a rerun under load differed by ~1e-8)."""
    from transformers import AutoModelForCausalLM

    root, rows = tiny
    model = AutoModelForCausalLM.from_pretrained(root / "model")
    batch = grpo.collate([{**r, "advantage": 1.0} for r in sorted(rows, key=lambda r: r["prompt_id"])[:12]],
                         pad_token_id=0)  # 3 groups of 4
    logps, _ = logprobs.batch_logps(model, batch, 1.0)
    nodes, seen, todo = set(), set(), [logps.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        nodes.add(type(node).__name__)
        todo.extend(next_node for next_node, _ in node.next_functions)
    assert "IndexSelectBackward0" in nodes  # the shared pass ran (3 distinct prompts for 12 rows)
    assert not {"IndexBackward0", "IndexPutBackward0"} & nodes


def test_dapo_step_gradient_does_not_depend_on_how_the_step_is_cut(tiny):
    """dapo with beta 0 regroups a step's rows by prompt (and drops rows without signal); with a vanishing
    beta the micro-batches stay as cut and every row runs. Same step gradient either way."""
    root, rows = tiny
    half = _scored(root, "regroup", rows, advantage=lambda r: ADVANTAGES[r["group_index"]]
                   if int(r["prompt_id"].rsplit("-", 1)[-1]) % 2 else 0.0)
    options = dict(micro_batch_size=4, gradient_accumulation_steps=8)  # one step of 8 micro-batches
    regrouped, steps_a, _ = _run(root, half, "regroup_dapo", **options)
    as_cut, steps_b, _ = _run(root, half, "as_cut_dapo", beta=1e-12, skip_zero_advantage_batches=False, **options)
    with_signal = sum(int(r["prompt_id"].rsplit("-", 1)[-1]) % 2 for r in rows)
    assert 0 < with_signal < ROWS and regrouped["trained_rows"] == with_signal and as_cut["trained_rows"] == ROWS
    assert steps_a[0][1]["grad_norm"] == pytest.approx(steps_b[0][1]["grad_norm"], rel=1e-4)
    assert steps_a[0][1]["loss"] == pytest.approx(steps_b[0][1]["loss"], rel=1e-4, abs=1e-7)


@pytest.mark.parametrize("adapter", ["lora", "none"])
def test_chunked_logps_give_the_plain_logps_and_gradients_with_a_row_or_two_at_a_time(tiny, adapter):
    """grpo.logps_chunk_tokens: the lm_head sees a chunk of rows at a time (in the forward and, recomputed,
    in the backward), never the whole micro-batch, and the log-probs, entropies and gradients are the whole
    logits' -- with the plain forward and with the shared prompt pass."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    root, rows = tiny
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(root / "model")
    if adapter == "lora":
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                 init_lora_weights=False))
    assert logprobs.logits_from_hidden(model)
    batch = grpo.collate([{**r, "advantage": 1.0} for r in sorted(rows, key=lambda r: r["prompt_id"])[:12]],
                         pad_token_id=0)  # 3 groups of 4
    positions = batch["completion_ids"].size(1) + 1
    head_rows = []
    logprobs.decoder_and_head(model)[1].register_forward_hook(lambda _m, args, _o: head_rows.append(args[0].size(0)))
    results = {}
    for name, fn in {
        "plain": lambda: logprobs.completion_logps(model, *logprobs.plain_inputs(batch), 0.7),
        "plain_chunked": lambda: logprobs.completion_logps(model, *logprobs.plain_inputs(batch), 0.7, 2 * positions),
        "shared_chunked": lambda: logprobs.batch_logps(model, batch, 0.7, positions),
    }.items():
        model.zero_grad()
        head_rows.clear()
        logps, entropy = fn()
        (logps * batch["completion_mask"] * torch.linspace(-1, 1, logps.size(1))).sum().backward()
        results[name] = (logps.detach(), entropy, {n: p.grad.clone() for n, p in model.named_parameters()
                                                   if p.grad is not None}, list(head_rows))
    assert results["plain"][3] == [12]
    assert results["plain_chunked"][3] == [2] * 6 * 2  # six chunks, each again in the backward
    assert results["shared_chunked"][3] == [1] * 12 * 2
    mask = batch["completion_mask"].bool()
    plain, plain_entropy, plain_grads, _ = results["plain"]
    for name in ("plain_chunked", "shared_chunked"):
        logps, entropy, grads, _ = results[name]
        assert torch.allclose(plain[mask], logps[mask], atol=1e-5), name
        assert torch.allclose(plain_entropy[mask], entropy[mask], atol=1e-5), name
        assert grads.keys() == plain_grads.keys() and grads
        for key, grad in plain_grads.items():
            assert torch.allclose(grad, grads[key], rtol=1e-3, atol=1e-6), (name, key)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logps_read_bf16_logits_as_their_fp32_copy_would(temperature):
    """token_logps at temperature 1 takes the log-softmax of the bf16 logits in fp32 without an fp32 copy of
    them (nor a division by 1): log-probs, entropies and the logits' gradient are those of the copy's, bit for
    bit; other temperatures divide an fp32 copy, as before."""
    torch.manual_seed(0)
    logits = (torch.randn(3, 7, 1000) * 4).bfloat16()
    tokens = torch.randint(0, 1000, (3, 6))
    weights = torch.linspace(-1, 1, 6)
    results = []
    for fn in (logprobs.token_logps, _fp32_copy_token_logps):
        x = logits.clone().requires_grad_(True)
        logps, entropy = fn(x, tokens, temperature)
        (logps * weights).sum().backward()
        assert logps.dtype == entropy.dtype == torch.float32 and x.grad.dtype == torch.bfloat16
        results.append((logps.detach(), entropy, x.grad))
    for ours, copied in zip(*results):
        assert torch.equal(ours, copied)


def _fp32_copy_token_logps(logits, tokens, temperature):
    """token_logps as it was written before: the log-softmax of an fp32 copy of the logits, divided."""
    log_p = torch.log_softmax(logits[:, :-1, :].float() / temperature, dim=-1)
    with torch.no_grad():
        entropy = -(log_p.exp() * log_p).sum(-1)
    return log_p.gather(-1, tokens.unsqueeze(-1)).squeeze(-1), entropy


def test_a_round_with_chunked_logps_trains_as_the_whole_logits_do(tiny, monkeypatch):
    """grpo.logps_chunk_tokens set: the round runs the chunked head (off by default) and ends where the
    whole-logits round does, up to float rounding."""
    root, rows = tiny
    scored = _scored(root, "chunk_scored", rows)
    chunked = logprobs.chunked_token_logps
    calls = []
    monkeypatch.setattr(logprobs, "chunked_token_logps", lambda *args: calls.append(args[-1]) or chunked(*args))
    _, whole_steps, whole_out = _run(root, scored, "chunks_off")
    assert not calls
    _, chunked_steps, chunked_out = _run(root, scored, "chunks_on", logps_chunk_tokens=20)
    assert calls and set(calls) == {20}
    for (_, a), (_, b) in zip(whole_steps, chunked_steps):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    a, b = _adapter(whole_out), _adapter(chunked_out)
    assert all(torch.allclose(a[k], b[k], atol=1e-3) for k in a)


def test_logits_that_are_more_than_the_head_of_the_hidden_states_are_not_chunked():
    """A model whose logits are soft-capped (Gemma 2) fails `logits_from_hidden` (a round asked to chunk it
    stops, naming grpo.logps_chunk_tokens); a plain Qwen2 passes."""
    from transformers import Gemma2Config, Gemma2ForCausalLM, Qwen2Config, Qwen2ForCausalLM

    small = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=8)
    torch.manual_seed(0)
    capped = Gemma2ForCausalLM(Gemma2Config(**small, final_logit_softcapping=0.5))
    assert not logprobs.logits_from_hidden(capped)
    plain = Qwen2ForCausalLM(Qwen2Config(**small))
    assert logprobs.logits_from_hidden(plain)

    trainer = grpo.RoundTrainer.__new__(grpo.RoundTrainer)  # the check alone, on these models
    trainer.cfg, trainer.sharded = grpo.GRPOConfig(logps_chunk_tokens=256), False
    trainer.placement, trainer.devices = devices, None  # checked under the round's autocast (none: fp32 on CPU)
    trainer.model = plain
    assert trainer._logps_chunk_tokens() == 256
    trainer.model = capped
    with pytest.raises(ValueError, match="grpo.logps_chunk_tokens: Gemma2ForCausalLM's logits are more than"):
        trainer._logps_chunk_tokens()
    trainer.cfg = grpo.GRPOConfig()
    assert trainer._logps_chunk_tokens() == 0  # off: nothing to check
