"""An Atropos environment for posttrain's demo task, "which is the largest of five numbers", procedural and
offline: the questions of the demo's train split (stages/data/demo_data.py, same seed), scored with our built-in
`accuracy` reward. It samples the policy posttrain serves (stages/rollout/atropos.py PolicyServer, or any
OpenAI-compatible server that returns vLLM's `prompt_token_ids` / `token_ids` with `return_token_ids`)
and sends each group to Atropos' API with the sampled tokens' log-probs and, in `overrides`, the policy
version that sampled them, its name and the gold answer.

Run it after `run-api` and `posttrain run configs/atropos.yaml` are up (docs/methods/atropos.md):

    python configs/examples/atropos_env.py serve --env.rollout_server_url http://127.0.0.1:8000 \\
        --openai.base_url http://127.0.0.1:9100/v1 --env.group_size 16

`--env.tokenizer_name policy-server` (the default) takes the tokenizer from the policy server's
/v1/models (the folder of the model it serves); name a folder to use another.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: stages.*

import httpx  # noqa: E402
from atroposlib.envs.base import APIServerConfig, BaseEnv, BaseEnvConfig, ScoredDataGroup  # noqa: E402
from pydantic import Field  # noqa: E402


class LargestNumberConfig(BaseEnvConfig):
    max_completion_tokens: int = Field(default=16, description="Tokens sampled at most per completion")
    temperature: float = Field(default=1.0, description="Sampling temperature")
    demo_seed: int = Field(default=1234, description="stages/data/demo_data.py seed (the train split's questions)")
    num_items: int = Field(default=4000, description="Questions in the cycle (the demo's num_train)")


def policy_server_model_dir(base_url: str, timeout_s: float = 600.0) -> str:
    """The model folder the policy server serves (its /v1/models `root`), waiting for it to answer."""
    deadline = time.time() + timeout_s
    while True:
        try:
            return httpx.get(f"{base_url.rstrip('/')}/models", timeout=5).json()["data"][0]["root"]
        except Exception:
            if time.time() > deadline:
                raise RuntimeError(f"no policy server answers at {base_url}/models; start posttrain first "
                                   "(rollout.source: atropos serves the policy there)") from None
            time.sleep(1)


class LargestNumberEnv(BaseEnv):
    name = "largest_number"
    env_config_cls = LargestNumberConfig

    def __init__(self, config: LargestNumberConfig, server_configs, slurm=False, testing=False):
        if config.tokenizer_name == "policy-server":
            config.tokenizer_name = policy_server_model_dir(server_configs[0].base_url)
        super().__init__(config, server_configs, slurm, testing)
        self.items, self.next_index = [], 0

    @classmethod
    def config_init(cls):
        env = LargestNumberConfig(
            group_size=16, tokenizer_name="policy-server", rollout_server_url="http://127.0.0.1:8000",
            use_wandb=False, wandb_name=cls.name, max_token_length=512, total_steps=100_000,
            max_num_workers_per_node=4, steps_per_eval=0, include_messages=True,
        )
        server = APIServerConfig(model_name="policy", base_url="http://127.0.0.1:9100/v1", api_key="none",
                                 server_type="openai", health_check=False, num_max_requests_at_once=4)
        return env, [server]

    async def setup(self):
        import pyarrow.parquet as pq

        from stages.data import demo_data

        with tempfile.TemporaryDirectory() as d:
            demo_data.run(demo_data.DemoDataConfig(seed=self.config.demo_seed, num_train=self.config.num_items,
                                                   num_sft=1, num_eval=256), Path(d))
            self.items = [{"prompt": [{"role": "user", "content": r["question"]}], "answer": r["answer"]}
                          for r in pq.read_table(Path(d) / "train.parquet").to_pylist()]

    async def get_next_item(self):
        item = self.items[self.next_index % len(self.items)]
        self.next_index += 1
        return item

    async def collect_trajectories(self, item):
        from stages.scoring.rewards import accuracy_reward

        resp = await self.server.chat_completion(
            messages=item["prompt"], n=self.config.group_size, max_tokens=self.config.max_completion_tokens,
            temperature=self.config.temperature, logprobs=True, extra_body={"return_token_ids": True})
        extra = resp.model_extra or {}
        prompt_ids = extra["prompt_token_ids"]
        texts = [c.message.content or "" for c in resp.choices]
        scores = accuracy_reward(completions=texts, answer=[item["answer"]] * len(texts))
        group = ScoredDataGroup(tokens=[], masks=[], scores=[], inference_logprobs=[], overrides=[], messages=[])
        for choice, text, score in zip(resp.choices, texts, scores):
            ids = list((choice.model_extra or {})["token_ids"])
            logprobs = [t.logprob for t in choice.logprobs.content] if choice.logprobs else [1.0] * len(ids)
            group["tokens"].append(prompt_ids + ids)
            group["masks"].append([-100] * len(prompt_ids) + ids)
            group["inference_logprobs"].append([1.0] * len(prompt_ids) + logprobs)
            group["scores"].append(float(score))
            group["overrides"].append({"policy_version": extra.get("policy_version", -1), "env": self.name,
                                       "answer": item["answer"]})
            group["messages"].append(item["prompt"] + [{"role": "assistant", "content": text}])
        return group, []

    async def evaluate(self, *args, **kwargs):
        """posttrain evaluates the policy itself (eval stage); nothing here."""


if __name__ == "__main__":
    LargestNumberEnv.cli()
