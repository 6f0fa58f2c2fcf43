"""vLLM's OpenAI server (`vllm serve`) with posttrain's lighter imports: `python -m
stages.rollout.engines.vllm_api_server --model DIR ...` takes `vllm serve`'s options and runs vLLM's own entry
point, after `import stages` (stages/runtime/startup.py) has taken scikit-learn and the repeated package scans out
of transformers' import.

On the CPU vLLM spawns its engine core and worker processes (VLLM_WORKER_MULTIPROC_METHOD=spawn); a spawned child
imports its parent's `__main__` module first, this one, so the three processes all start lighter. vLLM itself is
imported only in the `__main__` branch: a child imports only what its own work needs.
"""

import stages  # noqa: F401  (lighten_imports)

if __name__ == "__main__":
    from vllm.entrypoints.launchers.api_server.entry import main

    main()
