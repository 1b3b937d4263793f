"""`mappa train --ray`: the same run on a local Ray cluster (2 rollout workers, 3 trainer actors, a tiny random
model), its run directory against a local run's, and a real `mappa train --ray local` killed and resumed.

One Ray cluster (2 CPUs) serves the in-process tests of this module: starting one costs seconds on 2 cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import ray
import torch
from helpers import TINY as RESUME_TINY
from helpers import kill_at_checkpoint

from mappa.config import Config, load_config
from mappa.distributed import placement
from mappa.distributed.cluster import merge_counts, split
from mappa.errors import MappaError
from mappa.training.checkpoint import latest_checkpoint
from mappa.training.tracking import read_metrics

ROOT = Path(__file__).resolve().parents[1]
TINY = [  # the resume tests' tiny run (several optimizer steps per agent and step) on 2 workers and 3 trainers
    *RESUME_TINY,
    "train.steps=2",
    "ray.rollout_workers=2",
    "ray.worker_cpus=0.25",  # 5 actors on the 2-CPU test cluster
    "ray.trainer_cpus=0.25",
]

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("one_torch_thread")]


@pytest.fixture(scope="module")
def ray_cluster() -> str:
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="module")
def ray_run(ray_cluster: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 steps of the tiny config on the module's cluster: 2 rollout workers, one trainer actor per agent."""
    from mappa.training.trainer import train

    run_dir = tmp_path_factory.mktemp("ray") / "run"
    events = []
    result = train(tiny(run_dir), run_dir, emit=events.append, place=placement("local"))
    assert result.step == 2 and [e.kind for e in events].count("step") == 2
    assert any("self-test ok" in e.text for e in events)
    assert any("on their trainer actors" in e.text for e in events if e.kind == "status")
    return run_dir


def tiny(run_dir: Path, *overrides: str) -> Config:
    return load_config(None, [*TINY, f"run_dir={run_dir}", *overrides])


def files(run_dir: Path) -> set[str]:
    return {str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if p.is_file()}


def names(run_dir: Path) -> list[set[str]]:
    """The metric names of each metrics.jsonl row, less the drop reasons (which actions drop depends on the
    sampled text), the update's own figures (an agent updates only when its actions' scores differ, which depends
    on the sampled text too) and the wall clock."""
    from dataclasses import fields

    from mappa.training.update import UpdateStats

    update = {f"/{f.name}" for f in fields(UpdateStats)} - {"/optimizer_steps"}
    return [
        {k for k in row if "/dropped_" not in k and k != "time" and not any(k.endswith(u) for u in update)}
        for row in read_metrics(run_dir)
    ]


def test_split_keeps_order_and_balances() -> None:
    assert split(list(range(7)), 2) == [[0, 1, 2], [3, 4, 5, 6]]
    assert split([1], 3) == [[], [], [1]]
    assert [x for share in split(list("abcdefgh"), 3) for x in share] == list("abcdefgh")


def test_merge_counts_sums_and_recomputes_rates() -> None:
    a = {"judgments": 4.0, "unscored": 1.0, "unscored_rate": 0.25, "latency_p95_s": 2.0, "calls": 4.0}
    b = {"judgments": 6.0, "unscored": 0.0, "unscored_rate": 0.0, "latency_p95_s": 3.0, "calls": 7.0}
    merged = merge_counts([a, b])
    assert merged == {"judgments": 10.0, "unscored": 1.0, "unscored_rate": 0.1, "latency_p95_s": 3.0, "calls": 11.0}
    cut = merge_counts([{"replies": 4.0, "cut_replies": 1.0, "cut_rate": 0.25}, {"replies": 4.0, "cut_replies": 3.0}])
    assert cut["cut_rate"] == 0.5  # the share of all replies, not a sum of shares
    versions = merge_counts([{"generation/adapter_version": 3.0}, {"generation/adapter_version": 3.0}])
    assert versions == {"generation/adapter_version": 3.0}


def test_local_mode_does_not_import_ray() -> None:
    code = "import sys, mappa.training.trainer, mappa.cli.train; sys.exit('ray' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=120).returncode == 0


