#!/usr/bin/env bash
# Device-side checks after staging (see docs/performance.md): GPU tests, the TorchRec A/B demo on the
# GPU, a stage profile. (The plugin's CPU tests run in CI: the image's Triton 3.6 interpreter cannot run
# loops bounded by loaded scalars with its NumPy, docs/torchrec.md.)
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,driver_version --format=csv,noheader
python -c "import torch, triton, fbgemm_gpu, torchrec; print(torch.__version__, triton.__version__, fbgemm_gpu.__version__, torchrec.__version__)"
echo "== tests/gpu"; timeout 240 python -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tee $OUT/tests_gpu.txt | tail -15
echo "== demo (GPU)"; timeout 150 python -m torchrec_triton_tbe.torchrec_demo --steps 10 > $OUT/demo.txt 2>&1; echo "rc=$?"; tail -20 $OUT/demo.txt
for s in uniform zipf default; do echo "== profile $s"; timeout 120 python tools/profile_stages.py --shape $s --json $OUT/prof_$s.json 2>&1 | grep -v "compat\|^ *$\|\[0m\|\[33m\|WARNING:root" | tail -16; done
