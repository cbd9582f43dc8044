#!/bin/bash
# The GPU session's prepared run (issue 43): `pytest -m cuda` and the language-model benchmark's five loops on
# the GPU, one script, under 12 minutes. From the repo root on a GPU machine (torch preinstalled, no registry):
#   OUT=dir bash benchmarks/gpu_run.sh
# Every step is under `timeout`: worst case 30 + 60 + 240 + 360 s = 11.5 min. Output in $OUT (default ./gpu_out):
# summary.txt, a log per step, and benchmarks/results/gpu.md (device, torch and CUDA versions, date, table, line)
# copied there. Peers that are not installed (accelerate, lightning) are reported as skipped rows.
O=${OUT:-./gpu_out}; mkdir -p "$O"; P=${PY:-python}
export PYTHONUNBUFFERED=1
t(){ n=$1; s=$2; shift 2; echo "== $n (<=${s}s): $*" >>"$O/summary.txt"
 timeout -k 2 "$s" "$@" >"$O/$n.log" 2>&1; echo "   rc=$?" >>"$O/summary.txt"; tail -n 12 "$O/$n.log" | sed 's/^/   /' >>"$O/summary.txt"; }
t env 30 $P -c "import torch as T;print(T.__version__,T.version.cuda,T.cuda.get_device_name(0),'bf16',T.cuda.is_bf16_supported())"
t install 60 $P -m pip install --no-deps --no-build-isolation --no-index -e .
$P -c "import speedups" 2>/dev/null || export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
t pytest_cuda 240 $P -m pytest -m cuda -q -p no:cacheprovider -rA tests
t language_model 360 $P -m benchmarks.language_model --device cuda --reps 3
cp benchmarks/results/gpu.md "$O/" 2>/dev/null
echo "finished $(date)" >>"$O/summary.txt"; cat "$O/summary.txt"