def test_ray_run_has_the_local_runs_files_and_metric_names(ray_run: Path, tmp_path: Path) -> None:
    from mappa.policy.policy import Policy
    from mappa.training.trainer import train

    local = tmp_path / "local"
    train(tiny(local), local)
    assert files(ray_run) == files(local)
    assert names(ray_run) == names(local)
    rows = [r for r in read_metrics(ray_run) if "time/rollout_s" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["coach/judgments"] > 0 for r in rows)  # the workers' coach accounting reached the log
    episodes = (ray_run / "episodes.jsonl").read_text().splitlines()
    assert len(episodes) == 2 * 2  # both workers' shares of every step, none lost or doubled
    assert len({json.loads(e)["id"] for e in episodes}) == len(episodes)
    # The trainers' checkpoint is an ordinary one, and every agent that had a signal moved away from the start.
    trained = Policy.from_checkpoint(latest_checkpoint(ray_run) / "policy", device="cpu")
    fresh = Policy.from_config(tiny(ray_run).model, trained.agents, seed=42)
    moved = {
        a
        for a in trained.agents
        if any(
            not torch.equal(p, q)
            for p, q in zip(trained.trainable_parameters(a), fresh.trainable_parameters(a), strict=True)
        )
    }
    signal_agents = {k.split("/")[1] for r in rows for k, v in r.items() if k.endswith("/advantage_abs") and v > 0}
    assert moved == signal_agents and moved


def test_placement_errors_are_one_line(ray_cluster: str, tmp_path: Path) -> None:
    place = placement("local")
    agents, groups = ("a", "b"), {"a": ["a"], "b": ["b"]}
    with pytest.raises(
        MappaError, match=r"^ray: no room within 1s for 2 trainer ranks .* the cluster has \{'CPU': 2.0"
    ):
        place(tiny(tmp_path, "ray.worker_cpus=64", "ray.placement_timeout_s=1"), tmp_path, agents, groups)
    with pytest.raises(MappaError, match=r"^ray: no room within 1s for 8 trainer ranks x \{'CPU': 0.25, 'GPU': 0.0"):
        place(tiny(tmp_path, "train.fsdp_ranks=4", "ray.placement_timeout_s=1"), tmp_path, agents, groups)
    with pytest.raises(MappaError, match=r"gpus_per_agent: 1.5 GPUs cannot be split over whole ranks"):
        tiny(tmp_path, "train.gpus_per_agent=1.5")
    with pytest.raises(MappaError, match=r"fsdp_ranks: 2 ranks need a GPU each .* not 0.5"):
        tiny(tmp_path, "train.gpus_per_agent=0.5", "train.fsdp_ranks=2")
    assert tiny(tmp_path, "train.gpus_per_agent=4").train.ranks == 4  # an agent over 4 GPUs: 4 ranks, 1 GPU each
    assert ray.is_initialized()  # a failed placement leaves the shared cluster up


@pytest.mark.slow  # ~3 min on 2 cores: 8 actors; tests/test_sharding.py checks the same arithmetic in the default run
def test_sharded_trainers_take_the_unsharded_steps_and_resume(ray_cluster: str, ray_run: Path, tmp_path: Path) -> None:
    """`train.fsdp_ranks=2`: each agent's trainer is 2 actors that shard its weights (FSDP2 over gloo), 6 in all.
    The run has the unsharded Ray run's files and metric names and ends with its weights; resumed from its own
    checkpoint (the ranks reload weights and AdamW state into their shards), it trains on."""
    from mappa.policy.policy import Policy
    from mappa.training.trainer import train

    run_dir, sharded = tmp_path / "sharded", ["train.fsdp_ranks=2", "ray.trainer_cpus=0.125"]
    train(tiny(run_dir, *sharded), run_dir, place=placement("local"))
    assert files(run_dir) == files(ray_run)
    assert names(run_dir) == names(ray_run)
    a = Policy.from_checkpoint(latest_checkpoint(run_dir) / "policy", device="cpu")
    b = Policy.from_checkpoint(latest_checkpoint(ray_run) / "policy", device="cpu")
    # Sharded gradients are summed in another order; where a gradient is near 0, AdamW's g / sqrt(v) turns that
    # last-bit difference into up to a fraction of lr (1e-2 here): measured once 2.2e-5 on 1 element of 512. So
    # nearly every element agrees to float32 rounding and none is off by more than 1% of lr; a wrong shard or a
    # lost gradient moves whole tensors by about lr.
    for agent in a.agents:
        for p, q in zip(a.trainable_parameters(agent), b.trainable_parameters(agent), strict=True):
            off = ~torch.isclose(p, q, rtol=1e-4, atol=1e-6)
            assert off.float().mean() <= 0.01 and (p - q).abs().max() <= 1e-4, (agent, int(off.sum()), p.numel())

    train(tiny(run_dir, *sharded, "train.steps=3"), run_dir, resume=True, place=placement("local"))
    assert [r["step"] for r in read_metrics(run_dir) if "time/rollout_s" in r] == [1, 2, 3]
    c = Policy.from_checkpoint(latest_checkpoint(run_dir) / "policy", device="cpu")
    assert latest_checkpoint(run_dir).name == "step-000003"
    assert any(
        not torch.equal(p, q)
        for p, q in zip(
            a.trainable_parameters("problem_solver"), c.trainable_parameters("problem_solver"), strict=True
        )
    )


