#!/usr/bin/env bash
# Run the fast test suite against another torch: a throwaway venv with torch==VERSION (and the torchvision
# built for it), the project installed editable with its test extra, then `pytest -m "not slow"`.
#
#   .ci/check_torch.sh 2.4.1            # the lowest torch pyproject.toml claims
#   .ci/check_torch.sh 2.11.0 -x -q     # extra arguments go to pytest
#
# The venv lives in a temporary folder and is removed at exit (KEEP_VENV=1 keeps it and prints its path).
# Exit status: pytest's (5, nothing collected, counts as failure). Needs the torch wheel from the local
# index or the network; nothing else on the machine changes.
set -euo pipefail
if [[ $# -lt 1 || "$1" == -* ]]; then
    echo "usage: $0 TORCH_VERSION [pytest args...]   e.g. $0 2.4.1" >&2
    exit 2
fi
VERSION="$1"
shift
cd "$(dirname "$0")/.."
VENV="$(mktemp -d "${TMPDIR:-/tmp}/speedups-torch-${VERSION}.XXXXXX")"
if [[ "${KEEP_VENV:-0}" != 1 ]]; then
    trap 'rm -rf "$VENV"' EXIT
fi
PYTHON="${PYTHON:-python3}"
"$PYTHON" -m venv "$VENV"
# The torch pin holds for every later install (torchvision pins its torch, so pip picks the matching one).
PIN="$VENV/torch-pin.txt"
echo "torch==${VERSION}" > "$PIN"
"$VENV/bin/pip" install -q -c "$PIN" "torch==${VERSION}" torchvision
"$VENV/bin/pip" install -q -c "$PIN" -e ".[test]"
echo "+ torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)'), venv $VENV"
set +e
"$VENV/bin/python" -m pytest -m "not slow" -n 2 -q -p no:cacheprovider "$@"
status=$?
set -e
echo "+ .ci/check_torch.sh ${VERSION}: pytest exit status ${status}"
exit "$status"
