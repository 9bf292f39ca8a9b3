"""What every training recipe shares: the policy and its optimizer, the maze stream, resume, and the
step loop with eval and checkpoint scheduling. A recipe (``rlexp/tasks/train_*.py``) supplies the
step; components (engine, optimizer, lr schedule) come from config through ``_target_``.

One process holds a run dir at a time (``run_dir_lock``). On SIGTERM/SIGINT the loop checkpoints the
last whole state and exits 143/130 with the tracked run marked KILLED (see ``rlexp.training.preemption``).

With ``cluster.launcher=torchrun`` and more than one GPU, ``run_training`` starts one process per GPU
(``rlexp.training.distributed``); each shards the policy with FSDP2 and plays its share of the mazes;
rank 0 alone evaluates, tracks and writes the checkpoint's consolidated files. With
``cluster.launcher=ray`` (inside the Ray job that ``rlexp.cluster.ray_jobs`` submitted) the same ranks
run as Ray actors (``rlexp.training.ray_workers``).
"""

import json
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch.distributed.elastic.multiprocessing.errors import record

from rlexp.envs import TrainingMazeStream, load_pinned, min_expert_steps, pinned_layout_hashes
from rlexp.evaluation.evaluate import EvalResult, evaluate_model, record_eval
from rlexp.models import load_policy, never_generated_ids, resolve_model_path
from rlexp.rollout.conversation import TurnFormatter
from rlexp.rollout.driver import rollout_metrics
from rlexp.rollout.engine import build_engine
from rlexp.runtime import RunDirBusy, hydra_context, restore_hydra_context, run_dir_lock, run_dir_of, seed_everything
from rlexp.tracking import Trackers, build_trackers, discard_records
from rlexp.tracking.base import run_info
from rlexp.tracking.ray_metrics import RayMetricsTracker
from rlexp.training import distributed, ray_workers
from rlexp.training.checkpoint import (
    CheckpointSaveError,
    ResumeError,
    begin_checkpoint,
    finish_checkpoint,
    load_trainer_state,
    resolve_resume,
    restore_rng_states,
    rng_states,
    save_checkpoint,
)
from rlexp.training.preemption import Preempted, Preemption
from rlexp.training.update import PolicyUpdate

log = logging.getLogger(__name__)

#: ``rollout_metrics`` that are means over turns, not episodes.
PER_TURN = ("rollout/invalid_action_rate", "rollout/response_tokens_mean")
#: () -> one step's metrics; built by a recipe from the run.
TrainStep = Callable[[], dict[str, float]]


def turn_limit(cfg: DictConfig) -> int:
    """Turns an episode may take: the rollout's cap, never more than the env's step limit."""
    return min(cfg.env.max_steps, cfg.rollout.max_turns)


def stream_limit(cfg: DictConfig) -> int:
    """Training mazes are drawn solvable within the turn limit, since an unsolvable one only dilutes the
    loss; where no maze of this size is (a toy run of a few turns), within the env's step limit."""
    limit = turn_limit(cfg)
    if limit >= min_expert_steps(cfg.env.size):
        return limit
    log.warning(
        "rollout.max_turns=%d: no %dx%d maze is solvable in so few turns (the fewest need %d); success stays 0 "
        "and only a format reward can teach anything", cfg.rollout.max_turns, cfg.env.size, cfg.env.size,
        min_expert_steps(cfg.env.size),
    )
    return cfg.env.max_steps


