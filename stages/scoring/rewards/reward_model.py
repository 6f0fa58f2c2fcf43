"""A saved reward model as a reward function (`score.reward_funcs: [reward_model]`): the folder the reward_model
stage writes (stages/training/reward_model.py) loaded once and frozen, each sample rendered with the folder's chat
template exactly as in training and scored in batches without grad. ORM: the head's output at the last token; PRM:
P(good) at the last token of each step, the steps aggregated (min or last) into a score in [0, 1]. The encoding
helpers here are the ones training uses, so a sample is scored as it was trained on.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Literal

from stages.runtime import devices as devices_module
from stages.runtime.devices import DeviceConfig


METADATA_FILE = "reward_model.json"
"""Written beside the weights: {kind, step_separator, step_aggregation, max_length}; the scorer reads it."""


IGNORE_INDEX = -100
"""Label of the tokens a PRM is not trained on (torch cross-entropy's ignore_index)."""


def join_steps(prompt_ids: list[int], steps_ids: list[list[int]],
               separator_ids: list[int]) -> tuple[list[int], list[int]]:
    """prompt, then the steps with the separator between them -> (input_ids, ends), ends[i] the index of
    step i's last token (where its label goes; TRL's PRMTrainer put it on a separator appended to every step).

    >>> join_steps([1, 2], [[5, 6], [7]], [9])
    ([1, 2, 5, 6, 9, 7], [3, 5])
    """
    ids, ends = list(prompt_ids), []
    for i, step in enumerate(steps_ids):
        if i:
            ids += list(separator_ids)
        ids += list(step)
        ends.append(len(ids) - 1)
    return ids, ends


def split_steps(completion, step_separator: str) -> list[str]:
    r"""A completion (a string, or assistant messages as TRL passes conversational completions: their
    contents joined by the separator) -> its steps: split on `step_separator`, blank pieces left out (a
    trailing separator adds no step); a completion with no non-blank piece is one step, as it is.

    >>> split_steps("Compare 3 and 8: keep 8\n<answer>8</answer>\n", "\n")
    ['Compare 3 and 8: keep 8', '<answer>8</answer>']
    """
    text = completion if isinstance(completion, str) else step_separator.join(m["content"] for m in completion)
    steps = [step for step in text.split(step_separator) if step.strip()]
    return steps or [text]


def encode_steps(tokenizer, prompt, steps: list[str], step_separator: str) -> tuple[list[int], list[int]]:
    """(input_ids, ends) of a chat-templated prompt (with the generation prompt: the steps are the assistant
    turn) followed by the steps, each tokenized on its own (so a step's last token is its own), the
    separator's tokens between them: the completion text as the policy wrote it."""
    prompt_ids = list(tokenizer.apply_chat_template(_as_messages(prompt, "user"), add_generation_prompt=True,
                                                    tokenize=True, return_dict=True)["input_ids"])
    steps_ids = [tokenizer(step, add_special_tokens=False)["input_ids"] for step in steps]
    return join_steps(prompt_ids, steps_ids, tokenizer(step_separator, add_special_tokens=False)["input_ids"])


def keep_last(ids: list[int], ends: list[int], max_length: int | None) -> tuple[list[int], list[int]]:
    """The last `max_length` tokens and the step ends still among them (re-indexed)."""
    if not max_length or len(ids) <= max_length:
        return ids, ends
    cut = len(ids) - max_length
    return ids[cut:], [end - cut for end in ends if end >= cut]


def collate_steps(features: list[dict], pad_token_id: int) -> dict:
    """Right-padded batch: input_ids (pad_token_id), attention_mask, labels (IGNORE_INDEX on padding)."""
    import torch

    width = max(len(f["input_ids"]) for f in features)
    ids = torch.full((len(features), width), pad_token_id, dtype=torch.long)
    attention = torch.zeros((len(features), width), dtype=torch.long)
    labels = torch.full((len(features), width), IGNORE_INDEX, dtype=torch.long)
    for i, f in enumerate(features):
        n = len(f["input_ids"])
        ids[i, :n] = torch.tensor(f["input_ids"])
        attention[i, :n] = 1
        labels[i, :n] = torch.tensor(f["labels"])
    return {"input_ids": ids, "attention_mask": attention, "labels": labels}


def plain_messages(value) -> list[dict]:
    """Chat messages as {role, content} only (a Parquet row's structs may carry other keys)."""
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _as_messages(value, role: str) -> list[dict]:
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    return plain_messages(value)


def encode(tokenizer, prompt, completion, max_length: int | None = None) -> list[int]:
    """Token ids of prompt + completion with the chat template, as TRL's RewardTrainer tokenizes a
    conversational pair side (no generation prompt). Plain strings become a user / an assistant message.
    Longer than `max_length`: the last `max_length` tokens (the score reads the last one)."""
    messages = _as_messages(prompt, "user") + _as_messages(completion, "assistant")
    ids = list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"])
    return ids[-max_length:] if max_length else ids


def score_ids(model, sequences: list[list[int]], pad_token_id: int, batch_size: int = 32) -> list[float]:
    """Scalar scores of token-id sequences (right-padded batches, no grad, eval mode restored after)."""
    import torch

    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    out: list[float] = []
    try:
        with torch.no_grad():
            for start in range(0, len(sequences), batch_size):
                chunk = sequences[start : start + batch_size]
                width = max(len(s) for s in chunk)
                ids = torch.full((len(chunk), width), pad_token_id, dtype=torch.long)
                attention = torch.zeros((len(chunk), width), dtype=torch.long)
                for i, s in enumerate(chunk):
                    ids[i, : len(s)] = torch.tensor(s)
                    attention[i, : len(s)] = 1
                logits = model(input_ids=ids.to(device), attention_mask=attention.to(device)).logits
                out += logits[:, 0].float().tolist()
    finally:
        model.train(was_training)
    return out


def step_scores(model, sequences: list[tuple[list[int], list[int]]], pad_token_id: int,
                batch_size: int = 32) -> list[list[float]]:
    """P(good) at each step end of (input_ids, ends) sequences, from a 2-label token classifier
    (right-padded batches, no grad, eval mode restored after)."""
    import torch

    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    out: list[list[float]] = []
    try:
        with torch.no_grad():
            for start in range(0, len(sequences), batch_size):
                chunk = sequences[start : start + batch_size]
                batch = collate_steps([{"input_ids": ids, "labels": [IGNORE_INDEX] * len(ids)} for ids, _ in chunk],
                                      pad_token_id)
                logits = model(input_ids=batch["input_ids"].to(device),
                               attention_mask=batch["attention_mask"].to(device)).logits
                good = logits.float().softmax(-1)[..., 1].cpu()
                out += [good[i, ends].tolist() for i, (_, ends) in enumerate(chunk)]
    finally:
        model.train(was_training)
    return out


def aggregate_steps(scores: list[float], how: Literal["min", "last"]) -> float:
    """One score from per-step scores: the weakest step's (min) or the last step's (last).

    >>> aggregate_steps([0.9, 0.2, 0.8], "min"), aggregate_steps([0.9, 0.2, 0.8], "last")
    (0.2, 0.8)
    """
    if not scores:
        raise ValueError("aggregate_steps: no step scores")
    if how == "min":
        return min(scores)
    if how == "last":
        return scores[-1]
    raise ValueError(f"step_aggregation: {how!r}, expected 'min' or 'last'")


def read_metadata(model_dir: Path) -> dict:
    """A reward model folder's reward_model.json; without one (a folder saved elsewhere) the kind is read
    from config.json: a token classifier is a PRM with the default separator, anything else an ORM."""
    model_dir = Path(model_dir)
    if (model_dir / METADATA_FILE).exists():
        return json.loads((model_dir / METADATA_FILE).read_text())
    config = json.loads((model_dir / "config.json").read_text())
    token_classifier = any(a.endswith("ForTokenClassification") for a in config.get("architectures") or [])
    return {"kind": "prm" if token_classifier else "orm"}


class RewardModelScorer:
    """A saved reward model as a TRL reward function: `scorer(prompts, completions, **kwargs) -> list[float]`.

    Loads the folder once, frozen (`devices`, stages/runtime/devices.py: its device, weights in the compute
    dtype, eval mode; None: auto): an ORM as AutoModelForSequenceClassification, a PRM as
    AutoModelForTokenClassification (the kind from its reward_model.json, see `read_metadata`). Prompts
    are chat message lists or strings (a string is a user message); completions are assistant message
    lists, as TRL passes them for conversational data, or strings (an assistant message). Each sample is
    rendered with the folder's chat template exactly as in training and scored in batches without grad.
    ORM: the head's output at the last token. PRM: the completion is split into steps on the folder's
    step separator, each step scored P(good) at its last token (`step_scores`), and the steps aggregated
    by `step_aggregation` (unset: the folder's, else min) into a score in [0, 1].
    """

    def __init__(self, model_dir: Path | str, batch_size: int = 32,
                 step_aggregation: Literal["min", "last"] | None = None, max_length: int | None = None,
                 devices: DeviceConfig | None = None, step_separator: str | None = None):
        from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification, AutoTokenizer

        from stages.runtime.policy import MODEL_LOADING

        self.model_dir = Path(model_dir)
        metadata = read_metadata(self.model_dir)
        self.kind = metadata.get("kind", "orm")
        step_aggregation = step_aggregation or metadata.get("step_aggregation") or "min"
        if step_aggregation not in ("min", "last"):
            raise ValueError(f"step_aggregation: {step_aggregation!r}, expected 'min' or 'last'")
        self.batch_size = batch_size
        self.step_aggregation = step_aggregation
        self.step_separator = step_separator or metadata.get("step_separator") or "\n"
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        auto_class = AutoModelForTokenClassification if self.kind == "prm" else AutoModelForSequenceClassification
        with MODEL_LOADING:
            self.model = devices_module.load_frozen(auto_class, self.model_dir, devices)
        expected = 2 if self.kind == "prm" else 1
        if self.model.config.num_labels != expected:
            raise ValueError(f"{self.model_dir}: num_labels={self.model.config.num_labels}; "
                             f"a {self.kind.upper()} reward model has {expected}")
        if self.model.config.pad_token_id is None:
            if self.tokenizer.pad_token is None:
                self.tokenizer.pad_token = self.tokenizer.eos_token
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.max_length = max_length or getattr(self.model.config, "max_position_embeddings", None)
        self.__name__ = "reward_model"

    def score_steps(self, prompts: list, completions: list) -> list[list[float]]:
        """PRM: P(good) of each step of each sample (steps cut off by max_length are left out)."""
        if self.kind != "prm":
            raise ValueError(f"{self.model_dir}: an outcome reward model has no step scores")
        sequences = []
        for prompt, completion in zip(prompts, completions):
            ids, ends = encode_steps(self.tokenizer, prompt, split_steps(completion, self.step_separator),
                                     self.step_separator)
            sequences.append(keep_last(ids, ends, self.max_length))
        return step_scores(self.model, sequences, self.model.config.pad_token_id, self.batch_size)

    def __call__(self, prompts: list, completions: list, **kwargs) -> list[float]:
        if len(prompts) != len(completions):
            raise ValueError(f"reward_model: {len(prompts)} prompts but {len(completions)} completions")
        if self.kind == "prm":
            return [aggregate_steps(steps, self.step_aggregation) for steps in self.score_steps(prompts, completions)]
        sequences = [encode(self.tokenizer, p, c, self.max_length) for p, c in zip(prompts, completions)]
        return score_ids(self.model, sequences, self.model.config.pad_token_id, self.batch_size)


def reward_model_function(model_dir: Path | str, batch_size: int = 32,
                          step_aggregation: Literal["min", "last"] | None = None,
                          devices: DeviceConfig | None = None) -> Callable[..., list[float]]:
    """A TRL reward function scoring with the reward model in model_dir (loaded now, once, placed by
    `devices`: see RewardModelScorer); its `__name__` is "reward_model" (the name TRL and the reports give
    its column)."""
    scorer = RewardModelScorer(model_dir, batch_size=batch_size, step_aggregation=step_aggregation, devices=devices)

    def reward_model(prompts: list, completions: list, **kwargs) -> list[float]:
        return scorer(prompts, completions, **kwargs)

    reward_model.scorer = scorer
    return reward_model
