"""The fault campaign: what an ``rlexp`` training run survives, measured on a CPU with the tiny model.

    python bench/faults.py            # the full campaign (~30-40 min on a 2-core CPU)
    python bench/faults.py --quick    # fewer trials of each fault (the slow test suite runs this)

Every trial runs the real ``rlexp`` CLI as a subprocess (its own process group, as a pod) on the same
4-step GRPO run, logging to a real MLflow server on 127.0.0.1, and compares the outcome with one
uninterrupted run of that command:

* kill -9 at random points spread over rollout, update, checkpoint save, eval and tracker flush, then
  the same command again: it resumes; the final adapter equals the uninterrupted run's bit for bit;
  metrics.jsonl and the MLflow run hold each step once (one MLflow run, FINISHED);
* SIGTERM (and SIGINT) at random points: exit 143 (130), a checkpoint within ``preempt_grace_s``, the
  MLflow run KILLED; then resumed as above; a second SIGTERM during the first's checkpoint exits at
  once and the run still resumes;
* a second process on the same run dir: refused with one line naming the dir and the holder's pid;
  once the holder is killed -9, the next start is not blocked;
* the newest checkpoint corrupted (truncated safetensors, a flipped byte, manifest missing or garbled,
  optimizer state missing): the run falls back to the previous one with a warning naming what was
  wrong; every checkpoint corrupt: refused, naming the run dir, nothing changed;
* disk full during a checkpoint save (ENOSPC raised by the file layer after a random number of
  bytes): the run stops with an error naming the path and the free space, no partial folder is left,
  the previous checkpoint verifies and the next start resumes from it;
* the MLflow server killed -9 mid-run and restarted: 0 metrics lost (the journal replays); with W&B
  offline beside it, a kill -9 of the whole run loses no W&B row either (resumed rows are backfilled);
* random model outputs (bytes, unicode, huge strings, nested tags) through the action parser and the
  env: 0 exceptions.

Points are drawn with ``--seed``; a fault is injected by running the CLI under this file's ``child``
mode, which wraps the functions where each phase happens and fires at the chosen call.
"""

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]  # this checkout's rlexp, and the tests' support modules

#: the run every trial repeats: checkpoints at 2 and 4, evals at 0, 2 and 4.
RUN = [
    "total_steps=4", "ckpt_interval=2", "eval_interval=2", "keep_last_ckpts=4", "algorithm.lr=0.05",
    "algorithm.train_batch_size=2", "algorithm.policy_mini_batch_size=1", "logger.mlflow.retry_interval_s=1",
    "eval.num_mazes=2",
]
PHASES = ("rollout", "update", "checkpoint save", "eval", "tracker flush")
TRAIN_STEPS, EVAL_STEPS = [1, 2, 3, 4], [0, 2, 4]


# -- the child: rlexp with one fault injected ---------------------------------------------------------