class TrainingRun:
    def __init__(
        self, cfg: DictConfig, run_dir: Path, trackers: Trackers, checkpoint: Path | None = None,
        preemption: Preemption | None = None,
    ):
        """``checkpoint``: the one to continue from (``resolve_resume`` picks it), or None to start fresh.
        ``preemption``: the signal handling of this process (recipes mark their abandonable work with it)."""
        self.cfg, self.run_dir, self.trackers = cfg, run_dir, trackers
        self.preemption = preemption or Preemption(cfg.preempt_grace_s)
        self.ckpt_root = run_dir / "checkpoints"
        self.world = distributed.world()
        seed_everything(cfg.seed)
        on_gpu = str(cfg.cluster.device).startswith("cuda")
        self.device = device = f"cuda:{torch.cuda.current_device()}" if on_gpu and self.world.distributed else cfg.cluster.device
        self.model, self.processor = load_policy(cfg.model, device, adapter=checkpoint and checkpoint / "policy", trainable=True)
        if self.world.distributed:
            distributed.shard_policy(self.model, on_gpu)
        self.formatter = TurnFormatter(self.processor)
        self.engine = build_engine(cfg.rollout.engine, model=self.model, processor=self.processor)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = instantiate(cfg.algorithm.optimizer)(params, lr=cfg.algorithm.lr)
        self.scheduler = instantiate(cfg.algorithm.lr_scheduler)(self.optimizer, warmup_steps=cfg.algorithm.lr_warmup_steps)
        self.update = PolicyUpdate(
            self.model, self.optimizer, self.scheduler, cfg.algorithm, self.processor.tokenizer.pad_token_id,
            never_generated_ids(self.processor.tokenizer), step_label=lambda: self.step + 1,
            scorer=getattr(self.engine, "scorer", None),  # an engine that plays as tensors scores its turns too
        )
        self.pinned = load_pinned(cfg.env.pinned_set)[: cfg.eval.num_mazes]
        self.stream = TrainingMazeStream(
            cfg.env.size, stream_limit(cfg), cfg.seed, pinned_layout_hashes(cfg.env.pinned_set),
            min_expert_length=cfg.env.train_min_expert_length or 0,
        )
        self.step = 0
        #: the eval of ``step`` is still to run (at a fresh start; in a checkpoint written while it was due).
        self.eval_due = True
        #: (step, eval_due) of the newest checkpoint of this run, None before the first.
        self.saved: tuple[int, bool] | None = None
        self.last_eval: EvalResult | None = None
        if checkpoint is not None:
            state = load_trainer_state(checkpoint)
            if (checkpoint / distributed.OPTIMIZER_SHARDS).is_dir():
                distributed.load_optimizer_shards(self.model, self.optimizer, checkpoint / distributed.OPTIMIZER_SHARDS)
            elif self.world.distributed:
                distributed.load_full_optimizer(self.model, self.optimizer, state["optimizer"])
            else:
                self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            self.stream.load_state_dict(state["stream"])
            self.step = state["step"]
            self.eval_due = state.get("eval_due", False)
            self.saved = (self.step, self.eval_due)
            # each rank continues its own random streams where the world size is the same
            ranks = state.get("rank_rng", [])
            restore_rng_states(ranks[self.world.rank] if len(ranks) == self.world.size else state["rng"])
            log.info("resumed from %s at step %d", checkpoint, self.step)
        self.trackers.resume_from(self.step)

    def mazes(self) -> list:
        """This rank's share of the step's mazes (all of them in one process); every rank draws the same batch."""
        return self.world.shard(self.stream.next_batch(self.cfg.algorithm.train_batch_size))

    def rollout_metrics(self, trajectories: list, rewards: torch.Tensor) -> dict[str, float]:
        """``rollout/…`` over the step's episodes on every rank: each rank's means weighted by its episodes
        (or, for per-turn rates, its turns)."""
        metrics = rollout_metrics(trajectories, rewards)
        if not self.world.distributed:
            return metrics
        weights = [len(trajectories), sum(t.num_turns for t in trajectories)]
        weight_of = {key: weights[key in PER_TURN] for key in metrics}
        totals = self.world.sum([metrics[k] * weight_of[k] for k in metrics] + weights)
        episodes, turns = totals[-2:]
        return {k: total / max(turns if k in PER_TURN else episodes, 1) for k, total in zip(metrics, totals)}

    def fit(self, train_step: TrainStep) -> float:
        """Steps until ``total_steps``, evaluating and checkpointing on schedule; the final eval's success.
        Raises ``Preempted`` after checkpointing the last whole state when a signal came."""
        cfg = self.cfg
        log.info("run dir: %s", self.run_dir)
        finished = self._finished_eval()
        if finished is not None:
            log.info("run already finished at step %d: %s; nothing to do (a new run_name starts another)", self.step, finished.summary())
            return finished.success_rate
        try:
            while True:
                self._mark_whole()
                if self.eval_due:
                    self.evaluate()
                    self.eval_due = False
                    self._mark_whole()
                    if self.saved == (self.step, True):  # that checkpoint's eval is done now: say so in it
                        self.save()
                if self.step > 0 and (self.step % cfg.ckpt_interval == 0 or self.step == cfg.total_steps):
                    if self.saved is None or self.saved[0] != self.step:
                        self.save()
                if self.step >= cfg.total_steps:
                    break
                self.preemption.check()
                metrics = train_step()
                self.step += 1
                metrics.update(self.sync_engine())
                metrics.update(_gpu_memory_metrics(self.device))
                self.eval_due = self.step % cfg.eval_interval == 0 or self.step == cfg.total_steps
                self.trackers.log_metrics(metrics, self.step)
                log.info(_step_line(self.step, cfg.total_steps, metrics))
            self.preemption.check()  # a signal during the last save: its checkpoint is written, the exit says so
        except Preempted:
            self._checkpoint_preempted()
            raise
        if self.last_eval is None:
            self.evaluate()
        log.info("done: %s; run dir %s", self.last_eval.summary(), self.run_dir)
        return self.last_eval.success_rate

    def _mark_whole(self) -> None:
        """Remember the stream position and RNG states here, where model, optimizer, ``step`` and
        ``eval_due`` agree: a preemption in abandonable work after it checkpoints this point."""
        self._whole = (self.stream.state_dict(), rng_states())

    def _checkpoint_preempted(self) -> None:
        stream, rng = self._whole
        self.stream.load_state_dict(stream)
        restore_rng_states(rng)
        since = self.preemption.seconds_since_signal
        if self.step == 0:
            log.warning("preempted before the first step: nothing to checkpoint; the next start begins afresh")
        elif self.saved == (self.step, self.eval_due):
            log.warning("preempted at step %d, %.1f s after the signal: its checkpoint is already written", self.step, since())
        else:
            path = self.save()
            log.warning(
                "preempted at step %d: checkpoint %s written %.1f s after the signal (preempt_grace_s=%g)",
                self.step, path, since(), self.cfg.preempt_grace_s,
            )
        log.warning("the same command (same run_name) resumes this run")

    def sync_engine(self) -> dict[str, float]:
        """The one place where the updated policy reaches the engine, after every step: the ``hf`` engine
        shares the trainer's parameters; vLLM serves the LoRA adapter written to ``<run>/global_step_N/policy``
        (the original's layout on shared storage)."""
        _, seconds = timed(self.engine.load_weights, self.run_dir / f"global_step_{self.step}" / "policy")
        return {"timing/sync_s": seconds}

    def _finished_eval(self) -> EvalResult | None:
        """The final eval of a run resumed at its last step, read back instead of run and logged again."""
        if self.step < self.cfg.total_steps:
            return None
        summary = self.eval_path(self.step).with_suffix(".summary.json")
        if not summary.is_file():
            return None
        return EvalResult(**json.loads(summary.read_text()))

    def eval_path(self, step: int) -> Path:
        return self.run_dir / "eval" / f"step_{step:06d}.jsonl"

    def evaluate(self) -> EvalResult:
        """On rank 0, with the weights gathered; the other ranks wait and receive the result."""
        cfg = self.cfg
        result = None
        with distributed.gathered(self.model):
            if self.world.main:
                start = time.perf_counter()
                with self.preemption.abandonable():
                    result, trajectories = evaluate_model(self.engine, self.formatter, self.pinned, cfg.env, cfg.rollout, cfg.eval)
                self.trackers.log_metrics({"timing/eval_s": time.perf_counter() - start}, self.step)
                path = self.eval_path(self.step)
                record_eval(result, trajectories, self.pinned, path, self.trackers, self.step, cfg.env.cell_px)
                log.info("eval at step %d: %s (%s)", self.step, result.summary(), path)
            self.last_eval = result = self.world.broadcast(result)
        return result

    def save(self) -> Path:
        state = {"scheduler": self.scheduler.state_dict(), "stream": self.stream.state_dict(), "eval_due": self.eval_due}
        cfg = self.cfg
        if not self.world.distributed:
            state["optimizer"] = self.optimizer.state_dict()
            path = save_checkpoint(self.ckpt_root, self.step, self.model, state, cfg, cfg.keep_last_ckpts)
        else:
            # every rank: its optimizer shard into the temp dir rank 0 made, and its part of the adapter and RNG states
            adapter = distributed.adapter_state(self.model)
            state["rank_rng"] = self.world.gather(rng_states())
            tmp = self.world.broadcast(begin_checkpoint(self.ckpt_root, self.step) if self.world.main else None)
            distributed.save_optimizer_shards(self.model, self.optimizer, tmp / distributed.OPTIMIZER_SHARDS)
            self.world.barrier()
            path = None
            if self.world.main:
                path = finish_checkpoint(tmp, self.ckpt_root, self.step, self.model, state, cfg, cfg.keep_last_ckpts, adapter)
            path = self.world.broadcast(path)
        self.saved = (self.step, self.eval_due)
        self.trackers.set_tags({"checkpoint": str(path.resolve())})
        log.info("checkpoint: %s", path)
        return path


