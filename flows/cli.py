"""`posttrain` command line.

  posttrain init FOLDER                          a new task that runs as it is: config, five rows, reward module
  posttrain run CONFIG [KEY.PATH=VALUE ...]     run the pipeline (e.g. grpo.rounds=2)
  posttrain validate CONFIG [KEY.PATH=VALUE ...]  print a config resolved and check what a run would trip on
  posttrain vllm-serve CONFIG [--port N] [--print] start `vllm serve` for a config's starting policy (axolotl's
                                                 spelling; serve-vllm is the same command)
  posttrain serve-rewards CONFIG [--host H] [--port N]  serve a config's reward functions at /verify
  posttrain runs [--artifacts DIR] [--experiment NAME]   list pipeline runs, newest first
  posttrain compare RUN RUN... [--artifacts DIR] [--plot PATH]  runs side by side, plus a curves PNG
  posttrain report RUN [-o PATH] [--artifacts DIR]     one run as a self-contained HTML page
  posttrain data add FILE [--config CONFIG] [--emit]   register a training data version, announce it
  posttrain data list|watch [--config CONFIG]          versions; register files dropped into data.inbox
  posttrain deploy CONFIG [--name N] [--pool posttrain] deployment with the config's schedule + data trigger
  posttrain resume RUN [--artifacts DIR] [--allow-config-change]  continue a killed or failed run
  posttrain server [--port 4200] [--artifacts DIR]  local Prefect server + process worker for prefect.yaml
  posttrain verify [--artifacts DIR] [--stage S] [--repair]  check every artifact's sha256; set damaged ones aside

No Prefect server configured (PREFECT_API_URL unset): an ephemeral one, with
PREFECT_HOME under the artifacts folder unless you set PREFECT_HOME. MLflow: the
sqlite file artifacts/mlflow.db unless MLFLOW_TRACKING_URI is set.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import yaml

from flows.launch import embedded_defaults, report_errors, start_temporary_prefect_server


def main(argv: list[str] | None = None) -> int:
    """Parse argv and call the subcommand's handler. A new subcommand: add_parser + set_defaults(handler=...);
    `extras_into` names the list argument that collects positionals found after options (or None)."""
    parser = argparse.ArgumentParser(prog="posttrain", description="Post-training pipeline (Prefect + MLflow).")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (("run", "run the pipeline"), ("validate", "validate a config and print it resolved"),
                            ("vllm-serve", "build (or find cached) the config's starting policy and serve it with "
                                           "vLLM's OpenAI server (`vllm serve`, LoRA enabled for a LoRA policy) "
                                           "with the config's rollout.vllm settings, for rollout.engine "
                                           "vllm_server: axolotl's two-terminal workflow")):
        p = sub.add_parser(name, help=help_text, aliases=["serve-vllm"] if name == "vllm-serve" else [])
        p.add_argument("config", help="YAML config, e.g. configs/quickstart.yaml")
        p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. grpo.rounds=2 rollout.temperature=0.8")
        p.set_defaults(handler=pipeline_command, extras_into="overrides")
        if name == "validate":
            p.add_argument("--full", action="store_true",
                           help="print every setting, also those this run uses nothing of (demo_data with your "
                                "own rows, a built model's sizes with model.path, sft's with SFT off)")
        if name in ("run", "vllm-serve"):
            p.add_argument("--quiet", action="store_true", help="no progress lines or summary table")
            p.add_argument("--verbose", action="store_true",
                           help="also Prefect's own console lines (each task run's state, the flow run's link)")
            p.add_argument("--debug", action="store_true",
                           help="on a data, reward-function or file error, show the whole traceback")
        if name == "vllm-serve":
            p.add_argument("--port", type=int, default=None,
                           help="default: the port of rollout.vllm.server_urls' first URL (or server_url)")
            p.add_argument("--print", dest="print_only", action="store_true",
                           help="print the command and environment instead of starting the server")

    p = sub.add_parser("runs", help="list pipeline runs (MLflow parent runs), newest first")
    p.add_argument("--artifacts", default="artifacts", help="artifacts folder holding mlflow.db (default: artifacts)")
    p.add_argument("--experiment", default=None, help="only this experiment (the config's name)")
    p.set_defaults(handler=runs_command, extras_into=None)

    p = sub.add_parser("compare", help="compare runs side by side: config differences, final metrics, "
                                      "wall time per stage, shared artifacts; writes a curves PNG")
    p.add_argument("runs", nargs="+", metavar="RUN", help="run name (e.g. quickstart-20261122-031500) or MLflow run id")
    p.add_argument("--artifacts", default="artifacts", help="artifacts folder holding mlflow.db (default: artifacts)")
    p.add_argument("--plot", default=None, help="PNG path (default: <artifacts>/compare-<names>.png)")
    p.set_defaults(handler=compare_command, extras_into="runs")

    p = sub.add_parser("diff", help="two runs prompt by prompt on their shared held-out set: flipped verdicts with "
                                    "both completions, answers, rewards per round")
    p.add_argument("runs", nargs=2, metavar="RUN",
                   help="run name (e.g. quickstart-20261122-031500) or MLflow run id; A first, then B")
    p.add_argument("--artifacts", default="artifacts", help="artifacts folder holding mlflow.db (default: artifacts)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead (completions in full)")
    p.add_argument("--limit", type=flip_count, default=None,
                   help="flips shown per direction (default: 10 in the terminal, all with --json)")
    p.add_argument("--html", default=None, metavar="PATH",
                   help="also write both runs as one self-contained HTML page: flips with both completions, curves")
    p.set_defaults(handler=diff_command, extras_into=None)

    p = sub.add_parser("trace", help="one prompt of a run traced to its sources: eval completion and verdict, the "
                                     "model's artifact chain, each round's rollouts of it, reward code, source row")
    p.add_argument("run", metavar="RUN", help="run name (e.g. quickstart-20261122-031500) or MLflow run id")
    p.add_argument("prompt_id", nargs="?", default=None, metavar="PROMPT_ID",
                   help="an eval or train prompt id (e.g. eval-000003); none: list the first eval rows")
    p.add_argument("--eval-row", type=flip_count, default=None, help="the final eval's row N instead of a prompt id")
    p.add_argument("--artifacts", default="artifacts", help="artifacts folder holding mlflow.db (default: artifacts)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    p.set_defaults(handler=trace_command, extras_into=None)

    p = sub.add_parser("report", help="one run as a self-contained HTML page: curves per round with the health "
                                      "checks' bands, eval before/after, flips, sample completions, cost, stages")
    p.add_argument("run", metavar="RUN", help="run name (e.g. quickstart-20261122-031500) or MLflow run id")
    p.add_argument("-o", "--output", default=None, metavar="PATH",
                   help="HTML path (default: <artifacts>/runs/<run>/report.html, the page the run wrote at its end)")
    p.add_argument("--artifacts", default="artifacts", help="artifacts folder holding mlflow.db (default: artifacts)")
    p.set_defaults(handler=report_command, extras_into=None)

    from flows import init, resume, retrain, serve_rewards, server, verify

    p = init.add_arguments(sub.add_parser("init", help="write a new task that runs as it is: a config, five rows of "
                                                       "data and a reward function (flows/init.py)"))
    p.set_defaults(handler=init.init_command, extras_into=None)

    p = serve_rewards.add_arguments(sub.add_parser(
        "serve-rewards", help="serve the config's score.reward_funcs as an HTTP verification service (NeMo Gym "
                              "/verify shape), for `remote:<name>` reward functions of runs on other machines"))
    p.set_defaults(handler=serve_rewards.serve_command, extras_into="overrides")

    p = sub.add_parser("data", help="registered training data versions: add FILE, list, watch (data.inbox)")
    retrain.add_data_arguments(p)
    p.set_defaults(handler=retrain.data_command, extras_into=None)

    p = sub.add_parser("deploy", help="register a config's deployment with its cron schedule and a new-data trigger")
    retrain.add_deploy_arguments(p)
    p.set_defaults(handler=retrain.deploy_command, extras_into=None)

    p = sub.add_parser("resume", help="continue a killed or failed run (same MLflow run, finished stages reused)")
    resume.add_arguments(p)
    p.set_defaults(handler=resume.resume_command, extras_into="overrides")

    p = verify.add_arguments(sub.add_parser("verify", help="check every artifact folder's files against its manifest "
                                                           "(sha256); --repair sets damaged ones aside"))
    p.set_defaults(handler=verify.verify_command, extras_into=None)

    from flows import rescore

    rescore.add_arguments(sub.add_parser("rescore", help="re-score a run's stored rollouts with other reward functions "
                                                         "(same score stage and cache) and show how rewards and "
                                                         "group advantages change per round"))

    p = server.add_arguments(sub.add_parser("server", help="local Prefect server (SQLite under artifacts/) and a "
                                                           "process worker for prefect.yaml's deployments"))
    p.set_defaults(handler=server.serve, extras_into=None)

    # Positionals may come after options too (`run CONFIG --quiet grpo.rounds=2`).
    args, extra = parser.parse_known_args(argv)
    unknown = [a for a in extra if a.startswith("-")]
    if unknown or (extra and args.extras_into is None):
        parser.error(f"unrecognized arguments: {' '.join(unknown or extra)}")
    if args.extras_into:
        getattr(args, args.extras_into).extend(extra)
    if args.command == "serve-vllm":
        args.command = "vllm-serve"  # one command, two spellings
    return args.handler(args)


BUILT_MODEL_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                     "intermediate_size", "max_position_embeddings", "seed")
"""model.* fields of a model built here (stages/data/base_model.py), unused where model.path names one."""


def shown_config(cfg, full: bool = False) -> tuple[dict, list[str]]:
    """What `posttrain validate` prints: the run's config (run_config), less what this run uses nothing of unless
    `full`: demo_data where the run reads your rows, a built model's sizes where model.path is set, sft's settings
    where SFT is off. Returns (config, what was left out and why)."""
    from flows.config import DPO_FAMILY

    shown, hidden = cfg.run_config(), []
    if full:
        return shown, hidden
    own_rows = bool(cfg.transform.paths or cfg.transform.datasets) or not cfg.reads_prompts
    demo_pairs = cfg.preferences is None and (cfg.rl in DPO_FAMILY or cfg.rl == "reward_model"
                                              or "reward_model" in cfg.score.reward_funcs)
    if own_rows and not demo_pairs and shown.pop("demo_data", None) is not None:
        hidden.append("demo_data (the run reads your rows)")
    if cfg.model.path and isinstance(shown.get("model"), dict):
        for field in BUILT_MODEL_FIELDS:
            shown["model"].pop(field, None)
        hidden.append(f"model.{', model.'.join(BUILT_MODEL_FIELDS)} (sizes of a model built here; model.path is set)")
    hidden += _unused_rollout_settings(cfg, shown.get("rollout"))
    if not cfg.sft.enabled and isinstance(shown.get("sft"), dict):
        shown["sft"] = {"enabled": False}
        hidden.append("sft's other settings (sft is off)")
    return shown, hidden


def _unused_rollout_settings(cfg, rollout: dict | None) -> list[str]:
    """Drop from the shown `rollout` section the settings of engines and sources this run does not use; say which."""
    from stages.rollout.rollout import SERVER_KEYS

    if not isinstance(rollout, dict):
        return []
    hidden = []
    if cfg.rollout.source != "atropos" and rollout.pop("atropos", None) is not None:
        hidden.append(f"rollout.atropos (rollout.source is {cfg.rollout.source})")
    if cfg.rollout.engine != "ray_vllm" and rollout.pop("ray_vllm", None) is not None:
        hidden.append(f"rollout.ray_vllm (rollout.engine is {cfg.rollout.engine})")
    if cfg.rollout.engine == "transformers" and rollout.pop("vllm", None) is not None:
        hidden.append("rollout.vllm (rollout.engine is transformers)")
    elif cfg.rollout.engine != "vllm_server" and isinstance(rollout.get("vllm"), dict):
        for key in (*SERVER_KEYS, "serve_host"):
            rollout["vllm"].pop(key, None)
        hidden.append(f"rollout.vllm's server settings (rollout.engine is {cfg.rollout.engine})")
    return hidden


def pipeline_command(args) -> int:
    """run / validate / vllm-serve: load the config, then act on it."""
    from flows.config import ConfigError, load_config

    from flows import preflight

    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"config error:\n{e}", file=sys.stderr)
        return 2
    if args.command == "validate":  # the resolved config, then what a run would trip on (flows/preflight.py)
        shown, hidden = shown_config(cfg, full=args.full)
        print(yaml.safe_dump(shown, sort_keys=False), end="")
        if hidden:
            print(f"# not shown, not used by this run: {'; '.join(hidden)} (posttrain validate --full prints them)")
        report = preflight.inspect_config(cfg, args.config)
        for note in report.notes:
            print(f"note: {note}", file=sys.stderr)
        for problem in report.problems:
            print(f"error: {problem}", file=sys.stderr)
        return 2 if report.problems else 0
    if args.command == "run":  # seconds, before the Prefect server starts: exit 2 naming each problem
        try:
            preflight.check(cfg, args.config)
        except preflight.PreflightError as e:
            print("\n".join(f"error: {line}" for line in e.problems), file=sys.stderr)
            return 2

    from tasks.store import StorageError, check_writable

    try:
        check_writable(Path(cfg.artifacts_dir))
    except StorageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    embedded_defaults(cfg.artifacts_dir)
    if not args.verbose:  # Prefect's per-task state lines off the console (its UI still gets every log line),
        os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "WARNING")  # and datasets' map bars
        os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    server_ready = start_temporary_prefect_server() if args.command == "run" else None  # boots meanwhile
    from flows.pipeline import posttrain_pipeline  # (imports Prefect, which sets up its log handlers)

    def run() -> int:
        if args.command == "vllm-serve":
            return serve_vllm(cfg, args)
        if server_ready:
            server_ready()
        posttrain_pipeline(args.config, args.overrides, quiet=args.quiet)
        return 0

    return report_errors(run, args.debug)


def runs_command(args) -> int:
    from flows import compare
    from tasks.lineage import StoreBusyError

    try:
        print(compare.runs_command(args.artifacts, args.experiment))
    except (compare.CompareError, StoreBusyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def compare_command(args) -> int:
    from flows import compare
    from tasks.lineage import StoreBusyError

    try:
        print(compare.compare_command(args.runs, args.artifacts, args.plot))
    except (compare.CompareError, StoreBusyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def flip_count(text: str) -> int:
    """`posttrain diff --limit`: a count, 0 or more."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text}: a count of flips, 0 or more")
    return value


