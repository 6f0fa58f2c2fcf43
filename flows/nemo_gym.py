"""axolotl's NeMo Gym plugin (`plugins: [axolotl.integrations.nemo_gym.NemoGymPlugin]` and its `nemo_gym_*` keys),
moved into posttrain's sections before validation (flows/config.py calls `move_nemo_gym_keys` first, before the
other axolotl validators of flows/axolotl.py read `datasets` and `trl`).

What the plugin does in axolotl (src/axolotl/integrations/nemo_gym/) and where it lands here:
- its datasets (`nemo_gym_datasets`: JSON Lines files of NeMo Gym, paths relative to `nemo_gym_dir`) replace
  `datasets` as the train rows: transform.datasets entries of type `nemo_gym` (stages/data/transform.py), each
  with its `server_name`, `max_samples` as the split `train[:max_samples]`;
- its single-turn reward (the `nemo_gym` reward the plugin adds, which `reward_nemo_gym_verify` in
  trl.reward_funcs also is) POSTs each completion to the `/verify` of the row's resources server, found on the
  head server at `nemo_gym_head_port`: `remote:nemo_gym`, a score.remote_verifiers entry with head_url
  (stages/scoring/rewards/remote.py);
- `nemo_gym_verify_timeout` and `nemo_gym_model_name` are that verifier's timeout_s and response_model.
Refused, each with the reason: starting or cloning NeMo Gym (`nemo_gym_auto_start: true`, `nemo_gym_config_paths`,
`nemo_gym_server_timeout`, a missing `nemo_gym_dir` with `nemo_gym_auto_clone`): posttrain uses the servers
`ng_run` runs; multi-turn (`nemo_gym_multi_turn`, `nemo_gym_max_turns`, the `reward_env` reward): NeMo Gym's agent
servers are not driven here (a multi-turn environment is rollout.rollout_func, configs/examples/multiturn).
"""

from __future__ import annotations

import math
from pathlib import Path

PLUGIN_NAMES = ("axolotl.integrations.nemo_gym.NemoGymPlugin", "axolotl.integrations.nemo_gym.plugin.NemoGymPlugin")
"""How axolotl's configs name the plugin."""
VERIFY_REWARDS = ("axolotl.integrations.nemo_gym.rewards.reward_nemo_gym_verify",
                  "axolotl.integrations.nemo_gym.reward_nemo_gym_verify")
"""The plugin's single-turn reward as trl.reward_funcs names it: the same /verify call as the reward the plugin adds."""
ENV_REWARDS = ("axolotl.integrations.nemo_gym.rewards.reward_env", "axolotl.integrations.nemo_gym.reward_env")
"""The plugin's multi-turn reward (the agent's /run reward passed through)."""
VERIFIER = "nemo_gym"
"""The score.remote_verifiers entry the plugin becomes (`remote:nemo_gym` in score.reward_funcs)."""
SERVER_COLUMN, FIELDS_COLUMN = "nemo_gym_server", "nemo_gym"
"""The prompts' columns that type nemo_gym writes: each row's resources server, and its fields as JSON text."""
DATASET_FIELDS = ("path", "server_name", "max_samples")
"""What a `nemo_gym_datasets` entry may set (axolotl's dataset.py reads these)."""
NOT_STARTED = ("posttrain does not clone or start NeMo Gym: start its servers with ng_run (e.g. ng_run "
               "\"+config_paths=[resources_servers/reasoning_gym/configs/resources_only.yaml]\"), as axolotl's guide "
               "does, and set nemo_gym_auto_start: false")
MULTI_TURN = ("multi-turn rollouts through NeMo Gym's agent servers (/run) are not driven here; single-turn /verify "
              "is, and a multi-turn environment is rollout.rollout_func (configs/examples/multiturn)")
REFUSED = {"nemo_gym_config_paths": NOT_STARTED, "nemo_gym_server_timeout": NOT_STARTED,
           "nemo_gym_max_turns": MULTI_TURN}
"""The plugin's keys for what posttrain does not do, and why: an error naming the key."""
KNOWN = ("nemo_gym_enabled", "nemo_gym_dir", "nemo_gym_auto_clone", "nemo_gym_auto_start", "nemo_gym_head_port",
         "nemo_gym_datasets", "nemo_gym_verify_timeout", "nemo_gym_model_name", "nemo_gym_multi_turn", *REFUSED)
"""Every key of the plugin (axolotl's integrations/nemo_gym/args.py)."""


def move_nemo_gym_keys(data) -> tuple[object, list[str]]:
    """(the config with the plugin's keys as posttrain sections (module docstring), the notes on what each became,
    for `posttrain validate`). A config without the plugin or its keys is returned as it is."""
    if not isinstance(data, dict):
        return data, []
    plugins = data.get("plugins")
    listed = isinstance(plugins, list) and any(p in PLUGIN_NAMES for p in plugins)
    given = {k: data[k] for k in data if isinstance(k, str) and k.startswith("nemo_gym_")}
    if not listed and not given:
        return data, []
    if not listed:
        raise ValueError(f"{next(iter(given))}: a key of axolotl's NeMo Gym plugin, which plugins does not list; add "
                         f"{PLUGIN_NAMES[0]} to plugins, or remove it")
    data = {k: v for k, v in data.items() if k not in given}
    others = [p for p in plugins if p not in PLUGIN_NAMES]
    data.pop("plugins")
    if others:  # refused by flows/axolotl.py, naming them
        data["plugins"] = others
    if unknown := [k for k in given if k not in KNOWN]:
        import difflib

        close = difflib.get_close_matches(unknown[0], KNOWN, n=1)
        raise ValueError(f"{unknown[0]}: not a key of axolotl's NeMo Gym plugin"
                         + (f"; did you mean {close[0]}?" if close else ""))
    if not given.get("nemo_gym_enabled"):
        if rest := [k for k in given if k != "nemo_gym_enabled"]:
            raise ValueError(f"{rest[0]}: nemo_gym_enabled is not true, so axolotl's NeMo Gym plugin reads none of "
                             "its keys; set nemo_gym_enabled: true, or remove them")
        return data, ["plugins: axolotl's NeMo Gym plugin, with nemo_gym_enabled unset, does nothing; nor does it here"]
    _refuse(given, data)
    notes = []
    data = _with_datasets(data, given, notes)
    data = _with_reward(data, given, notes)
    return data, notes


def _refuse(given: dict, data: dict) -> None:
    """An error naming the first key of the plugin's that asks for what posttrain does not do."""
    for key, why in REFUSED.items():
        if key in given:
            raise ValueError(f"{key}: {why}; remove it")
    if given.get("nemo_gym_auto_start") is True:
        raise ValueError(f"nemo_gym_auto_start: true: {NOT_STARTED}")
    if given.get("nemo_gym_multi_turn"):
        raise ValueError(f"nemo_gym_multi_turn: true: {MULTI_TURN}")
    if data.get("rl", "grpo") not in ("grpo", "gdpo"):
        raise ValueError(f"plugins: axolotl's NeMo Gym plugin scores GRPO's completions; rl: {data['rl']} has none")


def gym_dir(given: dict) -> Path:
    """nemo_gym_dir (axolotl's default ~/Gym), user-expanded; an error when it is not there (posttrain clones none)."""
    folder = Path(given.get("nemo_gym_dir") or "~/Gym").expanduser()
    if not folder.is_dir():
        clone = " (nemo_gym_auto_clone: posttrain clones nothing)" if given.get("nemo_gym_auto_clone", True) else ""
        raise ValueError(f"nemo_gym_dir: {folder} is not a folder{clone}; clone NeMo Gym there (git clone "
                         "https://github.com/NVIDIA-NeMo/Gym.git), or set nemo_gym_dir to your clone")
    return folder


