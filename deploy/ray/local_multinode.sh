#!/usr/bin/env bash
# A three-node Ray cluster on ONE machine, for trying disaggregated serving without a cloud:
#   head    : the router's node        resources {"router": 1}
#   prefill : a prefill worker node    resources {"prefill_slot": 2}
#   decode  : a decode worker node     resources {"decode_slot": 2}
# The resource names are router/placement.py's PREFILL_RESOURCE / DECODE_RESOURCE.
#
# Usage:  deploy/ray/local_multinode.sh up | down | status
#   up     start the three nodes (about 10 s, about 0.7 GB each); prints the address
#   down   stop exactly the processes `up` started (never a blanket `ray stop`/`pkill`)
#   status list the processes this cluster owns
# Then:   pdcluster serve --ray-address 127.0.0.1:6390 --prefill-workers 2 --decode-workers 2
#
# Environment knobs (defaults in brackets):
#   PDC_RAY_PORT [6390]       GCS port of the head (6379 is left to Redis); the Ray client
#                             server and the dashboard take PORT+1 and PORT+2
#   PDC_RAY_STATE_DIR [/tmp/pdc-ray-<uid>-<port>]  pid file, tag and Ray's temp dir
#                             (kept short: Ray's unix socket paths must stay under 107 bytes)
#   PDC_RAY_CPUS_PER_NODE [1] logical CPUs each node advertises
#   PDC_RAY_BIN               the `ray` executable (default: the repo's .venv, then PATH)
#   PDC_RAY_GRACE_S [10]      seconds `down` waits after SIGTERM before SIGKILL
#
# How `down` finds its processes: every process `up` starts (GCS, raylets, agents and the
# worker processes raylets fork later) inherits the environment variable
# PDCLUSTER_LOCAL_RAY_TAG=<random tag of this cluster>. `up` records their PIDs; `down`
# signals only PIDs whose /proc/PID/environ still carries that tag, so a recycled PID or
# another user's Ray is never touched.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PORT="${PDC_RAY_PORT:-6390}"
STATE_DIR="${PDC_RAY_STATE_DIR:-/tmp/pdc-ray-$(id -u)-${PORT}}"
TEMP_DIR="${STATE_DIR}/t"
PID_FILE="${STATE_DIR}/pids"
TAG_FILE="${STATE_DIR}/tag"
CPUS="${PDC_RAY_CPUS_PER_NODE:-1}"
GRACE_S="${PDC_RAY_GRACE_S:-10}"
ADDRESS="127.0.0.1:${PORT}"
# Object stores are kept small: three nodes share one machine's /dev/shm.
OBJECT_STORE_BYTES=100000000

if [[ -n "${PDC_RAY_BIN:-}" ]]; then
  RAY_BIN="${PDC_RAY_BIN}"
elif [[ -x "${REPO_ROOT}/.venv/bin/ray" ]]; then
  RAY_BIN="${REPO_ROOT}/.venv/bin/ray"
else
  RAY_BIN="$(command -v ray || true)"
fi

die() { echo "local_multinode: $*" >&2; exit 1; }

# PIDs of live (non-zombie) processes whose environment carries this cluster's tag.
tagged_pids() {
  local tag="$1" f pid
  for f in $(grep -lzx "PDCLUSTER_LOCAL_RAY_TAG=${tag}" /proc/[0-9]*/environ 2>/dev/null || true); do
    pid="${f#/proc/}"; pid="${pid%/environ}"
    # A zombie has already exited; only its parent can reap it.
    if [[ -r "/proc/${pid}/stat" ]] && [[ "$(awk '{print $3}' "/proc/${pid}/stat" 2>/dev/null)" != "Z" ]]; then
      echo "${pid}"
    fi
  done
}

