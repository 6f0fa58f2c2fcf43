"""Training across processes (issue 14 item 3): a 2-process (gloo) run equals the 1-process run.

Each torchrun start costs several seconds of imports, so one launch runs every GRPO case
(`run_grpo_cases`, imported by the ranks from this module). AdamW's first step hides the scale of
the gradient (m / sqrt(v) is its sign), so besides the weights the per-step grad_norm (before
clipping) and loss are compared: a rank that averaged instead of summed would halve them.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import cluster
from conftest import tiny_say_policy

from stages.data.schemas import ROLLOUTS, SCORED, write_table
from stages.rollout import rollout
from stages.rollout.engines import Policy
from stages.runtime import distributed, ray_training
from stages.training import grpo

pytestmark = pytest.mark.slow

SIGNAL = [1.0, -0.5, 0.8, -1.3]  # advantage per group index

CASES = {
    # per-micro-batch normalization; 4 micro-batches in steps of 3: step 0 runs 2 + 1 on the ranks, step 1
    # runs 1 + 0 (rank 1 contributes a zero gradient)
    "grpo_odd": dict(loss_type="grpo", micro_batch_size=8, gradient_accumulation_steps=3,
                     skip_zero_advantage_batches=False, optim="sgd", learning_rate=0.1),
    # default loss (dapo, beta 0): only rows with signal run, regrouped by prompt; a step's normalizer is
    # the token count of the whole step, not of a rank's share
    "dapo_skip": dict(loss_type="dapo", micro_batch_size=4, gradient_accumulation_steps=4, optim="sgd",
                      learning_rate=0.1),
    # dapo with a KL term (reference = adapter disabled): micro-batches as cut, all-zero ones skipped
    "dapo_kl_skip": dict(loss_type="dapo", beta=0.04, micro_batch_size=4, gradient_accumulation_steps=3,
                         optim="sgd", learning_rate=0.1),
    # the default optimizer: Adam divides by sqrt(v), which turns float noise in gradient entries near 0
    # into weight differences up to ~1e-3 of the learning rate, hence its looser tolerance
    "dapo_adamw": dict(loss_type="dapo", micro_batch_size=4, gradient_accumulation_steps=4, learning_rate=1e-2),
    # every weight trains (FSDP shards them all), with a KL term to a frozen reference model
    "full_kl": dict(adapter="none", loss_type="grpo", beta=0.04, micro_batch_size=8, gradient_accumulation_steps=3,
                    skip_zero_advantage_batches=False, optim="sgd", learning_rate=0.1),
}
WEIGHT_TOLERANCE = {"dapo_adamw": 2e-5}  # others: 1e-6
# fsdp computes log-probs with a plain forward instead of the shared prompt pass (stages/training/grpo.py): ~1e-7 apart,
# which Adam's first steps (m / sqrt(v) near a zero gradient entry) amplify to ~5e-2 of its learning rate (1e-2)
FSDP_ADAMW_TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(root, scored path): a tiny policy, one round of its rollouts, advantages by hand: groups 0-3
    of prompts 0-4 have signal, the other prompts' groups have advantage 0 (skipped micro-batches)."""
    root = tiny_say_policy(tmp_path_factory.mktemp("distributed"), num_prompts=16)
    (root / "rollouts").mkdir()
    rollout.run(rollout.RolloutConfig(num_generations=4, prompts_per_round=8, max_completion_length=6),
                Policy(root / "model"), root / "prompts" / "train.parquet", 0, root / "rollouts")
    rows = pq.read_table(root / "rollouts" / "rollouts.parquet").to_pylist()
    prompts = sorted({r["prompt_id"] for r in rows})
    values = [SIGNAL[r["group_index"]] if r["prompt_id"] in prompts[:3] else 0.0 for r in rows]
    table = (pa.Table.from_pylist(rows, schema=ROLLOUTS)
             .append_column("rewards", pa.array([[("toy", a)] for a in values], type=SCORED.field("rewards").type))
             .append_column("reward", pa.array(values, type=pa.float64()))
             .append_column("advantage", pa.array(values, type=pa.float64()))
             .append_column("errors", pa.array([[] for _ in rows], type=SCORED.field("errors").type)))
    scored = root / "scored.parquet"
    write_table(table, scored, SCORED)
    return root, scored


