"""A run placed on a Ray cluster: the `place` that `mappa.training.trainer.setup` calls with `mappa train --ray`.

`placement(address)` connects to Ray (`local`: a new one-machine cluster; `auto`: the running one; else
its address), and places, in one placement group, one trainer per update group (`train.gpus_per_agent`
GPUs and `ray.trainer_cpus` CPUs each; with `train.fsdp_ranks` above 1, that many actors that shard the group's
weights, `mappa.policy.sharding`) and `ray.rollout_workers` rollout workers (`ray.worker_cpus`,
`ray.worker_gpus`). The `Cluster` it returns is the run's `Engine` (`mappa.protocols`), as
`mappa.training.engine.LocalEngine` is in one process: `play`, `update`, `step_sync`, `evaluate`, `self_test`, `stats`,
`save_checkpoint`, `restore_checkpoint`. A checkpoint goes through `mappa.training.checkpoint` with stand-ins for the
policy and the optimizers (the trainer actors hold them), so it has the same files as a local run's. The training
loop itself stays in `mappa.training.trainer`.
"""

from __future__ import annotations

import logging
import math
import os
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from mappa.config import Config
from mappa.errors import MappaError
from mappa.protocols import ProgressFn, StatusFn
from mappa.training.evaluate import eval_metrics
from mappa.training.update import GroupResult, UpdateJob
from mappa.types import Episode, Task

Place = Callable[[Config, Path, Sequence[str], dict[str, list[str]]], "Cluster"]
RAY_MISSING = "--ray needs Ray: pip install 'mappa-rl[ray]'"


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise MappaError(RAY_MISSING) from None
    return ray


def get(refs: Any) -> Any:
    """`ray.get`, with a MappaError raised inside an actor given back as its one line."""
    ray = _ray()
    try:
        return ray.get(refs)
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, MappaError):
            raise MappaError(str(e.cause)) from None
        raise
    except ray.exceptions.RayActorError as e:  # an actor whose construction raised: the error is in the message
        if found := re.findall(r"MappaError: (.+)", str(e)):
            raise MappaError(found[-1]) from None
        raise


