# rlexp on a GPU cluster: the image every Ray pod runs (KubeRay head and workers; `rlexp task=manifest`
# writes manifests that use it). Build and push:
#   docker build -t <registry>/rlexp:0.1.0 .
#   docker push <registry>/rlexp:0.1.0
# Pinned so that vLLM, torch and Ray resolve together: vLLM 0.22.1 pins torch 2.11.0 and torchvision 0.26.0.
# No credentials are baked in: pods get them from the Kubernetes Secret rlexp-secrets at run time.
FROM nvidia/cuda:13.0.0-runtime-ubuntu24.04

ARG PYTHON=python3.12
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VLLM_USE_FLASHINFER_SAMPLER=0 \
    NCCL_NVLS_ENABLE=0

# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.12 python3.12-venv python3.12-dev git ca-certificates \
    && rm -rf /var/lib/apt/lists/*

RUN ${PYTHON} -m venv /opt/rlexp
ENV PATH=/opt/rlexp/bin:$PATH

WORKDIR /opt/rlexp/src
# dependencies first, so that a code change does not re-install them
COPY pyproject.toml README.md ./
RUN pip install \
        torch==2.11.0 torchvision==0.26.0 vllm==0.22.1 "ray[default]==2.60.0" \
        hydra-core==1.3.8 omegaconf==2.3.1 transformers==5.17.0 peft==0.21.2 \
        mlflow==3.17.2 wandb==0.31.0 gymnasium==1.4.0

COPY rlexp ./rlexp
# rlexp itself, with its extras; every dependency they need is pinned above
# hadolint ignore=DL3013
RUN pip install '.[vllm,ray]' && rlexp --cfg job > /dev/null

# a Ray pod's shell starts here; the run dirs live on the shared storage (/shared), not in the image
WORKDIR /workspace
CMD ["rlexp"]
