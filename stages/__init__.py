"""Pure ML stages: no Prefect, no MLflow. Each stage module has a pydantic config and a `run` function.

Grouped by what they do: `data/` (what goes in), `rollout/` (sampling completions), `scoring/` (rewards),
`training/` (what changes the weights, and export), `evaluation/` (eval and health checks), `runtime/`
(devices, processes, Ray, checkpoints, imports and cache-key declarations the others use).
"""

from stages.runtime.startup import lighten_imports

lighten_imports()  # ~3 s less CPU in every process that imports transformers and TRL (stages/runtime/startup.py)