def run_training(cfg: DictConfig, make_step: Callable[[TrainingRun], TrainStep], processes: int | None = None) -> float:
    """Lock the run dir, pick the checkpoint to resume from, build the run and its trackers, fit with the
    recipe's step, and always close the trackers (FINISHED; KILLED after a preemption, then exit
    128 + signal; FAILED on an exception) so that one failed job does not kill a sweep. A run dir held by
    another process or a refused resume (see ``resolve_resume``) ends with one line before any tracker
    or file of the run dir is touched, and a checkpoint that cannot be written (a full disk) with one
    line naming it and the free space; in a multirun it fails that job only.

    ``processes`` (default: the cluster's GPUs under ``launcher=torchrun``, else 1) above 1 runs the same
    in that many local processes, one per rank (on CPU: gloo, as the tests do). Under ``launcher=ray``
    the ranks are Ray actors, one per GPU (``cluster.ray.workers`` on a CPU cluster)."""
    run_dir = run_dir_of(cfg)
    launcher = cfg.cluster.launcher.value
    try:
        with run_dir_lock(run_dir):
            checkpoint = resolve_resume(run_dir / "checkpoints", cfg.resume)
            if cfg.resume == "overwrite":
                discard_records(run_dir)
            if processes is None:
                processes = cfg.cluster.nodes * cfg.cluster.gpus_per_node if launcher == "torchrun" else 1
            if processes > 1 or launcher == "ray":
                resolve_model_path(cfg.model.path)  # built or found once, not by every rank at the same time
                resolved = cfg.copy()
                OmegaConf.resolve(resolved)  # the ranks have no Hydra to resolve ``${hydra:…}``
                # … but trackers name and tag runs from Hydra's choices and sweep: the ranks get them too
                rank_args = (resolved, run_dir, checkpoint, make_step, hydra_context())
                if launcher == "ray":
                    cluster = cfg.cluster
                    workers = cluster.nodes * cluster.gpus_per_node or cluster.ray.workers or 1
                    gpus = 1 if cluster.gpus_per_node else 0
                    return ray_workers.launch(_rank_main, workers, gpus, cluster.ray.cpus_per_worker, *rank_args)
                return distributed.launch(_rank_main, processes, *rank_args)
            return _fit(cfg, run_dir, checkpoint, make_step, build_trackers(cfg.logger, run_dir, cfg))
    except (ResumeError, RunDirBusy, CheckpointSaveError) as error:
        if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
            raise
        sys.exit(f"rlexp: {error}")


