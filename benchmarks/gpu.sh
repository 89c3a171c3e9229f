#!/usr/bin/env bash
# The GPU figures in one command, for a machine that has jax with CUDA, orbax-checkpoint and
# tensorstore but not zarrckpt's other needs. Carry them as wheels in .whl/ (one version
# each, for that machine's Python), e.g. for Python 3.12:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl zarr numcodecs donfig crc32c google-crc32c msgspec fsspec
# then run `bash benchmarks/gpu.sh [OUT [NAME...]]` from the repository's root: each
# benchmark's output goes to OUT (default: $OUT, else ./gpu-results), each under its own time
# limit. NAMEs pick the runs: async_save, incremental (on tmpfs), incremental_disk (on the
# machine's disk, /var/tmp: issue 36's sync save "to the local disk"), save_restore,
# two_tiers; by default all but incremental_disk, whose limits add up to under ten minutes,
# what one command may hold a lent GPU machine here.
set -uo pipefail
out="${1:-${OUT:-gpu-results}}"
shift $(($# > 0 ? 1 : 0))
picked=("$@")
[ ${#picked[@]} -gt 0 ] || picked=(async_save incremental save_restore two_tiers)
mkdir -p "$out" && out="$(cd "$out" && pwd)"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/zarrckpt-site .whl/*.whl || exit 1
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/zarrckpt-site . || exit 1
export PYTHONPATH=/tmp/zarrckpt-site PYTHONUNBUFFERED=1
here="$PWD/benchmarks"
cd /tmp || exit 1
run() {  # name (of the run and its output), script, seconds, arguments...
  local name=$1 script=$2 limit=$3
  shift 3
  [[ " ${picked[*]} " == *" $name "* ]] || return 0
  echo "== $name: $script $*"
  timeout "$limit" python3 -X faulthandler "$here/$script.py" "$@" 2>&1 | grep -v "libtpu\|cannot create an object only if it is absent" | tee "$out/$name.txt"
}
python3 -c 'import jax, orbax.checkpoint as ocp, zarr; print("jax", jax.__version__, jax.devices(), "orbax", ocp.__version__, "zarr", zarr.__version__)' 2>&1 | tee "$out/versions.txt"
df -h /dev/shm /tmp /var/tmp 2>&1 | tee -a "$out/versions.txt"
# The bare copy to numpy took 8-13 s a round at 8 GiB on an H200: its figures are in README.
run async_save async_save 150 --size-gib 8 --repeats 3 --train-steps 200 --no-bare-copy
# Issue 36's ratios on the devices: how long an async save with reuse blocks training
# against one without, where the copies cross PCIe.
run incremental incremental 110 --targets local --saves 8 --restores 3 --rounds 4
# The same on the machine's disk, where a save without reuse waits for the disk.
run incremental_disk incremental 240 --targets local --saves 8 --restores 3 --rounds 3 --dir /var/tmp
run save_restore save_restore 170 --size-gib 8 --repeats 3 --restore-probe --dir /dev/shm
# A round at 8 GiB is about a minute (three 8.6 s transfers over the 1 GB/s store each way).
run two_tiers two_tiers 140 --size-gib 8 --repeats 1