def split(items: Sequence[Any], parts: int) -> list[list[Any]]:
    """`items` in `parts` contiguous shares whose sizes differ by at most one (a task's samples stay together)."""
    n = len(items)
    return [list(items[i * n // parts : (i + 1) * n // parts]) for i in range(parts)]


def merge_counts(parts: Sequence[dict[str, float]]) -> dict[str, float]:
    """Per-worker counters as one: sums, except latencies and versions (the largest) and rates (recomputed)."""
    out: dict[str, float] = {}
    for part in parts:
        for k, v in part.items():
            largest = "latency" in k or k.endswith(("adapter_version", "mixed_versions"))
            out[k] = max(out.get(k, v), v) if largest else out.get(k, 0.0) + v
    if "judgments" in out:
        out["unscored_rate"] = out["unscored"] / out["judgments"] if out["judgments"] else 0.0
    if "replies" in out:
        out["cut_rate"] = out["cut_replies"] / out["replies"] if out["replies"] else 0.0
    return out


def _connect(address: str, cpus: float) -> bool:
    """Start or join Ray unless this process already has (tests share one cluster); True when this call did."""
    ray = _ray()
    if ray.is_initialized():
        return False
    quiet = {"log_to_driver": False, "logging_level": logging.WARNING}
    if address == "local":  # a new cluster on this machine, with room for every actor of the run
        ray.init(address="local", num_cpus=max(os.cpu_count() or 1, math.ceil(cpus)), include_dashboard=False, **quiet)
    else:
        ray.init(address=address, **quiet)
    return True


def placement(address: str) -> Place:
    """What `mappa.training.trainer.setup(place=...)` calls: `place(cfg, run_dir, agents, groups)` places the run on
    Ray."""
    _ray()  # a missing Ray is one line before anything loads

    def place(cfg: Config, run_dir: Path, agents: Sequence[str], groups: dict[str, list[str]]) -> Cluster:
        r = cfg.ray
        started = _connect(address, len(groups) * cfg.train.ranks * r.trainer_cpus + r.rollout_workers * r.worker_cpus)
        try:
            return Cluster(cfg, Path(run_dir).resolve(), agents, groups, started)  # actors may run elsewhere
        except BaseException:
            if started:
                _ray().shutdown()
            raise

    return place


class _Weights:
    """What checkpointing needs of a policy: the lead trainer (which holds every agent's current weights) saves,
    and every actor loads. A team on several base models (`mappa.policy.team`): each base's lead trainer (its first
    group's) saves that base's `Policies.save` subdirectory, and the team's manifest is written here."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster

    def save(self, directory: str | Path) -> None:
        from mappa.policy.storage import BaseEntry, base_dir, write_team_manifest

        directory, c = Path(directory).resolve(), self.cluster
        if len(c.bases) == 1:
            get([rank.save.remote(str(directory)) for rank in c.lead])
            return
        leads = [c.trainers[next(g for g, m in c.groups.items() if m[0] in agents)] for agents in c.bases.values()]
        get([rank.save.remote(str(base_dir(directory, i))) for i, ranks in enumerate(leads) for rank in ranks])
        write_team_manifest(directory, c.agents, [BaseEntry(model=n, agents=a) for n, a in c.bases.items()])

    def load_weights(self, directory: str | Path) -> None:
        get([a.load_weights.remote(str(Path(directory).resolve())) for a in self.cluster.actors])


class _Optimizer:
    """What checkpointing needs of an optimizer, kept by its trainer actor (or its ranks, which gather the
    sharded state together: the first one's is the whole)."""

    def __init__(self, ranks: list[Any]) -> None:
        self.ranks = ranks

    def state_dict(self) -> dict[str, Any]:
        return get([rank.optimizer_state.remote() for rank in self.ranks])[0]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        get([rank.load_optimizer_state.remote(state) for rank in self.ranks])


class Cluster:
    """The actors of one run, as its `Engine` (see the module docstring); `close()` ends them."""

    def __init__(self, cfg: Config, run_dir: Path, agents: Sequence[str], groups: dict[str, list[str]], started: bool):
        from mappa.distributed.actors import RolloutWorker
        from mappa.generation import adapter_root
        from mappa.policy.team import team_bases

        ray = _ray()
        self.cfg, self.agents, self.groups, self.started = cfg, tuple(agents), groups, started
        # base model -> its agents: a trainer holds its group's base, a worker every base (checked before placing)
        self.bases = team_bases(cfg.model, agents, server=cfg.generation.backend == "server")
        self.adapter_root = str(adapter_root(cfg, run_dir).resolve())
        self.group_pg = self._placement_group()
        self.trainers = {g: self._trainer(i, g, members[0]) for i, (g, members) in enumerate(groups.items())}
        r, worker = cfg.ray, ray.remote(RolloutWorker)
        device = "cpu" if r.worker_gpus == 0 else cfg.model.device
        urls = r.base_urls or [cfg.generation.base_url]
        self.urls = [urls[i % len(urls)] for i in range(r.rollout_workers)]  # rollout worker i's generation server
        self.workers = [
            worker.options(
                num_cpus=r.worker_cpus, num_gpus=r.worker_gpus, scheduling_strategy=self._bundle(self.n_ranks + i)
            ).remote(cfg, agents, str(run_dir), device, r.worker_cpus, url)
            for i, url in enumerate(self.urls)
        ]
        # its generator's answer: a server's or a bfloat16 sampling copy's log-probs are no trainer's forward pass
        self._exact = all(get([w.samples_exactly.remote() for w in self.workers]))
        self.lead = self.trainers[next(iter(groups))]  # its first rank writes checkpoints and publishes adapters
        self.actors = [*(rank for ranks in self.trainers.values() for rank in ranks), *self.workers]
        self._weights = _Weights(self)  # what `mappa.training.checkpoint` saves and restores, held by the actors
        self._optimizers = {g: _Optimizer(ranks) for g, ranks in self.trainers.items()}
        self._pending: dict[str, Any] = {}  # group's first agent -> its new weights (an object ref) to hand out
        self._generation: list[dict[str, float]] = []  # the workers' generation-server counters of the last play
        try:  # every actor built (model loaded, sandbox and coach up, ranks joined), or the first one's error now
            get([a.__ray_ready__.remote() for a in self.actors])
            sharded = {g: ranks for g, ranks in self.trainers.items() if len(ranks) > 1}
            addresses = {g: get(ranks[0].address.remote()) for g, ranks in sharded.items()}
            get([rank.setup.remote(addresses[g]) for g, ranks in sharded.items() for rank in ranks])
        except BaseException:
            self.close()
            raise

    @property
    def samples_exactly(self) -> bool:
        """Whether every rollout worker's episodes have the training forward pass's log-probs (its generator's
        `samples_exactly`, asked once): the trainers recompute them when not (`mappa.training.update`)."""
        return self._exact

    @property
    def n_ranks(self) -> int:
        return len(self.groups) * self.cfg.train.ranks

    def _trainer(self, index: int, group: str, agent: str) -> list[Any]:
        """The group's trainer: one actor, or `train.ranks` that shard its weights (`ShardedTrainer`), each in
        its own bundle of the placement group."""
        from mappa.distributed.actors import ShardedTrainer, Trainer

        ray, r, t = _ray(), self.cfg.ray, self.cfg.train
        device = "cpu" if t.gpus_per_rank == 0 else self.cfg.model.device
        args = (self.cfg, self.agents, group, agent, device, r.trainer_cpus)
        kind, world = (Trainer, []) if t.ranks == 1 else (ShardedTrainer, [t.ranks])
        return [
            ray.remote(kind)
            .options(
                num_cpus=r.trainer_cpus,
                num_gpus=t.gpus_per_rank,
                scheduling_strategy=self._bundle(index * t.ranks + rank),
            )
            .remote(*args, *([rank, *world] if world else []))
            for rank in range(t.ranks)
        ]

    def _placement_group(self) -> Any:
        """Room for every actor at once, or a one-line error after `ray.placement_timeout_s`."""
        from ray.util.placement_group import placement_group, remove_placement_group

        r, t = self.cfg.ray, self.cfg.train
        trainer, worker = (
            {"CPU": r.trainer_cpus, "GPU": t.gpus_per_rank},
            {"CPU": r.worker_cpus, "GPU": r.worker_gpus},
        )
        bundles = [trainer] * (len(self.groups) * t.ranks) + [worker] * r.rollout_workers
        pg = placement_group([{k: v for k, v in b.items() if v > 0} for b in bundles], strategy="PACK")
        try:
            _ray().get(pg.ready(), timeout=r.placement_timeout_s)
        except _ray().exceptions.GetTimeoutError:
            remove_placement_group(pg)
            need = f"{len(self.groups) * t.ranks} trainer ranks x {trainer} + {r.rollout_workers} workers x {worker}"
            have = {k: v for k, v in _ray().cluster_resources().items() if k in ("CPU", "GPU")}
            raise MappaError(
                f"ray: no room within {r.placement_timeout_s:g}s for {need}; the cluster has {have}"
            ) from None
        return pg

    def _bundle(self, index: int) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(placement_group=self.group_pg, placement_group_bundle_index=index)

    # ------------------------------------------------------------------------------------------------ the loop's
    def play(self, tasks: Sequence[Task], seed: int, progress: ProgressFn | None = None) -> list[Episode]:
        """The batch in one share per worker, played at once; episodes come back in task order. Share i samples
        from `seed + 1_000_003 * i`. (No progress from inside the workers.)"""
        shares = split(tasks, len(self.workers))
        pairs = enumerate(zip(self.workers, shares, strict=True))
        refs = [w.play.remote(s, seed + 1_000_003 * i) for i, (w, s) in pairs if s]
        results = get(refs)
        self._generation = [stats for _, stats in results]
        return [e for episodes, _ in results for e in episodes]

    def update(self, jobs: dict[str, UpdateJob], status: StatusFn | None = None) -> dict[str, GroupResult]:
        """Every group's update at once, each on its trainer actor; the new weights wait for `step_sync`."""
        if status is not None:
            status(f"updating {len(jobs)} groups on their trainer actors")
        refs = {
            g: [rank.update.options(num_returns=2).remote(job) for rank in self.trainers[g]] for g, job in jobs.items()
        }
        self._pending = {self.groups[g][0]: ranks[0][1] for g, ranks in refs.items()}  # the first rank's
        get([result for ranks in refs.values() for result, _ in ranks[1:]])  # every other rank finished too
        return dict(zip(refs, get([ranks[0][0] for ranks in refs.values()]), strict=True))

    def step_sync(self, version: int) -> dict[str, float]:
        """After the updates: every actor copies the groups' new weights; with a generation server, the lead
        trainer publishes the adapters as `version` and one worker has the server load them. Returns the
        `generation/...` metrics the local loop logs (none for the local backend)."""
        out = merge_counts(self._generation)  # the workers' counters of the last rollout, as one
        if self._pending:
            calls = []
            for actor in self.actors:
                own = next((members[0] for g, members in self.groups.items() if actor in self.trainers[g]), None)
                sent = {a: w for a, w in self._pending.items() if a != own}
                calls.append(actor.set_weights.remote(list(sent), *sent.values()))
            get(calls)
            self._pending = {}
        if self.cfg.generation.backend == "server":
            t0 = time.perf_counter()
            paths = get([rank.publish.remote(self.adapter_root, version) for rank in self.lead])[0]
            out["generation/publish_s"] = time.perf_counter() - t0
            loaders = {self.urls.index(url) for url in self.urls}  # one worker per server has it load them
            calls = [w.load_adapters.remote(paths, version) for i, w in enumerate(self.workers) if i in loaders]
            out["generation/reload_s"] = max(get(calls))
            get([w.use_version.remote(version) for i, w in enumerate(self.workers) if i not in loaders])
        return out

    def evaluate(
        self, tasks: Sequence[Task], progress: ProgressFn | None = None
    ) -> tuple[dict[str, float], list[Episode]]:
        """`mappa.training.evaluate.evaluate` with the tasks shared out among the workers; the same metrics, pooled."""
        start = time.perf_counter()
        shares = [s for s in split(tasks, len(self.workers)) if s]
        parts = get([w.evaluate.remote(s) for w, s in zip(self.workers, shares, strict=False)])  # fewer shares: fine
        episodes = [e for part in parts for e in part]
        return eval_metrics(episodes, self.agents, len(tasks), time.perf_counter() - start), episodes

    def self_test(self) -> list[str]:
        """The start-up self-test on the first worker: its policy copy, its sandbox and its coach."""
        return get(self.workers[0].self_test.remote())

    def stats(self) -> dict[str, float]:
        """The coaches' accounting over all workers, as `CoachRunner.stats` (latency percentiles: the worst)."""
        return merge_counts(get([w.coach_stats.remote() for w in self.workers]))

    def save_checkpoint(self, run_dir: Path, step: int, state: dict[str, Any], keep: int) -> Path:
        """A local run's checkpoint: the lead trainer writes the weights, the trainers their optimizer states."""
        from mappa.training.checkpoint import save_checkpoint

        return save_checkpoint(
            run_dir, step, policy=self._weights, optimizers=self._optimizers, state=state, keep=keep
        )

    def restore_checkpoint(self, run_dir: Path) -> tuple[Path, dict[str, Any]] | None:
        """Every actor loads the checkpoint's weights, every trainer its group's optimizer state."""
        from mappa.training.checkpoint import restore_run

        return restore_run(run_dir, policy=self._weights, optimizers=self._optimizers)

    def close(self) -> None:
        """End the actors (the workers close their sandboxes and coaches first) and free their room."""
        from ray.util.placement_group import remove_placement_group

        ray = _ray()
        try:
            ray.get([w.close.remote() for w in self.workers], timeout=60)
        except Exception:  # a worker that died or hangs: killing it below frees its sandbox processes too
            pass
        for actor in self.actors:
            ray.kill(actor)
        remove_placement_group(self.group_pg)
        if self.started:
            ray.shutdown()
