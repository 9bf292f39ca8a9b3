"""KubeRay manifests for a ``cluster`` option (``task=manifest``): the ``RayCluster`` the run needs, and a
``RayJob`` that brings up such a cluster, runs this config on it and tears it down.

* The head group: the head instance's CPUs and memory (``cluster.kuberay.head_cpus/head_memory_gb``, a
  ``pod_share`` of them requested), no GPU, Ray's dashboard (Job Submission API, 8265), client (10001)
  and metrics (8080) ports; ``RAY_JOB_STOP_WAIT_TIME_S`` above ``preempt_grace_s``.
* One worker group: ``nodes`` pods, each with ``gpus_per_node`` GPUs (``nvidia.com/gpu`` limits) on the
  ``instance_type`` (node selector ``node.kubernetes.io/instance-type``), a share of the node's CPUs
  and memory, and a memory-backed ``/dev/shm`` for NCCL.
* Every pod mounts the ReadWriteMany claim ``cluster.kuberay.storage_claim`` at ``cluster.shared_storage``
  (written as a ``PersistentVolumeClaim`` too when ``storage_gb`` is set), runs the Dockerfile's image,
  and gets the env vars the run needs; credentials come from the Secret ``rlexp-secrets`` where it has
  them (``optional``), never from the manifest itself.
"""

import math
from typing import Any

import yaml
from omegaconf import DictConfig