def _with_datasets(data: dict, given: dict, notes: list[str]) -> dict:
    """nemo_gym_datasets as the train sources (axolotl's `datasets`, which the plugin's own rows replace)."""
    entries = given.get("nemo_gym_datasets")
    if not isinstance(entries, list) or not entries or not all(isinstance(e, dict) for e in entries):
        raise ValueError("nemo_gym_datasets: axolotl's NeMo Gym plugin needs a list of {path, server_name, "
                         "max_samples} entries (its training rows)")
    folder, sources = gym_dir(given), []
    for i, entry in enumerate(entries):
        key = f"nemo_gym_datasets.{i}"
        if extra := [k for k in entry if k not in DATASET_FIELDS]:
            raise ValueError(f"{key}.{extra[0]}: not a field of a NeMo Gym dataset (it has "
                             f"{', '.join(DATASET_FIELDS)})")
        if not entry.get("path"):
            raise ValueError(f"{key}.path: the JSON Lines file, absolute or relative to nemo_gym_dir")
        path = Path(str(entry["path"])).expanduser()
        path = path if path.is_absolute() else folder / path
        source = {"path": str(path), "type": "nemo_gym"}
        if entry.get("server_name"):
            source["server_name"] = entry["server_name"]
        if (most := entry.get("max_samples")) is not None:
            if not isinstance(most, int) or isinstance(most, bool) or most < 1:
                raise ValueError(f"{key}.max_samples: {most!r}; a whole number of rows >= 1")
            source["split"] = f"train[:{most}]"
            notes.append(f"{key}.max_samples: {most} -> the file's first {most} rows (axolotl draws {most} at random "
                         "without a seed; posttrain samples each round's prompts by its seed)")
        sources.append(source)
    if "datasets" in data:
        notes.append("datasets: replaced by nemo_gym_datasets' rows, as axolotl's NeMo Gym plugin loads those")
    notes.append(f"nemo_gym_datasets: {len(sources)} source(s) of type nemo_gym -> transform.datasets (prompts from "
                 "responses_create_params.input; each row's fields kept for /verify)")
    return {**data, "datasets": sources}


def _with_reward(data: dict, given: dict, notes: list[str]) -> dict:
    """The plugin's /verify reward as `remote:nemo_gym` in trl.reward_funcs and its verifier in score."""
    from stages.scoring.rewards.remote import REMOTE_PREFIX, RemoteVerifierConfig

    trl = dict(data.get("trl") or {})
    funcs = list(trl.get("reward_funcs") or [])
    if env := [f for f in funcs if f in ENV_REWARDS]:
        raise ValueError(f"trl.reward_funcs: {env[0]}: {MULTI_TURN}; remove it")
    name = REMOTE_PREFIX + VERIFIER
    verify = [i for i, f in enumerate(funcs) if f in VERIFY_REWARDS]
    if verify:
        original = funcs[verify[0]]
        funcs = [name if i == verify[0] else f for i, f in enumerate(funcs) if i not in verify[1:]]
        if trl.get("reward_weights") is not None:
            trl["reward_weights"] = [w for i, w in enumerate(trl["reward_weights"]) if i not in verify[1:]]
        notes.append(f"trl.reward_funcs: {original} -> {name} (axolotl's plugin also adds its own "
                     "nemo_gym reward, the same /verify call: posttrain scores it once, which gives the same "
                     "advantages when they are scaled by the group's std, TRL's default)")
    else:
        funcs.append(name)
        if trl.get("reward_weights") is not None:
            trl["reward_weights"] = [*trl["reward_weights"], 1.0]
        notes.append(f"plugins: axolotl's NeMo Gym plugin adds its /verify reward -> {name} in score.reward_funcs")
    trl["reward_funcs"] = funcs
    port = given.get("nemo_gym_head_port", 11000)
    verifier = RemoteVerifierConfig(head_url=f"http://127.0.0.1:{port}", server_column=SERVER_COLUMN,
                                    fields_column=FIELDS_COLUMN, timeout_s=given.get("nemo_gym_verify_timeout") or 30,
                                    response_model=str(given.get("nemo_gym_model_name") or data.get("base_model")
                                                       or "posttrain"))
    score = dict(data.get("score") or {})
    verifiers = dict(score.get("remote_verifiers") or {})
    if VERIFIER in verifiers:
        raise ValueError(f"score.remote_verifiers.{VERIFIER}: the name axolotl's NeMo Gym plugin's verifier takes "
                         "here; rename yours")
    verifiers[VERIFIER] = verifier.model_dump(exclude_defaults=True)
    score["remote_verifiers"] = verifiers
    timeout = "nemo_gym_verify_timeout" if "nemo_gym_verify_timeout" in given else "axolotl's default verify timeout"
    notes.append(f"nemo_gym_head_port: {port} -> score.remote_verifiers.{VERIFIER}.head_url {verifier.head_url} (each "
                 f"row's /verify on its resources server there); {timeout} -> timeout_s {verifier.timeout_s:g}")
    if "reward_timeout_s" not in score and verifier.worst_case_s() > 60:
        score["reward_timeout_s"] = float(math.ceil(verifier.worst_case_s()))
        notes.append(f"score.reward_timeout_s: {score['reward_timeout_s']:g} (the verifier's timeout with its retries)")
    return {**data, "trl": trl, "score": score}