cmd_up() {
  [[ -n "${RAY_BIN}" && -x "${RAY_BIN}" ]] || die "no 'ray' executable found (set PDC_RAY_BIN)"
  if [[ -f "${TAG_FILE}" ]] && [[ -n "$(tagged_pids "$(cat "${TAG_FILE}")")" ]]; then
    die "a cluster from ${STATE_DIR} is already running; run '$0 down' first"
  fi
  rm -rf "${STATE_DIR}"
  mkdir -p "${TEMP_DIR}"
  local tag
  tag="pdc-$(id -u)-${PORT}-$(od -An -N8 -tx1 /dev/urandom | tr -d ' \n')"
  echo "${tag}" > "${TAG_FILE}"

  local common=(--num-cpus="${CPUS}" --object-store-memory="${OBJECT_STORE_BYTES}" --disable-usage-stats)
  # Ray on Linux rewrites 127.0.0.1 to the machine's routable address; with this switch
  # the head advertises loopback instead. Workers cannot take the switch (it forbids
  # joining), so they omit --node-ip-address and Ray derives 127.0.0.1 from the route to
  # the head's loopback address. Every node therefore advertises 127.0.0.1.
  echo "starting head (router) at ${ADDRESS}"
  env PDCLUSTER_LOCAL_RAY_TAG="${tag}" RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_USAGE_STATS_ENABLED=0 \
    "${RAY_BIN}" start --head --node-ip-address=127.0.0.1 --port="${PORT}" \
      --ray-client-server-port=$((PORT + 1)) --dashboard-port=$((PORT + 2)) \
      --include-dashboard=false --temp-dir="${TEMP_DIR}" \
      --resources='{"router": 1}' "${common[@]}" > "${STATE_DIR}/head.log" 2>&1 \
    || { cat "${STATE_DIR}/head.log" >&2; cmd_down; die "head failed to start"; }

  # Worker nodes share the head's session directory; one --temp-dir (the head's) is all Ray allows.
  echo "starting prefill node (prefill_slot: 2)"
  env PDCLUSTER_LOCAL_RAY_TAG="${tag}" RAY_USAGE_STATS_ENABLED=0 \
    "${RAY_BIN}" start --address="${ADDRESS}" \
      --resources='{"prefill_slot": 2}' "${common[@]}" > "${STATE_DIR}/prefill.log" 2>&1 \
    || { cat "${STATE_DIR}/prefill.log" >&2; cmd_down; die "prefill node failed to start"; }

  echo "starting decode node (decode_slot: 2)"
  env PDCLUSTER_LOCAL_RAY_TAG="${tag}" RAY_USAGE_STATS_ENABLED=0 \
    "${RAY_BIN}" start --address="${ADDRESS}" \
      --resources='{"decode_slot": 2}' "${common[@]}" > "${STATE_DIR}/decode.log" 2>&1 \
    || { cat "${STATE_DIR}/decode.log" >&2; cmd_down; die "decode node failed to start"; }

  tagged_pids "${tag}" > "${PID_FILE}"
  echo "${ADDRESS}" > "${STATE_DIR}/address"
  echo "local Ray cluster up: $(wc -l < "${PID_FILE}") processes (PIDs in ${PID_FILE})"
  echo "RAY_ADDRESS=${ADDRESS}"
  echo "next: pdcluster serve --ray-address ${ADDRESS} --prefill-workers 2 --decode-workers 2"
}

cmd_down() {
  if [[ ! -f "${TAG_FILE}" ]]; then
    echo "local_multinode: nothing to stop in ${STATE_DIR}"
    return 0
  fi
  local tag pids
  tag="$(cat "${TAG_FILE}")"
  # Recorded PIDs plus anything forked since (worker processes); both filtered by the tag.
  pids="$(tagged_pids "${tag}" | tr '\n' ' ')"
  if [[ -n "${pids// /}" ]]; then
    echo "stopping PIDs: ${pids}"
    # shellcheck disable=SC2086
    kill -TERM ${pids} 2>/dev/null || true
    local waited=0
    while [[ -n "$(tagged_pids "${tag}")" ]] && (( waited < GRACE_S * 10 )); do
      sleep 0.1; waited=$((waited + 1))
    done
    pids="$(tagged_pids "${tag}" | tr '\n' ' ')"
    if [[ -n "${pids// /}" ]]; then
      echo "still running after ${GRACE_S}s, SIGKILL: ${pids}"
      # shellcheck disable=SC2086
      kill -KILL ${pids} 2>/dev/null || true
      sleep 0.5
    fi
  fi
  [[ -z "$(tagged_pids "${tag}")" ]] || die "some processes survived SIGKILL: $(tagged_pids "${tag}" | tr '\n' ' ')"
  rm -rf "${STATE_DIR}"
  echo "local Ray cluster down"
}

cmd_status() {
  [[ -f "${TAG_FILE}" ]] || { echo "not running (no ${TAG_FILE})"; return 1; }
  local pids
  pids="$(tagged_pids "$(cat "${TAG_FILE}")" | tr '\n' ' ')"
  [[ -n "${pids// /}" ]] || { echo "not running (state dir ${STATE_DIR} is stale)"; return 1; }
  echo "running at $(cat "${STATE_DIR}/address" 2>/dev/null || echo "${ADDRESS}"); PIDs: ${pids}"
}

case "${1:-}" in
  up) cmd_up ;;
  down) cmd_down ;;
  status) cmd_status ;;
  *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac
