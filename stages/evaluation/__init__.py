"""Measuring a policy: greedy accuracy on held-out prompts with its constant baseline, and the health checks of
each GRPO round's metrics."""
