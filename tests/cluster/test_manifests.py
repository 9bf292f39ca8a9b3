"""``task=manifest``: KubeRay manifests for every GPU cluster option, checked structurally (no KubeRay CRD
schema ships in a Python package; the fields checked are those of KubeRay's ray.io/v1 API)."""

import subprocess
import sys

import pytest
import yaml

from conftest import REPO, compose_config
from rlexp.cli import group_options
from rlexp.tracking.base import GIT_COMMIT_ENV, git_commit

GPU_CLUSTERS = [c for c in group_options("cluster") if compose_config(f"cluster={c}").cluster.gpus_per_node > 0]


@pytest.fixture(scope="module")
def manifests(tmp_path_factory):
    """cluster option -> (RayCluster file's documents, RayJob file's documents, what rlexp printed)."""
    out = {}
    for option in GPU_CLUSTERS:
        run_dir = tmp_path_factory.mktemp(option)
        result = subprocess.run(
            [sys.executable, "-m", "rlexp", "task=manifest", f"cluster={option}", "run_name=m", f"hydra.run.dir={run_dir}"],
            cwd=REPO, capture_output=True, text=True, timeout=120,
        )
        assert result.returncode == 0, result.stderr[-2000:]
        docs = [list(yaml.safe_load_all((run_dir / "kuberay" / f).read_text())) for f in ("raycluster.yaml", "rayjob.yaml")]
        out[option] = (*docs, result.stdout)
    return out


def test_there_are_gpu_cluster_options():
    assert {"gpu_1x", "gpu_2x", "hyperpod_g7e_12xlarge", "p5_48xlarge", "p4d_24xlarge", "g6e_12xlarge"} <= set(GPU_CLUSTERS)


@pytest.mark.parametrize("option", GPU_CLUSTERS)
def test_raycluster_has_the_cluster_options_shape(option, manifests):
    cluster_docs, _, printed = manifests[option]
    cfg = compose_config(f"cluster={option}").cluster
    (raycluster,) = [d for d in cluster_docs if d["kind"] == "RayCluster"]
    assert raycluster["apiVersion"] == "ray.io/v1" and raycluster["metadata"]["name"].startswith("rlexp-")
    spec = raycluster["spec"]
    head = spec["headGroupSpec"]["template"]["spec"]
    (worker_group,) = spec["workerGroupSpecs"]
    worker = worker_group["template"]["spec"]
    # head: the head instance's CPUs and memory, no GPU, Ray's dashboard for job submission
    head_limits = head["containers"][0]["resources"]["limits"]
    assert "nvidia.com/gpu" not in head_limits and spec["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0"
    assert int(head_limits["cpu"]) <= cfg.kuberay.head_cpus and int(head_limits["memory"].removesuffix("Gi")) <= cfg.kuberay.head_memory_gb
    assert 8265 in [p["containerPort"] for p in head["containers"][0]["ports"]]
    if cfg.head:
        assert head["nodeSelector"] == {"node.kubernetes.io/instance-type": cfg.head}
    # workers: one pod a node, its GPUs as limits, on the instance type
    assert worker_group["replicas"] == worker_group["minReplicas"] == worker_group["maxReplicas"] == cfg.nodes
    limits = worker["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == str(cfg.gpus_per_node)
    assert int(limits["memory"].removesuffix("Gi")) < cfg.cpu_memory_gb
    if cfg.instance_type:
        assert worker["nodeSelector"] == {"node.kubernetes.io/instance-type": cfg.instance_type}
    # every pod: the image, the shared storage's ReadWriteMany claim at the shared path, no inline secret
    storage = cfg.shared_storage or "/shared"
    for pod in (head, worker):
        (container,) = pod["containers"]
        assert container["image"] == cfg.kuberay.image
        assert {"name": "shared", "mountPath": storage} in container["volumeMounts"]
        assert {"name": "shared", "persistentVolumeClaim": {"claimName": cfg.kuberay.storage_claim}} in pod["volumes"]
        env = {e["name"]: e for e in container["env"]}
        assert env["WANDB_API_KEY"] == {
            "name": "WANDB_API_KEY", "valueFrom": {"secretKeyRef": {"name": "rlexp-secrets", "key": "WANDB_API_KEY", "optional": True}}
        }
        assert env["NCCL_NVLS_ENABLE"]["value"] == "0"
        assert pod["terminationGracePeriodSeconds"] > compose_config().preempt_grace_s
    assert "kubectl apply -f" in printed


@pytest.mark.parametrize("option", GPU_CLUSTERS)
def test_rayjob_runs_this_config_on_the_same_cluster(option, manifests):
    cluster_docs, job_docs, _ = manifests[option]
    (raycluster,) = [d for d in cluster_docs if d["kind"] == "RayCluster"]
    (rayjob,) = [d for d in job_docs if d["kind"] == "RayJob"]
    spec = rayjob["spec"]
    assert spec["entrypoint"] == "python -m rlexp.ray_job" and spec["shutdownAfterJobFinishes"] is True
    assert spec["rayClusterSpec"] == raycluster["spec"]
    env_vars = yaml.safe_load(spec["runtimeEnvYAML"])["env_vars"]
    assert set(env_vars) == {"RLEXP_RAY_JOB", "RAY_JOB_STOP_WAIT_TIME_S", GIT_COMMIT_ENV}  # nothing from this shell
    assert env_vars[GIT_COMMIT_ENV] == git_commit()  # the commit the job's trackers tag the run with
    payload = yaml.safe_load(env_vars["RLEXP_RAY_JOB"])
    assert payload["config"]["task"] == "train" and payload["config"]["cluster"]["launcher"] == "ray"
    assert payload["run_dir"].startswith(payload["config"]["cluster"]["shared_storage"])


def test_storage_claim_is_written_when_sized(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "rlexp", "task=manifest", "cluster=hyperpod_g7e_12xlarge", "run_name=m", f"hydra.run.dir={tmp_path}",
         "cluster.kuberay.storage_gb=1200", "cluster.kuberay.storage_class=fsx-sc"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    docs = list(yaml.safe_load_all((tmp_path / "kuberay" / "raycluster.yaml").read_text()))
    (claim,) = [d for d in docs if d["kind"] == "PersistentVolumeClaim"]
    assert claim["metadata"]["name"] == "fsx-claim" and claim["spec"] == {
        "accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1200Gi"}}, "storageClassName": "fsx-sc"
    }
