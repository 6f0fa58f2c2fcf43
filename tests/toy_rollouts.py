"""User rollout functions for the tests (rollout.rollout_func: toy_rollouts.<name>)."""


def retry_unformatted(prompts, engine, policy, sampling, tokenizer):
    """Two-step rollout: completions without an <answer> tag are asked again, with a reminder turn."""
    first = engine.generate(policy, prompts, sampling)
    retry = [i for i, out in enumerate(first) if "<answer>" not in out["completion"]]
    reminded = [prompts[i] + [{"role": "assistant", "content": first[i]["completion"]},
                              {"role": "user", "content": "Reply as <answer>N</answer>."}] for i in retry]
    for i, out in zip(retry, engine.generate(policy, reminded, sampling) if reminded else []):
        first[i] = {**out, "prompt_token_ids": out["prompt_token_ids"]}
    return first


def one_short(prompts, engine, policy, sampling, tokenizer):
    """Broken on purpose: one completion fewer than prompts."""
    return engine.generate(policy, prompts, sampling)[:-1]


def mismatched_logprobs(prompts, engine, policy, sampling, tokenizer):
    """Broken on purpose: a log-prob missing in the first completion."""
    out = engine.generate(policy, prompts, sampling)
    out[0] = {**out[0], "sampling_logprobs": out[0]["sampling_logprobs"][:-1]}
    return out