class Injector:
    """Wraps the functions where each phase happens; each call is two events (before, after) of its phase,
    numbered per phase. ``census`` writes the counts at exit; ``at`` fires ``action`` at that event."""

    def __init__(self, spec: dict):
        self.spec, self.counts, self.in_eval, self.in_save = spec, Counter(), False, False
        self.at_done: dict[str, int] = {}
        self.armed_second_signal = False
        import atexit

        import rlexp.training.checkpoint as checkpoint
        import rlexp.training.loop as loop
        from rlexp.rollout.hf_engine import HFEngine
        from rlexp.tracking.base import JsonlTracker
        from rlexp.tracking.mlflow_tracker import MlflowTracker
        from rlexp.training.update import PolicyUpdate

        self.wrap(HFEngine, "generate", lambda: "eval" if self.in_eval else "rollout")
        self.wrap(PolicyUpdate, "score", "update")
        self.wrap(PolicyUpdate, "_optimizer_step", "update")
        self.wrap(loop, "record_eval", "eval")
        self.wrap(loop, "evaluate_model", "eval", flag="in_eval")
        self.wrap(loop, "save_checkpoint", "checkpoint save", flag="in_save")
        for name in ("_sha256", "_fsync_tree"):
            self.wrap(checkpoint, name, "checkpoint save")
        self.wrap(checkpoint.torch, "save", lambda: "checkpoint save" if self.in_save else None, owner_name="torch")
        self.wrap(checkpoint.os, "replace", lambda: "checkpoint save" if self.in_save else None, owner_name="os")
        self.wrap(MlflowTracker, "_send", "tracker flush")
        self.wrap(JsonlTracker, "log_metrics", "tracker flush")
        if spec.get("action") == "ENOSPC":
            self.full_disk()
        real_fit, injector = loop.TrainingRun.fit, self

        def fit(run, *args):
            result = real_fit(run, *args)
            injector.at_done = dict(injector.counts)
            return result

        loop.TrainingRun.fit = fit
        if "census" in spec:
            atexit.register(lambda: Path(spec["census"]).write_text(json.dumps({"all": self.counts, "at_done": self.at_done})))

    def wrap(self, owner, name: str, phase, flag: str | None = None, owner_name: str | None = None) -> None:
        original = getattr(owner, name)
        phase_of = phase if callable(phase) else (lambda: phase)

        def wrapper(*args, **kwargs):
            label = phase_of()
            if flag:
                setattr(self, flag, True)
            try:
                if label:
                    self.event(label)
                result = original(*args, **kwargs)
                if label:
                    self.event(label)
                return result
            finally:
                if flag:
                    setattr(self, flag, False)

        setattr(owner, name, wrapper)

    def event(self, phase: str) -> None:
        index = self.counts[phase]
        self.counts[phase] += 1
        if self.armed_second_signal and phase == "checkpoint save":
            os.kill(os.getpid(), signal.SIGTERM)
        elif self.spec.get("at") == [phase, index]:
            self.fire(self.spec["action"])

    def fire(self, action: str) -> None:
        if action == "KILL":
            os.killpg(os.getpgid(0), signal.SIGKILL)
        elif action in ("TERM", "INT"):
            os.kill(os.getpid(), getattr(signal, f"SIG{action}"))
        elif action == "TERM2":  # a second SIGTERM at the next event of a checkpoint save after the first one
            os.kill(os.getpid(), signal.SIGTERM)
            self.armed_second_signal = True

    def full_disk(self) -> None:
        """``open`` for writing fails with ENOSPC once ``budget`` bytes went to files during save number
        ``save`` (0-based): the file layer that torch.save and Path.write_text go through."""
        import builtins
        import errno
        import io

        real_open, spec, injector = builtins.open, self.spec, self
        state = {"saves": -1, "budget": spec["budget"]}
        import rlexp.training.loop as loop

        real_save = loop.save_checkpoint

        def counting_save(*args, **kwargs):
            state["saves"] += 1
            return real_save(*args, **kwargs)

        loop.save_checkpoint = counting_save

        def full_open(file, mode="r", *args, **kwargs):
            handle = real_open(file, mode, *args, **kwargs)
            if not (injector.in_save and state["saves"] == spec["save"] and any(c in mode for c in "wax+")):
                return handle
            write = handle.write

            def limited(data):
                if len(data) > state["budget"]:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(file))
                state["budget"] -= len(data)
                return write(data)

            handle.write = limited
            return handle

        builtins.open = io.open = full_open


def child(spec: dict, overrides: list[str]) -> None:
    Injector(spec)
    sys.argv = ["rlexp", *overrides]
    from rlexp.cli import main

    main()


# -- the parent: trials and their checks ------------------------------------------------------------------


