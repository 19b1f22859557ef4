#!/usr/bin/env bash
# Downloads into .whl/ (repository root) the wheels the GPU machine lacks, for its Python 3.12 on x86-64 Linux:
# TRL 1.16.0 and datasets with the dependencies that machine's image does not hold (dill, multiprocess), and
# pyzmq. Run it here, where PyPI is reachable; the device tool then carries .whl (`carry: [".whl"]`) and
# benchmarks/gpu/check.sh installs them into /tmp/site. The versions are the ones the project's CPU venv runs.
#
#   bash benchmarks/gpu/wheels.sh                 # about 1.5 MiB
#   WITH_PYARROW=1 bash benchmarks/gpu/wheels.sh  # also pyarrow (~45 MiB), should the machine's be older than 24
set -euo pipefail
cd "$(dirname "$0")/../.."

# The GPU image already has accelerate, pandas, pyarrow, xxhash, fsspec, huggingface-hub, psutil, jinja2, pyyaml
# (device KINDS.md); TRL needs datasets, and datasets needs dill and multiprocess besides those.
WHEELS=(
  trl==1.16.0
  datasets==5.2.0
  dill==0.4.1
  multiprocess==0.70.19
  pyzmq==27.3.0
)
if [[ "${WITH_PYARROW:-0}" == 1 ]]; then
  WHEELS+=(pyarrow==26.0.1)
fi

grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
rm -rf .whl && mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d .whl "${WHEELS[@]}"

# One version of each: two wheels of one name stop the whole install there.
dupes=$(ls .whl | sed -E 's/-[0-9][^-]*-.*//' | sort | uniq -d)
if [[ -n "$dupes" ]]; then
  echo "more than one wheel of: $dupes" >&2
  exit 1
fi
ls -l .whl
du -sh .whl