def run_grpo_cases(root: str, scored: str, out: str, on_metrics=None, on_step=None, group=None,
                   cases: list[str] | None = None) -> dict:
    """grpo.run round 0 and round 1 (optimizer state carried) of every case into out/<case>/r<i>; returns
    {case: [summary r0, summary r1]} with each step's metrics under "steps". Runs in one process or on ranks."""
    from pathlib import Path

    results = {}
    for name in cases or CASES:
        cfg = grpo.GRPOConfig(**CASES[name])
        prev, results[name] = None, []
        for round_index in range(2):
            folder = Path(out) / name / f"r{round_index}"
            folder.mkdir(parents=True, exist_ok=True)
            steps = []

            def record(metrics, step):
                steps.append(metrics)
                if on_metrics:
                    on_metrics(metrics, step)

            summary = grpo.run(cfg, Path(root) / "model", prev, Path(scored), round_index, 1.0, 6, folder,
                               on_metrics=record, on_step=on_step, group=group)
            results[name].append({**summary, "steps": steps})
            prev = folder
    return results


def _weights(folder):
    from safetensors.torch import load_file

    adapter = folder / "adapter_model.safetensors"
    return load_file(str(adapter if adapter.exists() else folder / "model.safetensors"))


@pytest.fixture(scope="module")
def one_process(tiny, tmp_path_factory):
    """(folder, results) of every GRPO case run in this process."""
    root, scored = tiny
    out = tmp_path_factory.mktemp("one")
    return out, run_grpo_cases(str(root), str(scored), str(out))


def assert_equal_runs(first: Path, one: dict, second: Path, two: dict, strategy: str) -> None:
    """The cases of `two` (written under `second`) trained what the one-process run did (`one`, under `first`)."""
    for name in two:
        for round_index in range(2):
            a, b = one[name][round_index], two[name][round_index]
            assert a["optimizer_steps"] == b["optimizer_steps"] > 0, name
            assert (a["skipped_batches"], a["trained_rows"]) == (b["skipped_batches"], b["trained_rows"]), name
            for step_a, step_b in zip(a["steps"], b["steps"], strict=True):
                for key in ("loss", "grad_norm", "kl", "clip_ratio", "mean_ratio", "entropy", "is_ratio_mean"):
                    assert step_b[key] == pytest.approx(step_a[key], rel=1e-5, abs=1e-7), (name, key)
            w1, w2 = (_weights(run / name / f"r{round_index}") for run in (first, second))
            assert w1.keys() == w2.keys()
            diff = max(float((w1[k] - w2[k]).abs().max()) for k in w1)
            tolerance = FSDP_ADAMW_TOLERANCE if (strategy, name) == ("fsdp", "dapo_adamw") else \
                WEIGHT_TOLERANCE.get(name, 1e-6)
            assert diff < tolerance, (name, round_index, diff)
            assert float(max((w1[k] - _weights(first / name / "r0")[k]).abs().max() for k in w1)) > 0 \
                or round_index == 0  # round 1 moved the weights
            # rank 0 alone wrote the folder, and carried the optimizer state to round 1
            assert (second / name / f"r{round_index}" / "optimizer.pt").is_file()
        assert two[name][1]["optimizer_state"] == "loaded"
        # the optimizer file is a one-process run's (whole tensors, same keys and shapes): either resumes the other
        saved_one, saved_two = (torch.load(run / name / "r1" / "optimizer.pt", weights_only=True)["state_dict"]
                                for run in (first, second))
        assert saved_one["state"].keys() == saved_two["state"].keys(), name
        for index, state in saved_one["state"].items():
            for key, value in state.items():
                assert getattr(saved_two["state"][index][key], "shape", None) == getattr(value, "shape", None)
        held = two[name][0]["trainable_params_per_rank"] / one[name][0]["trainable_params_per_rank"]
        assert held == (1.0 if strategy == "ddp" else pytest.approx(0.5, abs=0.05)), (name, held)  # sharded


def crash_on_rank_1(out: str, on_metrics=None, on_step=None, group=None) -> dict:
    """Rank 0 writes into the stage's folder; rank 1 dies by SIGKILL while rank 0 waits in a collective."""
    import torch.distributed as dist

    if group.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    (Path(out) / "adapter_model.safetensors").write_text("half")
    dist.barrier()
    return {}


def raise_on_rank_0(on_metrics=None, on_step=None, group=None) -> dict:
    if group.rank == 0:
        raise ValueError("grpo.loss_type: a bad value")
    import torch.distributed as dist

    dist.barrier()
    return {}


@pytest.fixture(scope="module")
def two_nodes(ray_home):
    """A Ray cluster of two loopback nodes, one CPU each."""
    with cluster.joined_ray_cluster(ray_home, nodes=2) as address:
        yield address


