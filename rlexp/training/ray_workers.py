"""The ranks of a run inside a Ray cluster: one Ray actor per rank, placed with a placement group.

This is what ``cluster.launcher=ray`` runs on the cluster (the Ray job's driver calls ``launch`` through
``run_training``); the per-rank code is the same as under torchrun (``loop._rank_main``):

* one bundle per GPU (``{"GPU": 1, "CPU": cpus_per_worker}``; CPU only on a CPU cluster), strategy PACK:
  as few nodes as the bundles fit on, the trainer and its colocated engine in the same bundle;
* rank 0's node and a free port there are the rendezvous (``MASTER_ADDR``/``MASTER_PORT``); each actor
  gets ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` as torchrun would set them, except that Ray shows each
  actor only its own GPU, so ``LOCAL_RANK`` is 0 (the index among the GPUs the process sees);
* the first rank to fail (an exception, or its actor dying with its node) stops the others, and
  ``RankFailedError`` names it, as ``distributed.launch`` does;
* SIGTERM/SIGINT to the driver (``ray job stop`` sends SIGTERM) are passed on to every rank's process,
  which checkpoints within ``preempt_grace_s`` and exits as a preempted run does (``Preemption``).

Ray is imported only here, and only when a run is on Ray.
"""

import logging
import signal
import socket
from collections.abc import Callable
from typing import Any

from rlexp.training.distributed import RankFailedError

log = logging.getLogger(__name__)

#: how long the placement group may wait for its bundles before the run gives up, naming them.
PLACEMENT_TIMEOUT_S = 600


def launch(entrypoint: Callable[..., Any], workers: int, gpus_per_worker: int, cpus_per_worker: int, *args: Any) -> Any:
    """Run ``entrypoint(*args)`` in ``workers`` Ray actors, one per rank; rank 0's return value."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if not ray.is_initialized():
        ray.init()  # inside a Ray job: joins the cluster the job runs on
    bundle = {"CPU": cpus_per_worker, **({"GPU": gpus_per_worker} if gpus_per_worker else {})}
    group = placement_group([dict(bundle) for _ in range(workers)], strategy="PACK")
    try:
        ready, _ = ray.wait([group.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            raise RuntimeError(
                f"the Ray cluster did not offer {workers} bundles of {bundle} within {PLACEMENT_TIMEOUT_S} s; "
                f"it has {ray.cluster_resources()}"
            )
        actor = ray.remote(RankWorker)
        ranks = [
            actor.options(
                num_cpus=cpus_per_worker, num_gpus=gpus_per_worker,
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank),
            ).remote()
            for rank in range(workers)
        ]
        places = ray.get([r.place.remote() for r in ranks])
        master_addr, master_port = places[0][1], ray.get(ranks[0].free_port.remote())
        envs = [
            {
                "RANK": str(rank), "WORLD_SIZE": str(workers), "LOCAL_RANK": "0",
                "LOCAL_WORLD_SIZE": str(sum(p[0] == node for p in places)), "MASTER_ADDR": master_addr,
                "MASTER_PORT": str(master_port),
                # a job's log is streamed line by line: progress bars would print a line per update there;
                # the step lines (``step k/N | reward …``) say how it goes
                "TQDM_DISABLE": "1",
            }
            for rank, (node, _, _) in enumerate(places)
        ]
        log.info("ranks on Ray: %s", ", ".join(f"rank {i} on {ip} (pid {pid})" for i, (_, ip, pid) in enumerate(places)))
        runs = [r.run.remote(entrypoint, env, *args) for r, env in zip(ranks, envs)]
        with _forwarding_signals(places):
            outcome, value = _first_failure_stops_all(runs, ranks)
        if outcome == "exit":  # a preempted run exits 128 + signal on every rank, after its checkpoint
            raise SystemExit(value)
        return value
    finally:
        remove_placement_group(group)


class RankWorker:
    """One rank's process. A plain (not threaded) actor: its methods run on the process's main thread,
    where the run's signal handlers must be installed."""

    def place(self) -> tuple[str, str, int]:
        import os

        import ray

        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), os.getpid()

    def free_port(self) -> int:
        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def run(self, entrypoint: Callable[..., Any], env: dict[str, str], *args: Any) -> tuple[str, Any]:
        """("return", value), or ("exit", code) where the rank exits (a preempted run exits 143 or 130):
        an actor that raised SystemExit would be reported dead, not preempted."""
        import os

        from rlexp.runtime import log_like_hydra

        os.environ.update(env)
        log_like_hydra()  # Ray's worker process logs nothing below WARNING of ours otherwise
        try:
            return "return", entrypoint(*args)
        except SystemExit as exit:
            return "exit", exit.code


def _first_failure_stops_all(runs: list, ranks: list) -> tuple[str, Any]:
    """Rank 0's outcome once every rank has ended; the first rank to fail kills the rest."""
    import ray
    from ray.exceptions import RayActorError, RayTaskError

    pending = list(runs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        try:
            ray.get(done[0])
        except (RayTaskError, RayActorError) as error:
            rank = runs.index(done[0])
            for actor in ranks:
                ray.kill(actor)
            cause = error.cause if isinstance(error, RayTaskError) and error.cause is not None else error
            lines = [line for line in str(cause).splitlines() if line.strip()]
            reason = lines[-1] if lines else type(cause).__name__
            if isinstance(cause, SystemExit):
                reason = f"exit code {cause.code}"
            raise RankFailedError(f"rank {rank} of {len(runs)} failed on Ray: {reason}") from None
    return ray.get(runs[0])


class _forwarding_signals:
    """While the ranks run, SIGTERM and SIGINT to this (driver) process go to every rank's process too,
    through a small task pinned to that rank's node."""

    def __init__(self, places: list[tuple[str, str, int]]):
        self.places = places
        self.previous: dict[int, Any] = {}

    def __enter__(self):
        for signum in (signal.SIGTERM, signal.SIGINT):
            self.previous[signum] = signal.signal(signum, self._forward)
        return self

    def __exit__(self, *exc):
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)

    def _forward(self, signum: int, frame) -> None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        log.warning("%s: passing it on to the %d ranks", signal.Signals(signum).name, len(self.places))
        signal_task = ray.remote(num_cpus=0)(_send_signal)
        for node, _, pid in self.places:
            signal_task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(pid, signum)


def _send_signal(pid: int, signum: int) -> None:
    import os

    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass
