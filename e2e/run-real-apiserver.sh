#!/usr/bin/env bash
# Every e2e test against a real kube-apiserver and kube-controller-manager on this machine (no
# Docker, so no kind or k3d): ../shared/k8s-local/ builds the control plane; kubelet stand-ins
# (e2e/kubelet_standin.py) run the chart's and the operator's pods as local processes under the
# chart's own ServiceAccounts. Starts the control plane from an empty etcd, runs pytest on e2e/
# (extra arguments go to pytest: a file, -k ...), and stops the control plane again.
#
#   e2e/run-real-apiserver.sh                        # all of e2e/
#   e2e/run-real-apiserver.sh e2e/test_rbac_real_apiserver.py
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/.."
K8S_LOCAL=${K8S_LOCAL:-$HOME/.cache/k8s-local}
if [ ! -x "$K8S_LOCAL/up.sh" ]; then
  echo "no control plane at $K8S_LOCAL: build it first (../shared/k8s-local/README.md)" >&2
  exit 2
fi
K8S_FRESH=1 "$K8S_LOCAL/up.sh"
trap '"$K8S_LOCAL/down.sh"' EXIT
export KUBECONFIG=$K8S_LOCAL/kubeconfig KVPILOT_E2E_KUBELET=standin
# The engines' model-cache volume: kept between runs, so the bundled model is converted and the
# CPU kernels are compiled once.
export KVPILOT_E2E_MODEL_CACHE=${KVPILOT_E2E_MODEL_CACHE:-$HOME/.cache/kvpilot-e2e/model-cache}
# How long an InferenceService may take to become Ready: on a shared 2-core VM (load average
# 40 to 80) a SmolLM2 replica's engine took 3 to 10 minutes to start beside the autoscaling
# test's load.
export KVPILOT_E2E_TIMEOUT=${KVPILOT_E2E_TIMEOUT:-600}
mkdir -p "$KVPILOT_E2E_MODEL_CACHE"
PYTHON=${PYTHON:-.venv/bin/python}
start=$(date +%s)
status=0
# A base directory of its own (the pods' logs and scratch directories are kept there after the
# run): pytest's default one is rotated by any other pytest run of the same user.
WORK=${KVPILOT_E2E_WORK:-/tmp/kvpilot-e2e-real-apiserver}
"$PYTHON" -m pytest -v -p no:cacheprovider -rA --durations=0 --basetemp="$WORK" "${@:-e2e}" \
  || status=$?
echo "the pods' logs: $WORK/standin0/logs"
echo "e2e on the real API server: $(( $(date +%s) - start )) s, pytest exit status $status"
exit $status
