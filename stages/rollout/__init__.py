"""Sampling completions: the rollout stage, its engines (transformers, vLLM in-process, vLLM servers, Ray vLLM),
the rollout worker process, the Atropos client and the bearer tokens of posttrain's HTTP servers."""