class Campaign:
    def __init__(self, root: Path, seed: int):
        from e2e_support import rlexp_command
        from tracking_support import MlflowServer

        self.root, self.rng = root, random.Random(seed)
        self.rlexp_command = rlexp_command
        self.server = MlflowServer(root / "mlflow-server")
        self.server.start()
        self.results: list[tuple[str, int, int, list[str]]] = []

    def close(self) -> None:
        self.server.stop()

    # running ------------------------------------------------------------------------------------------

    def command(self, run_dir: Path, experiment: str, spec: dict | None, *extra: str) -> list[str]:
        overrides = [*RUN, f"logger.mlflow.tracking_uri={self.server.uri}", f"logger.mlflow.experiment_name={experiment}", *extra]
        command = self.rlexp_command(run_dir, *overrides)
        if spec is not None:  # [python, -m, rlexp, overrides…] -> [python, faults.py, child, spec, --, overrides…]
            command[1:3] = [str(Path(__file__).resolve()), "child", json.dumps(spec), "--"]
        return command

    def start(self, command: list[str], log: Path) -> subprocess.Popen:
        from e2e_support import own_env

        return subprocess.Popen(
            command, cwd=REPO, env=own_env(), stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True
        )

    def run(self, command: list[str], log: Path, timeout: float = 900) -> tuple[int, str]:
        process = self.start(command, log)
        try:
            code = process.wait(timeout=timeout)
        finally:
            _kill_group(process)
        return code, log.read_text(errors="replace")

    # the reference ------------------------------------------------------------------------------------

    def reference(self) -> None:
        """The uninterrupted run, under the census injector: how many events each phase has."""
        from e2e_support import adapter

        run_dir, census = self.root / "straight", self.root / "census.json"
        code, output = self.run(self.command(run_dir, "straight", {"census": str(census)}), self.root / "straight.log")
        if code != 0:
            sys.exit(f"the uninterrupted run failed ({code}):\n{output[-3000:]}")
        census = json.loads(census.read_text())
        #: events per phase in the whole run, and up to the end of the training loop (a signal after it
        #: ends a finished run: exit 0, FINISHED).
        self.counts, self.counts_in_loop = census["all"], census["at_done"]
        self.final = adapter(run_dir, 4)
        self.straight = run_dir
        first = adapter(run_dir, 2)
        if all((first[k] == self.final[k]).all() for k in first):
            sys.exit("the adapter did not change from step 2 to 4: comparing final adapters would prove nothing")
        missing = [p for p in PHASES if not self.counts.get(p)]
        if missing:
            sys.exit(f"no event of {missing} in the uninterrupted run: the injector misses them")

    def point(self, phase: str, in_loop: bool = False) -> list:
        return [phase, self.rng.randrange((self.counts_in_loop if in_loop else self.counts)[phase])]

    # checks -------------------------------------------------------------------------------------------

    def resumed_equals_straight(self, run_dir: Path, experiment: str, *extra: str) -> list[str]:
        """Run the same command (no fault) to the end; what differs from the uninterrupted run."""
        from mlflow import MlflowClient

        from e2e_support import adapter, logged_steps

        command = self.command(run_dir, experiment, None, *extra)
        code, output = self.run(command, run_dir.parent / f"{run_dir.name}-resume.log")
        if code != 0:
            return [f"resume exited {code}: {_last_line(output)}"]
        problems = []
        final = adapter(run_dir, 4)
        if final.keys() != self.final.keys() or any(not (final[k] == self.final[k]).all() for k in final):
            problems.append("final adapter differs from the uninterrupted run's")
        if logged_steps(run_dir) != TRAIN_STEPS:
            problems.append(f"metrics.jsonl train steps {logged_steps(run_dir)}")
        evals = [r["step"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "eval/success_rate" in r]
        if evals != EVAL_STEPS:
            problems.append(f"metrics.jsonl eval steps {evals}")
        if leftovers := [p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".")]:
            problems.append(f"left in checkpoints/: {leftovers}")
        client = MlflowClient(self.server.uri)
        runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
        if len(runs) != 1:
            return [*problems, f"{len(runs)} MLflow runs"]
        run = runs[0]
        if run.info.status != "FINISHED":
            problems.append(f"MLflow status {run.info.status}")
        local = _jsonl_metrics(run_dir)
        for key, steps in local.items():
            history = sorted(m.step for m in client.get_metric_history(run.info.run_id, key))
            if history != steps:
                problems.append(f"MLflow {key} at steps {history}, metrics.jsonl {steps}")
                break
        return problems

    def record(self, name: str, outcomes: list[list[str]], detail: str = "") -> None:
        survived = sum(not o for o in outcomes)
        failures = [f"{i}: {'; '.join(o)}" for i, o in enumerate(outcomes) if o]
        self.results.append((name, survived, len(outcomes), failures))
        share = survived / len(outcomes) if outcomes else 0.0
        print(f"{name}{f' ({detail})' if detail else ''}: {survived}/{len(outcomes)} survived ({share:.0%})", flush=True)
        for failure in failures:
            print(f"    FAILED {failure}", flush=True)

    # the faults ---------------------------------------------------------------------------------------

    def kills(self, count: int) -> None:
        outcomes, where = [], Counter()
        for i in range(count):
            phase = PHASES[i % len(PHASES)]
            point, name = self.point(phase), f"kill{i:02d}"
            where[phase] += 1
            run_dir, extra = self.root / name, []
            if i % 5 == 1:
                extra = ["logger=[mlflow,wandb]", "logger.wandb.mode=offline"]
            code, output = self.run(self.command(run_dir, name, {"at": point, "action": "KILL"}, *extra), self.root / f"{name}.log")
            if code != -signal.SIGKILL:
                outcomes.append([f"{point}: exited {code}, not killed: {_last_line(output)}"])
                continue
            problems = self.resumed_equals_straight(run_dir, name, *extra)
            if extra:
                problems += _wandb_problems(run_dir)
            outcomes.append([f"{point}: {p}" for p in problems])
        self.record("kill -9, then resume", outcomes, ", ".join(f"{p} {n}" for p, n in where.items()) + "; W&B offline too in every 5th from the 2nd")

    def signals(self, count: int, action: str = "TERM") -> None:
        from mlflow import MlflowClient

        if not count:
            return

        exit_code = {"TERM": 143, "INT": 130, "TERM2": 143}[action]
        outcomes, where, latencies = [], Counter(), []
        for i in range(count):
            phase = "update" if action == "TERM2" else PHASES[i % len(PHASES)]  # an update: a checkpoint follows
            point, name = self.point(phase, in_loop=True), f"{action.lower()}{i:02d}"
            where[phase] += 1
            run_dir = self.root / name
            code, output = self.run(self.command(run_dir, name, {"at": point, "action": action}), self.root / f"{name}.log")
            problems = []
            if code != exit_code:
                problems.append(f"exited {code}, not {exit_code}: {_last_line(output)}")
            if action != "TERM2":
                written = re.search(r"written ([0-9.]+) s after the signal", output)
                if written:
                    latencies.append(float(written.group(1)))
                    if float(written.group(1)) > 60:
                        problems.append(f"checkpoint {written.group(1)} s after the signal, past the grace")
                elif not re.search(r"its checkpoint is already written|before the first step: nothing to checkpoint", output):
                    problems.append("no preemption checkpoint reported")
                if (run_dir / "status").read_text().strip() != "KILLED":
                    problems.append(f"status file {(run_dir / 'status').read_text().strip()}")
                client = MlflowClient(self.server.uri)
                (run,) = client.search_runs([client.get_experiment_by_name(name).experiment_id])
                if run.info.status != "KILLED":
                    problems.append(f"MLflow status {run.info.status} after the signal")
            elif "again: exiting now" not in output:
                problems.append("the second signal did not end it at once")
            problems += self.resumed_equals_straight(run_dir, name)
            outcomes.append([f"{point}: {p}" for p in problems])
        title = {
            "TERM": "SIGTERM: checkpoint within the grace, KILLED, exit 143, resume",
            "INT": "SIGINT: checkpoint, KILLED, exit 130, resume",
            "TERM2": "second SIGTERM during the first's checkpoint: exit at once, resume",
        }[action]
        detail = ", ".join(f"{p} {n}" for p, n in where.items())
        if latencies:
            detail += f"; checkpoint {max(latencies):.1f} s after the signal at most"
        self.record(title, outcomes, detail)

    def lock(self, count: int) -> None:
        outcomes = []
        for i in range(count):
            name = f"lock{i:02d}"
            run_dir = self.root / name
            holder = self.start(self.command(run_dir, name, None), self.root / f"{name}-holder.log")
            while not (run_dir / "metrics.jsonl").is_file() and holder.poll() is None:
                time.sleep(0.2)
            code, output = self.run(self.command(run_dir, name, None), self.root / f"{name}-second.log")
            problems = []
            expected = f"rlexp: run dir {run_dir} is in use by pid {holder.pid}"
            if code == 0 or expected not in output:
                problems.append(f"second process not refused as expected (exit {code}): {_last_line(output)}")
            _kill_group(holder)
            problems += self.resumed_equals_straight(run_dir, name)  # a dead holder's lock does not block
            outcomes.append(problems)
        self.record("second process on a held run dir refused; a killed holder's lock does not block", outcomes)

    CORRUPTIONS = {
        "truncated safetensors": lambda c: _truncate(c / "policy" / "adapter_model.safetensors"),
        "one flipped byte": lambda c: _flip(c / "policy" / "adapter_model.safetensors"),
        "missing manifest": lambda c: (c / "manifest.json").unlink(),
        "garbled manifest": lambda c: (c / "manifest.json").write_bytes(b'{"step": 4, "files": {"trainer_st'),
        "missing optimizer state": lambda c: (c / "trainer_state.pt").unlink(),
    }
    EXPECTED_PROBLEM = {
        "truncated safetensors": "policy/adapter_model.safetensors (LoRA weights) does not match its checksum",
        "one flipped byte": "policy/adapter_model.safetensors (LoRA weights) does not match its checksum",
        "missing manifest": "no manifest",
        "garbled manifest": "manifest is not valid JSON",
        "missing optimizer state": "missing trainer_state.pt (optimizer, scheduler and RNG state)",
    }

    def corrupt(self, kinds: list[str]) -> None:
        """The uninterrupted run's dir, its newest checkpoint (4) damaged, run to 4 steps again: it must
        resume from 2 and end with the same adapter. Then every checkpoint damaged: refused."""
        outcomes = []
        for kind in kinds:
            name = "corrupt-" + kind.replace(" ", "-")
            run_dir = self.root / name
            shutil.copytree(self.straight, run_dir, ignore=shutil.ignore_patterns("wandb", ".lock"))
            shutil.rmtree(run_dir / "tracking")  # a new MLflow run in its own experiment
            self.CORRUPTIONS[kind](run_dir / "checkpoints" / "global_step_4")
            code, output = self.run(self.command(run_dir, name, None), self.root / f"{name}.log")
            problems = []
            warning = f"global_step_4 is corrupt ({self.EXPECTED_PROBLEM[kind]}); falling back"
            if warning not in output:
                problems.append(f"no warning '{warning}'")
            if not re.search(r"resumed from \S*global_step_2 at step 2", output):
                problems.append("did not resume from global_step_2")
            from e2e_support import adapter

            if code != 0:
                problems.append(f"exited {code}: {_last_line(output)}")
            else:
                final = adapter(run_dir, 4)
                if any(not (final[k] == self.final[k]).all() for k in final):
                    problems.append("final adapter differs")
            outcomes.append([f"{kind}: {p}" for p in problems])

        name = "corrupt-all"
        run_dir = self.root / name
        shutil.copytree(self.straight, run_dir, ignore=shutil.ignore_patterns("wandb", ".lock"))
        for checkpoint in (run_dir / "checkpoints").iterdir():
            _flip(checkpoint / "trainer_state.pt")
        before = _tree(run_dir / "checkpoints")
        code, output = self.run(self.command(run_dir, name, None), self.root / f"{name}.log")
        problems = []
        if code == 0 or f"rlexp: every checkpoint in run dir {run_dir} is corrupt" not in output:
            problems.append(f"not refused (exit {code}): {_last_line(output)}")
        if _tree(run_dir / "checkpoints") != before:
            problems.append("checkpoints changed")
        outcomes.append([f"all corrupt: {p}" for p in problems])
        self.record("corrupt newest checkpoint: falls back with a warning; all corrupt: refused", outcomes, ", ".join([*kinds, "all"]))

    def disk_full(self, count: int) -> None:
        from rlexp.training.checkpoint import verify_checkpoint

        outcomes = []
        for i in range(count):
            name = f"diskfull{i:02d}"
            run_dir = self.root / name
            save, budget = self.rng.choice([0, 1]), self.rng.randrange(0, 4000)  # trainer_state.pt alone is larger
            spec = {"action": "ENOSPC", "save": save, "budget": budget}
            code, output = self.run(self.command(run_dir, name, spec), self.root / f"{name}.log")
            problems = []
            target = run_dir / "checkpoints" / f"global_step_{2 * (save + 1)}"
            message = re.search(rf"saving checkpoint {re.escape(str(target))} failed \(No space left on device\); [0-9.]+ MiB free", output)
            if code == 0 or not message:
                problems.append(f"exit {code}, no error naming the path and the free space: {_last_line(output)}")
            kept = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
            if kept != (["global_step_2"] if save == 1 else []):
                problems.append(f"checkpoints/ holds {kept}")
            if save == 1 and verify_checkpoint(run_dir / "checkpoints" / "global_step_2") is not None:
                problems.append("the previous checkpoint does not verify")
            problems += self.resumed_equals_straight(run_dir, name)
            outcomes.append([f"save {save}, {budget} bytes: {p}" for p in problems])
        self.record("disk full during a checkpoint save (ENOSPC at the file layer), then resume", outcomes)

    def tracker_restart(self, count: int) -> None:
        """The campaign's own server killed -9 once the run has logged step 1, restarted at step 3."""
        from e2e_support import logged_steps

        outcomes = []
        for i in range(count):
            name = f"mlflow-restart{i:02d}"
            run_dir = self.root / name
            process = self.start(self.command(run_dir, name, None), self.root / f"{name}.log")
            problems = []
            for action, at in (("stop", 1), ("start", 2)):
                while process.poll() is None and not [s for s in _safe(logged_steps, run_dir) if s >= at]:
                    time.sleep(0.2)
                if action == "stop":
                    self.server.stop(signal.SIGKILL)
                else:
                    self.server.start()
            code = process.wait(timeout=900)
            if self.server.process is None:
                self.server.start()
            if code != 0:
                problems.append(f"exited {code}")
            from mlflow import MlflowClient

            client = MlflowClient(self.server.uri)
            (run,) = client.search_runs([client.get_experiment_by_name(name).experiment_id])
            lost = 0
            for key, steps in _jsonl_metrics(run_dir).items():
                history = sorted(m.step for m in client.get_metric_history(run.info.run_id, key))
                lost += len(set(steps) - set(history))
                if len(history) != len(set(history)):
                    problems.append(f"{key} logged twice")
            if lost:
                problems.append(f"{lost} metric points lost")
            if run.info.status != "FINISHED":
                problems.append(f"MLflow status {run.info.status}")
            outcomes.append(problems)
        self.record("MLflow server killed -9 mid-run and restarted: metric points lost = 0", outcomes)

    def fuzz(self, count: int) -> None:
        from rlexp.envs import MazeEnv, generate_maze
        from rlexp.envs.actions import ACTION_FORMATS, parse_action

        envs = {
            (fmt, elicit): MazeEnv(9, 20, action_format=fmt, elicit_verbalization=elicit)
            for fmt in ACTION_FORMATS for elicit in (False, True)
        }
        outcomes, valid = [], 0
        for i in range(count):
            text = random_output(self.rng)
            key = (ACTION_FORMATS[i % len(ACTION_FORMATS)], bool(i // len(ACTION_FORMATS) % 2))
            env = envs[key]
            try:
                action, feedback = parse_action(text, *key)
                if i < len(envs) or env.done:
                    env.reset(generate_maze(9, i))
                transition = env.step(text)
                if action is None and not (feedback and transition.feedback and not transition.valid):
                    outcomes.append([f"{text[:60]!r}: invalid without feedback"])
                    continue
                valid += action is not None
                outcomes.append([])
            except Exception as error:  # the point of the fuzz: any exception is a failure
                outcomes.append([f"{text[:60]!r}: {type(error).__name__}: {error}"])
        self.record("random model outputs through the action parser and the env: no exception", outcomes,
                    f"{valid} happened to be valid actions")


def random_output(rng: random.Random) -> str:
    """One random model reply: bytes, unicode (lone surrogates too), huge text, nested tags and tuples,
    near-valid actions."""
    kind = rng.randrange(8)
    if kind == 0:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(200))).decode("latin-1")
    if kind == 1:
        return "".join(chr(rng.randrange(0x110000)) for _ in range(rng.randrange(100)))
    if kind == 2:
        return rng.choice(["(", "<action>", "('move', ", "`", "<answer>", "x"]) * rng.randrange(10_000, 300_000)
    if kind == 3:
        depth = rng.randrange(1, 2000)
        return "(" * depth + rng.choice(["'move', 0", "'stop', 'stop'", ""]) + ")" * rng.randrange(depth + 1)
    if kind == 4:
        inner = rng.choice(["left", "up", "<action>down</action>", "", "stop" * 50])
        for _ in range(rng.randrange(1, 30)):
            inner = rng.choice(["<action>{}</action>", "<answer>{}</answer>", "<think>{}</think>", "```{}```"]).format(inner)
        return inner
    if kind == 5:
        payload = rng.choice(["10**100", "-1", "1e309", "None", "'stop'", "[0]", "{1: 2}", "b'x'", "0j", "'\x00'", "True"])
        return f"Action: ({rng.choice(['move', 'stop', 'MOVE', ''])!r}, {payload})"
    if kind == 6:
        return "".join(rng.choice("()'\",<>/\\`\n actionmove0123stop") for _ in range(rng.randrange(400)))
    return "".join(rng.choice(["('move', 1)", "<action>left</action>", "🧭", "\u202e", "\ud800", "<|end_of_box|>"]) for _ in range(rng.randrange(50)))