def grpo_cases_then_sft(grpo: dict, sft: dict, on_metrics=None, on_step=None, group=None) -> dict:
    """run_grpo_cases(**grpo) with the step metrics and progress, then sft_on_ranks(**sft), on the same ranks: one
    Ray Train launch (each starts its workers: ~20 s of CPU) for both kinds of stage."""
    return {"grpo": run_grpo_cases(**grpo, on_metrics=on_metrics, on_step=on_step, group=group),
            "sft": sft_on_ranks(**sft, group=group)}


def test_grpo_and_sft_on_ray_train_workers_on_two_nodes_equal_one_process(tiny, one_process, two_nodes, tmp_path):
    """train.backend: ray: the ranks are Ray Train workers, one on each node (gloo across the nodes' processes).
    GRPO sharded with fsdp: same weights as one process, step metrics streamed back, rank 0 wrote the folders. Then
    an HF Trainer stage (SFT) on the same workers: Trainer runs DDP over the process group Ray Train set up, and ends
    with one process's loss and weights."""
    from test_checkpoints import sft_inputs, weights

    root, scored = tiny
    first, one = one_process
    sft_root = tmp_path / "sft"
    sft_inputs(sft_root)
    for name in ("one", "two"):
        (sft_root / name).mkdir()
    sft_one = sft_on_ranks(str(sft_root), str(sft_root / "one"), str(sft_root / "work-one"))
    events, progress = [], []
    train = distributed.TrainConfig(num_processes=2, strategy="fsdp", backend="ray", ray={"address": two_nodes})
    both = ray_training.launch_on_ray(
        "test_distributed:grpo_cases_then_sft",
        {"grpo": dict(root=str(root), scored=str(scored), out=str(tmp_path / "two"), cases=["dapo_skip", "full_kl"]),
         "sft": dict(root=str(sft_root), out=str(sft_root / "two"), work=str(sft_root / "work-two"))},
        train, "optimize (ray)", on_metrics=lambda m, step: events.append((step, m)),
        on_step=lambda done, total: progress.append((done, total)))
    assert both.pop("train_nodes") == 2
    two, sft_two = both["grpo"], both["sft"]
    assert_equal_runs(first, one, tmp_path / "two", two, "fsdp")
    assert len(events) == sum(len(r["steps"]) for name in two for r in one[name])
    assert progress and progress[-1][0] == progress[-1][1]

    assert sft_two["steps"] == sft_one["steps"] == 30
    assert sft_two["train_loss"] == pytest.approx(sft_one["train_loss"], rel=1e-5)
    w1, w2 = weights(sft_root / "one"), weights(sft_root / "two")
    assert max(float((w1[k] - w2[k]).abs().max()) for k in w1) < 1e-5


def test_ray_train_failures_are_clear(two_nodes):
    train = distributed.TrainConfig(num_processes=2, backend="ray", ray={"address": two_nodes})
    with pytest.raises(distributed.DistributedError) as e:
        ray_training.launch_on_ray("test_distributed:raise_on_rank_0", {}, train, "sft")
    message = str(e.value)
    assert message.startswith("sft: training on 2 Ray Train workers") and "grpo.loss_type: a bad value" in message
    too_many = train.model_copy(update={"num_processes": 3})
    with pytest.raises(distributed.DistributedError, match=r"3 ranks .* cannot fit .*CPU.*3 asked, 2 in the cluster"):
        ray_training.launch_on_ray("test_distributed:raise_on_rank_0", {}, too_many, "optimize r0")


def test_dead_rank_fails_the_stage_and_publishes_nothing(tmp_path):
    from tasks.store import ArtifactStore

    store = ArtifactStore(tmp_path / "artifacts")
    with pytest.raises(distributed.DistributedError) as e:
        store.write("optimize", "k" * 16,
                    lambda out: distributed.launch("test_distributed:crash_on_rank_1", {"out": str(out)},
                                                   distributed.TrainConfig(num_processes=2), "optimize r3"),
                    inputs={}, config={})
    message = str(e.value)
    assert message.startswith("optimize r3: training on 2 processes failed"), message
    assert "rank 1 ended with exit code -9" in message and "SIGKILL" in message and "workers' log" in message
    assert not store.path("optimize", "k" * 16).exists()
    assert store.get("optimize", "k" * 16) is None
    assert not list(store.path("optimize", "k" * 16).parent.glob(".tmp-*"))  # the half-written folder is gone


def test_error_on_a_rank_is_quoted():
    with pytest.raises(distributed.DistributedError) as e:
        distributed.launch("test_distributed:raise_on_rank_0", {}, distributed.TrainConfig(num_processes=2), "sft")
    message = str(e.value)
    assert message.startswith("sft: training on 2 processes failed") and "rank 0 raised:" in message
    assert "ValueError: grpo.loss_type: a bad value" in message


def rank_pids(on_metrics=None, on_step=None, group=None) -> dict:
    """Every rank's process id, in rank order."""
    import torch.distributed as dist

    pids = [None] * group.world_size
    dist.all_gather_object(pids, os.getpid())
    return {"pids": pids}


def running(pid: int) -> bool:
    """Whether the process exists and has not exited (a zombie counts as gone)."""
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def gone(pids: list[int], timeout_s: float = 30.0) -> bool:
    import time

    deadline = time.monotonic() + timeout_s
    while any(running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(running(pid) for pid in pids)


def test_warm_ranks_run_the_next_launch_and_end_with_their_scope():
    """Inside warm_ranks() (a pipeline run) a launch runs on the last launch's ranks; a failed job takes its ranks
    down (the next launch starts new ones), so does a sys.path entry they lack (a user's code folder; not the one
    `import ray` adds, which training never imports from), and leaving the scope ends them. Outside it each launch
    has its own."""
    train = distributed.TrainConfig(num_processes=2)
    with distributed.warm_ranks():
        first = distributed.launch("test_distributed:rank_pids", {}, train, "sft")["pids"]
        assert len(set(first)) == 2 and os.getpid() not in first
        with pytest.MonkeyPatch.context() as patch:  # what `import ray` adds (a score stage on Ray between them)
            patch.syspath_prepend(str(Path(ray_package_dir()) / "thirdparty_files"))
            assert distributed.launch("test_distributed:rank_pids", {}, train, "optimize r0")["pids"] == first
        with pytest.raises(distributed.DistributedError, match="optimize r1: training on 2 processes failed"):
            distributed.launch("test_distributed:raise_on_rank_0", {}, train, "optimize r1")
        assert gone(first)
        again = distributed.launch("test_distributed:rank_pids", {}, train, "optimize r1")["pids"]
        assert set(again).isdisjoint(first) and all(running(pid) for pid in again)
        with pytest.MonkeyPatch.context() as patch:  # a folder this process can import from and the ranks cannot
            patch.syspath_prepend(str(Path(__file__).parent / "no-such-folder"))
            newer = distributed.launch("test_distributed:rank_pids", {}, train, "optimize r2")["pids"]
        assert set(newer).isdisjoint(again) and gone(again)
    assert gone(newer)
    alone = distributed.launch("test_distributed:rank_pids", {}, train, "sft")["pids"]
    assert gone(alone) and set(alone).isdisjoint(newer)


def ray_package_dir() -> str:
    """Where Ray is installed (not imported: its folder is what `import ray` puts on sys.path, under it)."""
    import importlib.util

    spec = importlib.util.find_spec("ray")
    return spec.submodule_search_locations[0] if spec else "/site-packages/ray"


def test_fsdp_with_a_factored_optimizer_or_chunked_logps_is_a_config_error():
    from flows.config import PipelineConfig

    with pytest.raises(ValueError, match="train.strategy: fsdp shards the optimizer state"):
        PipelineConfig.model_validate({"train": {"num_processes": 2, "strategy": "fsdp"},
                                       "grpo": {"optim": "adafactor"}})
    PipelineConfig.model_validate({"train": {"num_processes": 2, "strategy": "fsdp"}})  # adamw: fine
    with pytest.raises(ValueError, match="grpo.logps_chunk_tokens with train.strategy: fsdp is not built"):
        PipelineConfig.model_validate({"train": {"num_processes": 2, "strategy": "fsdp"},
                                       "grpo": {"logps_chunk_tokens": 4096}})


def test_group_sums_gradients_in_one_process():
    """The all-reduce helpers on a world of one: gradients and stats come back unchanged."""
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        group = distributed.Group(0, 1)
        p = torch.nn.Parameter(torch.ones(3))
        p.grad = torch.tensor([1.0, 2.0, 3.0])
        q = torch.nn.Parameter(torch.ones(2))  # no gradient: zeros
        group.sum_gradients([p, q])
        assert p.grad.tolist() == [1.0, 2.0, 3.0] and q.grad.tolist() == [0.0, 0.0]
        assert group.all_reduce([1.5, 2.0]) == [1.5, 2.0]
    finally:
        dist.destroy_process_group()


SFT_OPTIONS = {"num_train_epochs": 2, "micro_batch_size": 4, "learning_rate": 1e-3, "save_steps": 6}
SFT_KILL_AT = 20  # the log of step 20 comes before that step's save: the newest complete checkpoint is 18


def sft_on_ranks(root: str, out: str, work: str, kill_at: int | None = None, on_metrics=None, group=None) -> dict:
    """stages.training.sft.run on 60 rows (15 steps an epoch); rank 0 SIGKILLs itself at the log of step kill_at."""
    from stages.training import sft

    def report(metrics, step):
        if on_metrics:
            on_metrics(metrics, step)
        if kill_at is not None and step >= kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    return sft.run(sft.SFTConfig(**SFT_OPTIONS), Path(root) / "model", Path(root) / "sft.parquet", Path(out),
                   on_metrics=report, work_dir=Path(work), group=group)


PREFERENCE_OPTIONS = {"num_train_epochs": 1, "micro_batch_size": 4, "logging_steps": 4, "save_steps": None,
                      "max_length": 64, "eval_steps": 10}


def preference_stage(module: str, root: str, out: str, rl: str = "dpo", on_metrics=None, group=None) -> dict:
    """stages.training.<module>.run (dpo with loss `rl`, or reward_model) on 96 demo pairs: 24 steps of 4 pairs,
    held-out accuracy every 10 steps."""
    import importlib

    stage = importlib.import_module(f"stages.training.{module}")
    if module == "dpo":
        config = stage.PreferenceOptimizationConfig(**PREFERENCE_OPTIONS, rl=rl)
    else:
        config = stage.RewardModelConfig(**PREFERENCE_OPTIONS)
    return stage.run(config, Path(root) / "model", Path(root) / "prefs", Path(out), on_metrics=on_metrics, group=group)


@pytest.fixture(scope="class")
def warm():
    """One warm_ranks() scope for a class's tests, as a pipeline run has: their launches share torchrun ranks."""
    with distributed.warm_ranks():
        yield


@pytest.mark.usefixtures("warm")
class TestOnWarmRanks:
    """2 processes equal 1 for every training stage, on the ranks a pipeline run reuses: each launch runs on the
    last one's processes (GRPO cases, SFT, the DPO family, the reward model, in turn), and a killed rank's
    launch is followed by fresh ones."""

    @pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
    def test_grpo_two_processes_equal_one(self, tiny, one_process, tmp_path, strategy):
        """ddp: replicas, gradients summed. fsdp: weights, gradients and optimizer state sharded (FSDP2), with
        filler passes for a rank short of micro-batches (grpo_odd's step 1, the pre-pass of round 0 whose pi_old
        comes from the rollouts) and a plain forward per micro-batch instead of the shared prompt pass."""
        root, scored = tiny
        first, one = one_process
        events = []
        progress = []
        two = distributed.launch("test_distributed:run_grpo_cases",
                                 dict(root=str(root), scored=str(scored), out=str(tmp_path / "two")),
                                 distributed.TrainConfig(num_processes=2, strategy=strategy), "optimize (test)",
                                 on_metrics=lambda m, step: events.append((step, m)),
                                 on_step=lambda done, total: progress.append((done, total)))
        assert_equal_runs(first, one, tmp_path / "two", two, strategy)
        assert one["dapo_skip"][0]["trained_rows"] < 32 and one["dapo_kl_skip"][0]["skipped_batches"] > 0
        assert one["grpo_odd"][0]["optimizer_steps"] == 2  # steps of 3 and 1 micro-batches
        # the parent received rank 0's step metrics and progress as they happened
        assert len(events) == sum(len(r["steps"]) for runs in one.values() for r in runs)
        assert progress and progress[-1][0] == progress[-1][1]

    def test_sft_two_processes_equal_one_and_resume(self, tmp_path):
        from test_checkpoints import sft_inputs, weights

        sft_inputs(tmp_path)
        for name in ("one", "two", "resumed"):
            (tmp_path / name).mkdir()
        one = sft_on_ranks(str(tmp_path), str(tmp_path / "one"), str(tmp_path / "work-one"))
        train = distributed.TrainConfig(num_processes=2)
        kwargs = {"root": str(tmp_path), "out": str(tmp_path / "two"), "work": str(tmp_path / "work-two")}
        logged = []
        two = distributed.launch("test_distributed:sft_on_ranks", kwargs, train, "sft",
                                 on_metrics=lambda m, step: logged.append(step))
        assert two["steps"] == one["steps"] == 30 and two["train_loss"] == pytest.approx(one["train_loss"], rel=1e-5)
        assert logged and max(logged) == 30
        w1, w2 = weights(tmp_path / "one"), weights(tmp_path / "two")
        assert max(float((w1[k] - w2[k]).abs().max()) for k in w1) < 1e-5

        # killed on 2 processes, rerun on 2 processes: continues from the complete checkpoint of step 18
        resumed = {**kwargs, "out": str(tmp_path / "resumed"), "work": str(tmp_path / "work-resumed")}
        with pytest.raises(distributed.DistributedError, match="sft: training on 2 processes failed"):
            distributed.launch("test_distributed:sft_on_ranks", {**resumed, "kill_at": SFT_KILL_AT}, train, "sft")
        assert (tmp_path / "work-resumed" / "checkpoint-18" / "_complete").is_file()
        again = distributed.launch("test_distributed:sft_on_ranks", resumed, train, "sft")
        assert again["resumed_from_step"] == 18 and again["reused_tokenized_dataset"]
        w3 = weights(tmp_path / "resumed")
        assert max(float((w2[k] - w3[k]).abs().max()) for k in w2) < 1e-5

    @pytest.mark.parametrize("module,rl", [("dpo", "dpo"), ("dpo", "kto"), ("dpo", "orpo"), ("dpo", "simpo"),
                                           ("reward_model", None)])
    def test_preference_stages_two_processes_equal_one(self, tmp_path, module, rl):
        from conftest import tiny_preference_model
        from test_checkpoints import weights

        tiny_preference_model(tmp_path, num_train=96, num_eval=4)
        for name in ("one", "two"):
            (tmp_path / name).mkdir()
        one = preference_stage(module, str(tmp_path), str(tmp_path / "one"), rl or "dpo")
        two = distributed.launch("test_distributed:preference_stage",
                                 {"module": module, "root": str(tmp_path), "out": str(tmp_path / "two"), "rl": rl or "dpo"},
                                 distributed.TrainConfig(num_processes=2), module)
        assert two["steps"] == one["steps"] == (48 if rl == "kto" else 24)  # kto: each pair is two rows
        assert two["train_loss"] == pytest.approx(one["train_loss"], rel=1e-5)
        assert [step for step, _ in two["eval_history"]] == [step for step, _ in one["eval_history"]] == \
            ([10, 20, 30, 40] if rl == "kto" else [10, 20])  # eval_steps on two ranks: at the same steps
        assert [value for _, value in two["eval_history"]] == pytest.approx([value for _, value in one["eval_history"]])
        w1, w2 = weights(tmp_path / "one"), weights(tmp_path / "two")
        assert w1.keys() == w2.keys()
        assert max(float((w1[k] - w2[k]).abs().max()) for k in w1) < 1e-5


TORCHRUN_SUMMARY = """\
E1128 16:23:16 torch/distributed/elastic/multiprocessing/api.py:882] failed (exitcode: {first}) local_rank: 1 (pid: 11) of binary: python
Failures:
[1]:
  time      : 2026-11-28_16:23:16
  rank      : 0 (local_rank: 0)
  exitcode  : {zero} (pid: 10)
------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-28_16:23:16
  rank      : 1 (local_rank: 1)
  exitcode  : {one} (pid: 11)
"""


def test_the_first_error_is_quoted_whichever_rank_torchrun_saw_first(tmp_path):
    """Both ranks exit within one of torchrun's polls: its "Root Cause" may name rank 1, whose error is only about
    losing rank 0 (seen under load). The message quotes the error written first; a rank killed by a signal (not
    torchrun's own SIGTERM of the others) comes before any error about losing it."""
    import time

    (tmp_path / "rank0.error").write_text("ValueError: grpo.loss_type: a bad value")
    time.sleep(0.05)
    (tmp_path / "rank1.error").write_text("RuntimeError: Connection closed by peer")
    log = tmp_path / "workers.log"
    log.write_text(TORCHRUN_SUMMARY.format(first=1, zero=1, one=1))
    assert distributed._root_cause(tmp_path, log).startswith("rank 0 raised:\nValueError: grpo.loss_type")
    log.write_text(TORCHRUN_SUMMARY.format(first=-9, zero=-15, one=-9))
    assert distributed._root_cause(tmp_path, log).startswith("rank 1 ended with exit code -9, without a Python error")
