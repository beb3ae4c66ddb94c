#!/usr/bin/env bash
# The wheels benchmarks/gpu_check.py needs on the lent GPU machine that its image lacks (Python 3.12, no
# registry there): Liger's kernels, TRL and the datasets it imports (with the pyarrow datasets needs), and the
# versions of peft and fsspec this project pins. Into ./.whl (ignored by git), ~57 MB: with the working tree
# under the 64 MiB a device call carries. Run here, then on the device, in one call that carries .whl:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#     .whl/*.whl && export PYTHONPATH=/tmp/site || exit; PYTHONUNBUFFERED=1 timeout 560 \
#     python3 benchmarks/gpu_check.py --backend hf --no-flow --cases full lora 2>&1 | tee $OUT/gpu_check.log
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  trl==1.16.0 liger-kernel==0.8.5 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 pyarrow==26.0.1 \
  fsspec==2026.9.0 peft==0.21.2
du -sh .whl
