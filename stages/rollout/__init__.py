"""Sampling completions: the rollout stage, its engines (transformers, vLLM in-process, vLLM servers, Ray vLLM),
the rollout worker process and the Atropos client."""
