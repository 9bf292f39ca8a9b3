"""Bad input ends in one line naming the key, before any model loads.

Each case runs what ``rlexp`` runs before a task, in-process: the override check, Hydra's compose, then
``prepare`` (``validate`` and the machine check). Two subprocess tests cover the command line itself.
"""

import os
import subprocess
import sys

import pytest

from conftest import REPO, compose_config
from rlexp.cli import check_override_keys, prepare
from rlexp.config import ConfigError

#: (overrides, the key the one-line refusal must name)
BAD = [
    # misspelt keys and parents: "did you mean", never Hydra's "use +key"
    (["algoritm.lr=1"], "algoritm"),
    (["+algoritm.lr=1"], "algoritm"),
    (["logger.mlfow.x=1"], "logger.mlfow"),
    (["algorithm.lrr=1"], "algorithm.lrr"),
    (["model.lora.rnk=4"], "model.lora.rnk"),
    (["env.sizee=9"], "env.sizee"),
    (["rollout.temprature=1"], "rollout.temprature"),
    (["cluster.gpus=2"], "cluster.gpus"),
    (["+model.foo=1"], "model.foo"),
    (["modle=tiny"], "modle"),
    (["eval.greedyy=true"], "eval.greedyy"),
    (["report.sweeep=x"], "report.sweeep"),
    (["logger.mlflow.x=1"], "logger.mlflow.x"),
    (["logger.wandb.project=x"], "logger.wandb"),
    (["-m", "logger=mlflow,wandb", "logger.wandb.mode=offline"], "logger.wandb"),
    (["+algorithm.lr=1"], "algorithm.lr"),
    (["+experiment=visgym_maze_grpo"], "experiment"),
    # settings of the vLLM engine, which is not written yet
    (["rollout.gpu_memory_utilization=0.5"], "rollout.gpu_memory_utilization"),
    (["rollout.sleep_level=1"], "rollout.sleep_level"),
    # group options that do not exist: the valid ones listed
    (["model=foo"], "model"),
    (["env=maze_huge"], "env"),
    (["algorithm=ppo"], "algorithm"),
    (["cluster=tpu"], "cluster"),
    (["logger=tensorboard"], "logger"),
    (["logger=[mlflow,tensorboard]"], "logger"),
    (["experiment=nope"], "experiment"),
    (["rollout=vllm"], "rollout"),
    (["eval=fast"], "eval"),
    (["-m", "model=tiny,qwen3_vl_9b"], "model"),
    # wrong types and enum values
    (["algorithm.lr=fast"], "algorithm.lr"),
    (["env.size=x"], "env.size"),
    (["seed=abc"], "seed"),
    (["total_steps=1.5"], "total_steps"),
    (["algorithm.norm_by_std=maybe"], "algorithm.norm_by_std"),
    (["env.action_format=json"], "env.action_format"),
    (["env.prompt=chat"], "env.prompt"),
    (["model.dtype=float8"], "model.dtype"),
    (["algorithm.loss_reduction=sum"], "algorithm.loss_reduction"),
    (["algorithm.name=ppo"], "algorithm.name"),
    (["cluster.launcher=slurm"], "cluster.launcher"),
    (["task=train2"], "task"),
    (["eval.policy=oracle"], "eval.policy"),
    (["logger.mlflow.flush_timeout_s=soon"], "logger.mlflow.flush_timeout_s"),
    (["logger.mlflow.http_timeout_s=fast"], "logger.mlflow.http_timeout_s"),
    (["logger.mlflow.tags=[a,b]"], "logger.mlflow.tags"),
    (["rollout.max_turns=null"], "rollout.max_turns"),
    (["algorithm.lr=null"], "algorithm.lr"),
    (["model.lora=5"], "model.lora"),
    (["-m", "algorithm.lr=1e-3,fast"], "algorithm.lr"),
    # out of range: the list
    (["env.max_steps=12"], "env.max_steps"),
    (["env.max_steps=0"], "env.max_steps"),
    (["env=maze_hard", "env.max_steps=16", "rollout.max_turns=4"], "env.max_steps"),
    (["algorithm.max_grad_norm=0"], "algorithm.max_grad_norm"),
    (["algorithm.max_grad_norm=-1"], "algorithm.max_grad_norm"),
    (["algorithm.lr_warmup_steps=-1"], "algorithm.lr_warmup_steps"),
    (["model.lora.alpha=0"], "model.lora.alpha"),
    (["model.lora.alpha=-16"], "model.lora.alpha"),
    (["algorithm.lr=0"], "algorithm.lr"),
    (["algorithm.lr=-1e-5"], "algorithm.lr"),
    (["algorithm.lr=10"], "algorithm.lr"),
    # rollout=turn_batch plays one exact-pixel image a turn, for GRPO, in one process
    (["rollout=turn_batch", "env.history_window=2"], "env.history_window"),
    (["rollout=turn_batch", "env.history_window=1", "env.image_format=jpeg"], "env.image_format"),
    (["experiment=tiny_maze_repro", "cluster=local_cpu", "rollout=turn_batch", "env.elicit_verbalization=true"], "env.elicit_verbalization"),
    (["experiment=tiny_maze_repro", "cluster=local_cpu", "rollout=turn_batch", "algorithm=sft"], "algorithm=sft"),
    (["experiment=tiny_maze_repro", "cluster=gpu_2x", "rollout=turn_batch"], "rollout=turn_batch"),
    (["experiment=tiny_maze_repro", "cluster=local_cpu", "rollout=turn_batch", "rollout.engine.autocast=float64"], "rollout.engine.autocast"),
    (["rollout.engine.autocast=bfloat16"], "rollout.engine.autocast"),  # the hf engine does not read it
    (["rollout.temperature=0"], "rollout.temperature"),
    (["rollout.temperature=-0.5"], "rollout.temperature"),
    (["rollout.top_p=0"], "rollout.top_p"),
    (["rollout.top_p=2"], "rollout.top_p"),
    (["algorithm.kl_coef=-0.1"], "algorithm.kl_coef"),
    (["algorithm.kl_coef=1000"], "algorithm.kl_coef"),
    (["total_steps=0"], "total_steps"),
    (["total_steps=-3"], "total_steps"),
    (["env.size=11"], "env.size"),
    (["env.cell_px=100000"], "env.cell_px"),
    (["env.cell_px=0"], "env.cell_px"),
    (["env.cell_px=2"], "env.cell_px"),
    (["seed=-1"], "seed"),
    (["seed=4294967296"], "seed"),
    (["model.lora.rank=0"], "model.lora.rank"),
    (["model.lora.rank=-8"], "model.lora.rank"),
    (["model.lora.rank=100000"], "model.lora.rank"),
    (["model.lora.dropout=1.5"], "model.lora.dropout"),
    (["model.lora.dropout=-0.1"], "model.lora.dropout"),
    (["model.lora.dropout=0.1"], "model.lora.dropout"),
    (["algorithm=dr_grpo", "model.lora.dropout=0.05"], "model.lora.dropout"),
    (["cluster.device=foo"], "cluster.device"),
    (["cluster.device=cuda:x"], "cluster.device"),
    (["cluster.device=tpu"], "cluster.device"),
    (["algorithm.eps_low=0"], "algorithm.eps_low"),
    (["algorithm.eps_low=1"], "algorithm.eps_low"),
    (["algorithm.eps_high=-0.2"], "algorithm.eps_high"),
    (["algorithm.eps_high=0"], "algorithm.eps_high"),
    (["eval.num_mazes=0"], "eval.num_mazes"),
    (["eval.num_mazes=65"], "eval.num_mazes"),
    (["keep_last_ckpts=0"], "keep_last_ckpts"),
    (["eval_interval=0"], "eval_interval"),
    (["ckpt_interval=0"], "ckpt_interval"),
    (["resume=/nonexistent/ckpt"], "resume"),
    (["resume=lates"], "resume"),
    # other ranges and combinations
    (["algorithm.n_samples_per_prompt=1"], "algorithm.n_samples_per_prompt"),
    (["algorithm.n_samples_per_prompt=0"], "algorithm.n_samples_per_prompt"),
    (["algorithm.train_batch_size=0"], "algorithm.train_batch_size"),
    (["algorithm.train_batch_size=4", "algorithm.policy_mini_batch_size=3"], "algorithm.policy_mini_batch_size"),
    (["algorithm.micro_batch_size=0"], "algorithm.micro_batch_size"),
    (["algorithm.epochs_per_step=0"], "algorithm.epochs_per_step"),
    (["algorithm.epochs_per_step=1000"], "algorithm.epochs_per_step"),
    (["rollout.max_turns=0"], "rollout.max_turns"),
    (["rollout.max_turns=25"], "rollout.max_turns"),
    (["env.train_min_expert_length=0"], "env.train_min_expert_length"),
    (["env.train_min_expert_length=17", "rollout.max_turns=16"], "env.train_min_expert_length"),
    (["rollout.max_new_tokens_per_turn=0"], "rollout.max_new_tokens_per_turn"),
    (["rollout.max_new_tokens_per_turn=1000000"], "rollout.max_new_tokens_per_turn"),
    (["env.size=8"], "env.size"),
    (["env.size=3"], "env.size"),
    (["env.max_steps=5000"], "env.max_steps"),
    (["env.history_window=0"], "env.history_window"),
    (["env.format_reward=1.0"], "env.format_reward"),
    (["env.format_reward=-0.1"], "env.format_reward"),
    (["env.pinned_set=maze_medium"], "env.pinned_set"),
    (["eval.samples_per_maze=0", "eval.greedy=false"], "eval.samples_per_maze"),
    (["eval.samples_per_maze=4"], "eval.samples_per_maze"),
    (["eval.expert_prob=1.5"], "eval.expert_prob"),
    (["eval.expert_prob=-0.1"], "eval.expert_prob"),
    (["eval.policy=expert"], "eval.policy"),
    (["checkpoint=/nonexistent"], "checkpoint"),
    (["task=eval", "checkpoint=/nonexistent"], "checkpoint"),
    (["task=submit"], "task"),
    (["algorithm=sft", "algorithm.kl_coef=0.1"], "algorithm.kl_coef"),
    (["algorithm=sft", "algorithm.drop_zero_variance_groups=true"], "algorithm.drop_zero_variance_groups"),
    (["algorithm=sft", "algorithm.loss_reduction=sequence_mean"], "algorithm.loss_reduction"),
    (["algorithm=sft", "algorithm.eps_high=0.28"], "algorithm.eps_high"),
    (["algorithm.optimizer.weight_decay=-0.01"], "algorithm.optimizer.weight_decay"),
    (["algorithm.optimizer._partial_=false"], "algorithm.optimizer._partial_"),
    (["algorithm.lr_scheduler._partial_=false"], "algorithm.lr_scheduler._partial_"),
    (["algorithm.optimizer._target_=torch.optim.Adamw"], "algorithm.optimizer._target_"),
    (["rollout.engine._target_=rlexp.rollout.no_such_engine.Engine"], "rollout.engine._target_"),
    (["logger.mlflow.flush_timeout_s=-1"], "logger.mlflow.flush_timeout_s"),
    (["logger.mlflow.http_timeout_s=0"], "logger.mlflow.http_timeout_s"),
    (["logger.mlflow.retry_interval_s=0"], "logger.mlflow.retry_interval_s"),
    (["logger=wandb", "logger.wandb.mode=sometimes"], "logger.wandb.mode"),
    (["logger=wandb", "logger.wandb.project="], "logger.wandb.project"),
    (["model.path="], "model.path"),
    (["run_name="], "run_name"),
    (["model.lora.target_modules=[]"], "model.lora.target_modules"),
    (["model.attn_implementation=flash"], "model.attn_implementation"),
    # cluster settings the chosen launcher cannot run (task=plan reads them all)
    (["cluster.ray.workers=2"], "cluster.ray.workers"),
    (["cluster=ray_cpu", "cluster.ray.workers=0"], "cluster.ray.workers"),
    (["cluster.launcher=torchrun"], "cluster.launcher"),
    (["cluster.nodes=3"], "cluster.nodes"),
    (["cluster.nodes=0"], "cluster.nodes"),
    (["cluster=gpu_1x", "cluster.gpus_per_node=2"], "cluster.gpus_per_node"),
    (["cluster.gpus_per_node=-1"], "cluster.gpus_per_node"),
    (["cluster.gpus_per_node=1"], "cluster.gpus_per_node"),
    (["cluster.head=ml.r5d.16xlarge"], "cluster.head"),
    (["cluster.shared_storage=/fsx"], "cluster.shared_storage"),
    (["cluster.gpu_memory_gb=96"], "cluster.gpu_memory_gb"),
    (["cluster.cpu_memory_gb=100000"], "cluster.cpu_memory_gb"),
]


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if anything tries to load a model."""

    def refuse(*args, **kwargs):
        pytest.fail("a model was loaded for a bad override")

    monkeypatch.setattr("rlexp.models.loading.load_model_and_processor", refuse)
    monkeypatch.setattr("rlexp.models.policy.load_model_and_processor", refuse)


def run_checks(overrides: list[str]) -> None:
    """What ``rlexp`` does with these overrides before its task runs (``-m``: each job's; a sweep's values
    are all checked before any job composes)."""
    overrides = [o for o in overrides if o != "-m"]
    check_override_keys(overrides)
    prepare(compose_config(*overrides))


def test_enough_cases():
    assert len(BAD) >= 100


@pytest.mark.parametrize("overrides,key", BAD, ids=[" ".join(o) for o, _ in BAD])
def test_bad_override_is_one_line_naming_the_key(overrides, key, no_model_load):
    with pytest.raises(ConfigError) as error:
        run_checks(overrides)
    message = str(error.value)
    assert "\n" not in message, message
    assert key in message, message
    assert "+" + key not in message.replace(f"'{overrides[0]}'", "")  # never Hydra's advice to use +key


def test_misspelt_parent_suggests_the_parent_and_lists_valid_keys():
    with pytest.raises(ConfigError) as error:
        check_override_keys(["algoritm.lr=1"])
    assert "did you mean 'algorithm'?" in str(error.value) and "rollout" in str(error.value)
    with pytest.raises(ConfigError, match="did you mean 'mlflow'.*valid keys under 'logger': mlflow, wandb"):
        check_override_keys(["logger.mlfow.x=1"])


def test_wrong_option_lists_the_options():
    with pytest.raises(ConfigError, match="options: qwen3_vl_2b, qwen3_vl_8b, tiny"):
        check_override_keys(["model=foo"])


def test_range_refusal_names_value_and_range():
    with pytest.raises(ConfigError, match=r"rollout\.top_p=2\.0 is out of range; valid: \(0, 1\]"):
        run_checks(["rollout.top_p=2"])
    with pytest.raises(ConfigError, match=r"env\.max_steps=12 is below 13"):
        run_checks(["env.max_steps=12"])


def test_default_run_and_good_variants_pass(no_model_load):
    for overrides in ([], ["algorithm=sft", "model.lora.dropout=0.1"], ["env=maze_hard"], ["logger=[mlflow,wandb]"],
                      ["logger=none"], ["algorithm=dr_grpo"], ["eval.greedy=false", "eval.samples_per_maze=4"]):
        run_checks(overrides)


def test_cuda_device_is_checked_before_loading(monkeypatch, no_model_load):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="cluster.device=cuda but no CUDA device"):
        run_checks(["cluster=gpu_1x", "cluster.cpu_memory_gb=1"])

    class Props:
        total_memory = 80e9

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: Props)
    with pytest.raises(ConfigError, match=r"cluster.gpu_memory_gb=141.0 but cuda:0 has 80.0 GB"):
        run_checks(["cluster=gpu_1x", "cluster.cpu_memory_gb=1"])
    with pytest.raises(ConfigError, match="cluster.device=cuda:1 but this machine has 1 CUDA devices"):
        run_checks(["cluster=gpu_1x", "cluster.cpu_memory_gb=1", "cluster.device=cuda:1"])
    run_checks(["cluster=gpu_1x", "cluster.cpu_memory_gb=1", "cluster.gpu_memory_gb=80"])


def _rlexp(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return subprocess.run([sys.executable, "-m", "rlexp", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(
    "args,needle",
    [
        (["algoritm.lr=1"], "did you mean 'algorithm'?"),
        (["env.max_steps=12", "hydra.run.dir=/tmp/rlexp-test-unused"], "env.max_steps=12"),
        (["cluster=ray_cpu", "hydra.run.dir=/tmp/rlexp-test-unused"], "cluster.launcher=ray needs the cluster's address"),
    ],
)
def test_cli_refuses_in_one_line_without_traceback(args, needle):
    result = _rlexp(*args)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [result.stderr.strip()] and result.stderr.startswith("rlexp: ")
    assert needle in result.stderr and "Traceback" not in result.stderr


def test_cli_prints_the_seed_recipe():
    result = _rlexp("experiment=visgym_maze_grpo", "--cfg", "job")
    assert result.returncode == 0, result.stderr
    assert "launcher: ray" in result.stdout


def test_multirun_job_refused_by_validation_is_a_failed_run_and_the_sweep_goes_on(tmp_path):
    """Job 0 has a bad seed, job 1 is fine (a quick scripted eval): job 0 leaves a FAILED MLflow run with the
    refusal as its ``error`` tag, job 1 still runs, and the sweep ends non-zero."""
    from mlflow import MlflowClient

    uri, sweep = f"sqlite:///{tmp_path}/mlflow.db", tmp_path / "sweep"
    result = _rlexp(
        "-m", "task=eval", "eval.policy=expert", "eval.num_mazes=2", "seed=-1,0",
        "logger=mlflow", f"logger.mlflow.tracking_uri={uri}", f"hydra.sweep.dir={sweep}",
    )
    assert result.returncode != 0
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("tiny_cpu").experiment_id])
    by_seed = {run.data.params["seed"]: run for run in runs}
    assert sorted(by_seed) == ["-1", "0"]
    assert by_seed["-1"].info.status == "FAILED"
    assert by_seed["-1"].data.tags["error"] == "seed=-1 is out of range; valid: [0, 2147483647]"
    assert by_seed["0"].info.status == "FINISHED"
    assert (sweep / "1" / "eval" / "expert.jsonl").is_file()