def diff_command(args) -> int:
    """`posttrain diff` (flows/diff.py, imported only for it: it reads MLflow, a second to import); --html writes
    flows/report.py's page of the two runs."""
    from flows import diff

    if getattr(args, "html", None):
        from flows.report import write_diff_page

        return diff.diff_command(args, write_diff_page)
    return diff.diff_command(args)


def trace_command(args) -> int:
    """`posttrain trace` (flows/trace.py, imported only for it, as diff is)."""
    from flows import trace

    return trace.trace_command(args)


def report_command(args) -> int:
    """`posttrain report` (flows/report.py, imported only for it: MLflow, and plotly when it draws)."""
    from flows import report

    return report.report_command(args)


def serve_vllm(cfg, args) -> int:
    """`posttrain vllm-serve`: materialize the starting policy, then replace this process with vLLM's OpenAI
    server for it (as `axolotl vllm-serve` starts TRL's for the config's base model): rollout.vllm's
    tensor_parallel_size, gpu_memory_utilization, dtype, max_model_len and enforce_eager as its flags, listening
    on rollout.vllm.serve_host (axolotl's vllm.host) at the port of the run's server URL (axolotl's vllm.port /
    trl.vllm_server_port), taking each round's full weights in place, and LoRA enabled up to grpo.lora_r for a
    LoRA policy sent as an adapter (rollout.vllm.lora_sync: adapter; auto: on a GPU)."""
    import shlex
    from urllib.parse import urlparse

    from flows.pipeline import prepare_policy_flow
    from stages.rollout.engines.vllm_server import serve_command, serves_adapters
    from stages.rollout.rollout import engine_options, vllm_options
    from stages.runtime.devices import of

    model_dir = prepare_policy_flow(args.config, args.overrides, quiet=args.quiet)
    url = (cfg.rollout.vllm.server_urls or [cfg.rollout.vllm.server_url])[0]
    port = args.port or urlparse(url).port or 8000
    devices = of(cfg.train)  # vllm.dtype auto: the dtype the run's trainer computes in
    options = {**vllm_options(cfg.rollout, devices), **engine_options(cfg.rollout, cfg.grpo.lora_r, devices)}
    argv, env = serve_command(model_dir, port, cfg.grpo.lora_r, options, host=cfg.rollout.vllm.serve_host,
                              lora=serves_adapters(cfg.grpo.adapter, cfg.rollout.vllm.lora_sync))
    print(" ".join(f"{k}={shlex.quote(str(v))}" for k, v in env.items()), shlex.join(argv), flush=True)
    if args.print_only:
        return 0
    os.execvpe(argv[0], argv, {**os.environ, **{k: str(v) for k, v in env.items()}})
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