def _fit(cfg, run_dir: Path, checkpoint: Path | None, make_step, trackers: Trackers) -> float:
    """Train in this process with its own signal handling; a preemption closes the trackers as KILLED and
    exits 128 + signal."""
    status = "FAILED"
    with Preemption(cfg.preempt_grace_s) as preemption:
        try:
            run = TrainingRun(cfg, run_dir, trackers, checkpoint, preemption)
            result = run.fit(make_step(run))
            status = "FINISHED"
            return result
        except Preempted as preempted:
            status = "KILLED"
            exit_code = preempted.exit_code
        finally:
            trackers.finish(status)
    raise SystemExit(exit_code)


@record
def _rank_main(cfg: DictConfig, run_dir: Path, checkpoint: Path | None, make_step, hydra: dict | None = None) -> float:
    """One rank of a distributed run: join the group, train; only rank 0 tracks, logs and shows progress.
    ``hydra``: the launching process's Hydra config, so that its trackers name and tag the run alike."""
    if hydra is not None and not HydraConfig.initialized():
        restore_hydra_context(hydra)
    distributed.init_process_group(cfg.cluster.device)
    ranks = distributed.world()
    if ranks.main:
        trackers = build_trackers(cfg.logger, run_dir, cfg)
        if cfg.cluster.launcher.value == "ray":
            info = run_info(run_dir, cfg)
            trackers.add(RayMetricsTracker(info["run_name"], info["experiment"]))
    else:
        trackers = Trackers([])
        os.environ["TQDM_DISABLE"] = "1"
        logging.getLogger().setLevel(logging.WARNING)
    try:
        return _fit(cfg, run_dir, checkpoint, make_step, trackers)
    except BaseException:
        log.exception("rank %d of %d failed", ranks.rank, ranks.size)
        raise
    finally:
        distributed.destroy_process_group()


def _gpu_memory_metrics(device) -> dict[str, float]:
    """The step's peak GPU memory of this process (none on the CPU); the peak is reset for the next step."""
    if torch.device(device).type != "cuda":
        return {}
    peak = torch.cuda.max_memory_allocated(device) / 1e9
    torch.cuda.reset_peak_memory_stats(device)
    return {"system/gpu_peak_memory_gb": peak}


def timed(fn, *args, **kwargs):
    """(fn(*args, **kwargs), seconds it took)."""
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    return result, time.perf_counter() - start


def _step_line(step: int, total: int, m: dict[str, float]) -> str:
    def get(key: str, spec: str) -> str:
        return format(m[key], spec) if key in m else "n/a"

    return (
        f"step {step}/{total} | reward {get('rollout/reward_mean', '.3f')} success {get('rollout/success_rate', '.1%')} "
        f"| loss {get('train/loss', '.4f')} kl {get('train/kl', '.4f')} entropy {get('train/entropy', '.3f')} "
        f"grad_norm {get('train/grad_norm', '.3f')} | {get('timing/generate_tokens_per_s', '.0f')} tok/s "
        f"| generate {get('timing/generate_s', '.1f')}s train {get('timing/train_s', '.1f')}s sync {get('timing/sync_s', '.2f')}s"
    )