def _mappa(args: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "120", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "mappa.cli", *args], stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=ROOT, env=env,
        start_new_session=True,  # its own session: the Ray processes it starts can be told apart and ended
    )  # fmt: skip


def _end_session(proc: subprocess.Popen) -> None:
    """SIGKILL the command and whatever it left in its session (Ray puts each actor in a process group of its own;
    they die with the driver, some helpers only seconds later)."""
    import psutil

    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == proc.pid:
                p.kill()
        except (ProcessLookupError, psutil.Error):
            pass
    proc.wait()


def test_sigkill_mid_run_then_resume_on_ray(ray_cluster: str, ray_run: Path, tmp_path: Path) -> None:
    """`mappa train --ray local` killed during step 2 (its Ray processes go with it), resumed on a running cluster
    (`--ray ADDRESS`): each step logged once, and the weights end equal to the uninterrupted Ray run's."""
    from mappa.policy.policy import Policy

    run_dir = tmp_path / "killed"
    sets = [a for o in [*TINY, f"run_dir={run_dir}"] for a in ("--set", o)]
    proc = _mappa(["train", *sets, "--ray", "local"], tmp_path / "first.log")
    try:
        kill_at_checkpoint(proc, run_dir, 1, tmp_path / "first.log", timeout=300)  # step 2 is then under way
    finally:
        _end_session(proc)
    assert {r["step"] for r in read_metrics(run_dir) if "time/rollout_s" in r} == {1}

    resumed = _mappa(["train", "--resume", str(run_dir), "--ray", ray_cluster], tmp_path / "resume.log")
    try:
        assert resumed.wait(timeout=300) == 0, (tmp_path / "resume.log").read_text()[-3000:]
    finally:
        _end_session(resumed)
    assert "resumed from" in (tmp_path / "resume.log").read_text()
    assert [r["step"] for r in read_metrics(run_dir) if "time/rollout_s" in r] == [1, 2]
    steps = [json.loads(x)["meta"]["step"] for x in (run_dir / "episodes.jsonl").read_text().splitlines()]
    assert steps == [1] * 2 + [2] * 2
    a = Policy.from_checkpoint(latest_checkpoint(run_dir) / "policy", device="cpu")
    b = Policy.from_checkpoint(latest_checkpoint(ray_run) / "policy", device="cpu")
    # Sharded gradients are summed in another order; where a gradient is near 0, AdamW's g / sqrt(v) turns that
    # last-bit difference into up to a fraction of lr (1e-2 here): measured once 2.2e-5 on 1 element of 512. So
    # nearly every element agrees to float32 rounding and none is off by more than 1% of lr; a wrong shard or a
    # lost gradient moves whole tensors by about lr.
    for agent in a.agents:
        for p, q in zip(a.trainable_parameters(agent), b.trainable_parameters(agent), strict=True):
            off = ~torch.isclose(p, q, rtol=1e-4, atol=1e-6)
            assert off.float().mean() <= 0.01 and (p - q).abs().max() <= 1e-4, (agent, int(off.sum()), p.numel())


def _gpu_check():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_train_check", ROOT / "bench" / "gpu_train_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_train_check_counts_update_flops_and_reports_mfu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mappa.types import Action

    check = _gpu_check()
    model, tok = check.build(True, torch.device("cpu"), torch.float32)
    action = Action(agent="a", turn=0, messages=(), text="", prompt_ids=(1, 2, 3), response_ids=(4, 5))
    # 2 layers x (q 64x64 + k 64x32 + v 64x32 + o 64x64 + MLP 3 x 64x128) = 73,728 matmul parameters;
    # attention 2 x 2 layers x 4 heads x 16 = 256 per S^2; LM head 64 x vocabulary on the 2 response tokens.
    per_pass = 2 * 73_728 * 5 + 256 * 5**2 + 2 * 64 * len(tok) * 2
    assert check.update_flops(model, [action]) == 4 * per_pass
    monkeypatch.setenv("OUT", str(tmp_path))
    summary = check.main(["--tiny", "--steps", "2", "--batch", "2", "--tokens", "6", "--micro-batch", "2",
                          "--peak-tflops", "0.5"])  # fmt: skip
    assert summary["gradient_checkpointing"] and summary["update_tflops_per_s"] > 0
    assert summary["update_mfu"] == pytest.approx(summary["update_tflops_per_s"] / 0.5)
    assert json.loads((tmp_path / "gpu_train_check.json").read_text())["update_mfu"] == summary["update_mfu"]
