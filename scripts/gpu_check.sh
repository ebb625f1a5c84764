#!/usr/bin/env bash
# `make gpu-check`: what runs ON the GPU machine (issue 23), over a copy of the checkout with
# .gpu-wheels/ beside it (`make gpu-wheels`, run where there is network). No network, no venv,
# no apt, no other make target: the machine's own python3 (torch with CUDA) and the wheels.
#
#   1. install the wheels into .gpu-site (pip --no-index --no-deps --target): ~10 s
#   2. PYTHONPATH=.gpu-site:. ; what python, torch and CUDA are there
#   3. python3 -m pytest -m gpu (the test files that mark gpu tests; not etcd's parameters: the
#      machine has no etcd)                                bounded by GPU_PYTEST_S (150 s)
#   4. python3 -m tsukimi.cli bench gpu --quick --json     bounded by GPU_BENCH_S (270 s)
#   The limits add up to under 600 s (one device call), kills included; a failed import in step 2
#   stops the script there (nothing else could run).
#
# Everything lands in $OUT (./gpu-out when unset), 7 files, each step's status in summary.txt;
# the bench's Markdown is printed last. Exit status: 0 when every step passed. About 8 minutes
# at most. Variables: GPU_PYTHON (python3), GPU_WHEELS (.gpu-wheels), GPU_BENCH_ARGS (--quick;
# set and empty: the full bench), GPU_PYTEST_S, GPU_BENCH_S.
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu-out}"
PY="${GPU_PYTHON:-python3}"
WHEELS="${GPU_WHEELS:-.gpu-wheels}"
mkdir -p "$OUT"
: >"$OUT/summary.txt"
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
export PY WHEELS
failed=0

# step NAME SECONDS COMMAND...: runs COMMAND (a program, or a function below through bash -c)
# bounded by SECONDS (SIGINT first: pytest and the bench stop cleanly and still report), notes
# its status and time in summary.txt; returns COMMAND's status.
step() {
    local name=$1 limit=$2 start rc
    shift 2
    start=$(date +%s)
    timeout --signal=INT --kill-after=30 "$limit" "$@"
    rc=$?
    echo "$name: exit $rc after $(($(date +%s) - start)) s" >>"$OUT/summary.txt"  # NOTE: not stdout: the bench's JSON
    return "$rc"
}

install_wheels() {
    rm -rf .gpu-site
    if ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
        echo "no wheels in $WHEELS: run 'make gpu-wheels' where there is network (imports may fail)"
        return 0
    fi
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target .gpu-site "$WHEELS"/*.whl
}

environment() {
    command -v nvidia-smi >/dev/null && nvidia-smi
    "$PY" -c 'import sys, torch; print(sys.version); print("torch", torch.__version__, "cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")'
    df -h /dev/shm  # NOTE: the PD bench workers each map a 4 GiB segment there
    "$PY" -c 'import tsukimi.cli, tsukimi.testing.deployments, tsukimi.serving.worker.server, tsukimi.store.master.server; print("tsukimi imports: ok")'
}
export -f install_wheels environment

step install 45 bash -c install_wheels >"$OUT/install.log" 2>&1 || failed=1
export PYTHONPATH="$PWD/.gpu-site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ! step environment 45 bash -c environment >"$OUT/environment.txt" 2>&1; then
    cat "$OUT/environment.txt" "$OUT/install.log"
    echo "--- tsukimi does not import here: stopping (see environment.txt, install.log)"
    cat "$OUT/summary.txt"
    exit 1
fi
cat "$OUT/environment.txt"

# NOTE: --continue-on-collection-errors: a test module importing what the machine lacks must not
# hide the gpu tests of every other module (the log names it, and the step fails).
mapfile -t GPU_TESTS < <(grep -rl --include='test_*.py' 'mark.gpu' tests | sort)
step pytest "${GPU_PYTEST_S:-150}" "$PY" -m pytest -m gpu -k "not etcd" -q -p no:cacheprovider \
    --continue-on-collection-errors "${GPU_TESTS[@]}" 2>&1 | tee "$OUT/pytest_gpu.log" | tail -25 || failed=1

# shellcheck disable=SC2086  # GPU_BENCH_ARGS: several words on purpose
step bench "${GPU_BENCH_S:-270}" "$PY" -m tsukimi.cli bench gpu ${GPU_BENCH_ARGS---quick} --json \
    >"$OUT/bench_gpu.json" 2>"$OUT/bench_gpu.log" || failed=1
tail -5 "$OUT/bench_gpu.log"
[ -s "$OUT/bench_gpu.json" ] && "$PY" - "$OUT/bench_gpu.json" >"$OUT/bench_gpu.md" 2>&1 <<'EOF'
import sys
from pathlib import Path

from tsukimi.bench.gpu import VIEWS
from tsukimi.bench.report import BenchReport, render_markdown

print(render_markdown(BenchReport.from_json(Path(sys.argv[1]).read_bytes()), VIEWS))
EOF
[ -s "$OUT/bench_gpu.md" ] && cat "$OUT/bench_gpu.md"
echo "--- summary ($OUT)"
cat "$OUT/summary.txt"
exit "$failed"