def _jsonl_metrics(run_dir: Path) -> dict[str, list[int]]:
    """metric name (as MLflow stores it) -> the steps metrics.jsonl has it at."""
    from rlexp.tracking.mlflow_tracker import sanitize_name

    steps: dict[str, list[int]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        for key in record.keys() - {"step", "time"}:
            steps.setdefault(sanitize_name(key), []).append(record["step"])
    return {k: sorted(v) for k, v in steps.items()}


def _wandb_problems(run_dir: Path) -> list[str]:
    from tracking_support import wandb_history, wandb_records

    logs = sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    steps = sorted(row["_step"] for p in logs for row in wandb_history(wandb_records(p)) if "train/loss" in row)
    return [] if steps == TRAIN_STEPS else [f"W&B offline train/loss at steps {steps}"]


def _safe(fn, *args):
    try:
        return fn(*args)
    except (OSError, ValueError):
        return []


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    process.wait()


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _last_line(output: str) -> str:
    lines = [line for line in output.replace("\r", "\n").splitlines() if line.strip()]
    return lines[-1][:300] if lines else "(no output)"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["child"]:
        child(json.loads(argv[1]), argv[3:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer trials (the slow test suite's run)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="keep the trials' run dirs and logs here (default: a temp dir, removed)")
    args = parser.parse_args(argv)
    counts = (
        dict(kills=2, sigterm=1, sigint=1, term2=1, lock=1, corrupt=1, disk=1, tracker=1, fuzz=2000)
        if args.quick else
        dict(kills=20, sigterm=10, sigint=2, term2=2, lock=2, corrupt=5, disk=3, tracker=2, fuzz=10_000)
    )
    root = args.out or Path(tempfile.mkdtemp(prefix="rlexp-faults-"))
    root.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("RLEXP_CACHE", str(root / "cache"))
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL"):
        os.environ.pop(name, None)
    os.environ["WANDB_CONFIG_DIR"] = str(root / "wandb-home")
    start = time.monotonic()
    campaign = Campaign(root, args.seed)
    try:
        print(f"rlexp fault campaign: seed {args.seed}, {'quick' if args.quick else 'full'}; tiny model, CPU, {os.cpu_count()} cores", flush=True)
        campaign.fuzz(counts["fuzz"])
        campaign.reference()
        campaign.kills(counts["kills"])
        campaign.signals(counts["sigterm"], "TERM")
        campaign.signals(counts["sigint"], "INT")
        campaign.signals(counts["term2"], "TERM2")
        campaign.lock(counts["lock"])
        campaign.corrupt(random.Random(args.seed).sample(list(Campaign.CORRUPTIONS), counts["corrupt"]))
        campaign.disk_full(counts["disk"])
        campaign.tracker_restart(counts["tracker"])
    finally:
        campaign.close()
        if args.out is None:
            shutil.rmtree(root, ignore_errors=True)
    trials = [r for r in campaign.results if not r[0].startswith("random model outputs")]
    survived, total = sum(r[1] for r in trials), sum(r[2] for r in trials)
    every = all(r[1] == r[2] for r in campaign.results)
    print(
        f"total: {survived}/{total} fault trials survived ({survived / total:.0%}), every line at 100%: "
        f"{'yes' if every else 'NO'}; {time.monotonic() - start:.0f} s", flush=True,
    )
    return 0 if every else 1


if __name__ == "__main__":
    sys.exit(main())