#: KubeRay's API version for RayCluster and RayJob (KubeRay ≥ 1.0).
API_VERSION = "ray.io/v1"
#: the Ray version the Dockerfile installs (KubeRay's ``rayVersion``).
RAY_VERSION = "2.60.0"
#: the Kubernetes Secret whose keys become the pods' credentials, where present.
SECRET_NAME = "rlexp-secrets"
#: credentials a run may use, read from that Secret.
SECRET_KEYS = ("WANDB_API_KEY", "HF_TOKEN", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")
#: CPUs a worker pod asks for per GPU where the cluster option does not say how many its nodes have.
CPUS_PER_GPU = 8
#: how a node names its instance type (a well-known Kubernetes label).
INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"
VOLUME = "shared"


def ray_cluster(cfg: DictConfig, name: str) -> dict[str, Any]:
    kube = cfg.cluster.kuberay
    return {
        "apiVersion": API_VERSION,
        "kind": "RayCluster",
        "metadata": {"name": name, "namespace": kube.namespace, "labels": {"app.kubernetes.io/part-of": "rlexp"}},
        "spec": ray_cluster_spec(cfg),
    }


def ray_cluster_spec(cfg: DictConfig) -> dict[str, Any]:
    cluster, kube = cfg.cluster, cfg.cluster.kuberay
    share = kube.pod_share
    head_resources = _resources(math.floor(kube.head_cpus * share), math.floor(kube.head_memory_gb * share))
    worker_cpus = cluster.cpus_per_node or CPUS_PER_GPU * cluster.gpus_per_node
    worker_resources = _resources(math.floor(worker_cpus * share), math.floor(cluster.cpu_memory_gb * share), cluster.gpus_per_node)
    head = _pod(
        cfg, "ray-head", head_resources, cluster.head,
        ports=[("gcs-server", 6379), ("dashboard", 8265), ("client", 10001), ("metrics", 8080)],
        extra_env={"RAY_JOB_STOP_WAIT_TIME_S": str(math.ceil(cfg.preempt_grace_s) + 30)},
    )
    worker = _pod(cfg, "ray-worker", worker_resources, cluster.instance_type, ports=[("metrics", 8080)], gpus=cluster.gpus_per_node)
    return {
        "rayVersion": RAY_VERSION,
        "headGroupSpec": {
            # the head trains nothing: it holds Ray's GCS and dashboard, and the job's driver
            "rayStartParams": {"dashboard-host": "0.0.0.0", "num-gpus": "0", "metrics-export-port": "8080"},
            "template": head,
        },
        "workerGroupSpecs": [
            {
                "groupName": "gpu-workers" if cluster.gpus_per_node else "cpu-workers",
                "replicas": cluster.nodes,
                "minReplicas": cluster.nodes,
                "maxReplicas": cluster.nodes,
                "rayStartParams": {"metrics-export-port": "8080"},
                "template": worker,
            }
        ],
    }


def ray_job(cfg: DictConfig, name: str, runtime_env_yaml: str) -> dict[str, Any]:
    """A RayJob: KubeRay starts the cluster, submits ``python -m rlexp.ray_job`` with ``runtime_env_yaml``
    (the submitted run, exactly as ``cluster.launcher=ray`` sends it, less the working dir: the image has
    rlexp), and deletes the cluster when the job ends."""
    kube = cfg.cluster.kuberay
    return {
        "apiVersion": API_VERSION,
        "kind": "RayJob",
        "metadata": {"name": name, "namespace": kube.namespace, "labels": {"app.kubernetes.io/part-of": "rlexp"}},
        "spec": {
            "entrypoint": "python -m rlexp.ray_job",
            "runtimeEnvYAML": runtime_env_yaml,
            "shutdownAfterJobFinishes": True,
            "ttlSecondsAfterFinished": 600,
            "rayClusterSpec": ray_cluster_spec(cfg),
        },
    }


def storage_claim(cfg: DictConfig) -> dict[str, Any] | None:
    """The shared storage's claim, where ``storage_gb`` asks for one to be made (else it exists already)."""
    kube = cfg.cluster.kuberay
    if kube.storage_gb is None:
        return None
    spec: dict[str, Any] = {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": f"{kube.storage_gb}Gi"}}}
    if kube.storage_class is not None:
        spec["storageClassName"] = kube.storage_class
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": kube.storage_claim, "namespace": kube.namespace},
        "spec": spec,
    }


def _resources(cpus: int, memory_gb: int, gpus: int = 0) -> dict[str, Any]:
    amounts: dict[str, Any] = {"cpu": str(max(cpus, 1)), "memory": f"{max(memory_gb, 1)}Gi"}
    limits = {**amounts, **({"nvidia.com/gpu": str(gpus)} if gpus else {})}
    return {"requests": dict(amounts), "limits": limits}


def _pod(
    cfg: DictConfig, container: str, resources: dict, instance_type: str | None, ports: list[tuple[str, int]],
    extra_env: dict[str, str] | None = None, gpus: int = 0,
) -> dict[str, Any]:
    cluster, kube = cfg.cluster, cfg.cluster.kuberay
    mounts = [{"name": VOLUME, "mountPath": cluster.shared_storage}] if cluster.shared_storage else []
    volumes = [{"name": VOLUME, "persistentVolumeClaim": {"claimName": kube.storage_claim}}] if cluster.shared_storage else []
    if gpus:  # NCCL's shared-memory transport between the GPUs of a pod
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory"}})
    spec: dict[str, Any] = {
        # SIGTERM first: the run checkpoints within preempt_grace_s before the kubelet's SIGKILL
        "terminationGracePeriodSeconds": math.ceil(cfg.preempt_grace_s) + 30,
        "containers": [
            {
                "name": container,
                "image": kube.image,
                "ports": [{"name": port_name, "containerPort": port} for port_name, port in ports],
                "resources": resources,
                "env": _env(cfg, extra_env or {}),
                "volumeMounts": mounts,
            }
        ],
        "volumes": volumes,
    }
    if instance_type:
        spec["nodeSelector"] = {INSTANCE_TYPE_LABEL: instance_type}
    if gpus:
        spec["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    return {"spec": spec}


def _env(cfg: DictConfig, extra: dict[str, str]) -> list[dict[str, Any]]:
    """Where the run keeps its caches (on the shared storage, so every node builds or reads them once),
    NCCL's NVLink multicast off, the extra ones, and credentials from the Secret where it has them."""
    storage = cfg.cluster.shared_storage
    plain = {
        **({"RLEXP_CACHE": f"{storage}/.cache/rlexp", "HF_HOME": f"{storage}/.cache/huggingface"} if storage else {}),
        "NCCL_NVLS_ENABLE": "0",
        **extra,
    }
    env: list[dict[str, Any]] = [{"name": key, "value": value} for key, value in plain.items()]
    env += [
        {"name": key, "valueFrom": {"secretKeyRef": {"name": SECRET_NAME, "key": key, "optional": True}}}
        for key in SECRET_KEYS
    ]
    return env


def to_yaml(*documents: dict[str, Any] | None) -> str:
    """The documents (None ones left out) as one multi-document YAML file."""
    return yaml.safe_dump_all([d for d in documents if d is not None], sort_keys=False)
