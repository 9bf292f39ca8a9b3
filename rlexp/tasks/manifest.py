"""``task=manifest``: the KubeRay manifests for this config's cluster, written to the run dir, then exit.

``raycluster.yaml`` is a long-lived ``RayCluster`` to submit runs and sweeps to (``cluster.launcher=ray``);
``rayjob.yaml`` is a ``RayJob`` that brings up the same cluster, runs exactly this config on it and
deletes it afterwards. Both carry the shared storage's claim (and the claim itself where
``cluster.kuberay.storage_gb`` asks for one). A cluster option without shared storage gets ``/shared``:
pods keep nothing between runs without it.
"""

import re
from pathlib import Path

import yaml
from omegaconf import DictConfig, OmegaConf, open_dict

from rlexp.cluster.manifests import ray_cluster, ray_job, storage_claim, to_yaml
from rlexp.cluster.ray_jobs import job_env_vars, submission
from rlexp.config import validate
from rlexp.runtime import cluster_choice, run_dir_of

#: where pods mount the shared storage when the cluster option names none.
DEFAULT_SHARED_STORAGE = "/shared"


def manifest(cfg: DictConfig) -> list[Path]:
    run_dir = run_dir_of(cfg)
    job = cfg.copy()
    with open_dict(job):
        job.task = "train"
        job.cluster.launcher = "ray"  # what the manifest's job runs: training, its ranks as Ray actors
        if job.cluster.shared_storage is None:
            job.cluster.shared_storage = DEFAULT_SHARED_STORAGE
    validate(job)
    name = _k8s_name(f"rlexp-{cluster_choice()}")
    _, _, payload = submission(job)
    runtime_env = yaml.safe_dump({"env_vars": job_env_vars(job, payload)}, sort_keys=False)
    out = run_dir / "kuberay"
    out.mkdir(parents=True, exist_ok=True)
    claim = storage_claim(job)
    paths = [out / "raycluster.yaml", out / "rayjob.yaml"]
    paths[0].write_text(to_yaml(claim, ray_cluster(job, name)))
    paths[1].write_text(to_yaml(claim, ray_job(job, f"{name}-{_k8s_name(str(cfg.run_name))}"[:63].rstrip("-"), runtime_env)))
    namespace = job.cluster.kuberay.namespace
    print(
        f"wrote {paths[0]} and {paths[1]} ({job.cluster.nodes} x {job.cluster.instance_type or 'nodes'}, "
        f"{job.cluster.gpus_per_node} GPUs each; shared storage {job.cluster.shared_storage} "
        f"from claim {job.cluster.kuberay.storage_claim})\n"
        f"  a cluster to submit to: kubectl apply -f {paths[0]}\n"
        f"    then: kubectl port-forward -n {namespace} svc/{name}-head-svc 8265:8265 and "
        f"rlexp <this command's overrides> cluster.ray.address=http://127.0.0.1:8265\n"
        f"  or this run alone: kubectl apply -f {paths[1]}",
        flush=True,
    )
    return paths


def _k8s_name(text: str) -> str:
    """A DNS-1123 name: lowercase letters, digits and '-'."""
    return re.sub(r"-+", "-", re.sub(r"[^a-z0-9-]", "-", text.lower())).strip("-")[:63]
