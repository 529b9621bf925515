#!/usr/bin/env bash
# A three-node Ray cluster on ONE machine, for trying disaggregated serving without a cloud:
#   head    : the router's node        resources {"router": 1}
#   prefill : a prefill worker node    resources {"prefill_slot": 2}
#   decode  : a decode worker node     resources {"decode_slot": 2}
# The resource names are router/cluster/placement.py's PREFILL_RESOURCE / DECODE_RESOURCE.
#
# Usage:  deploy/ray/local_multinode.sh up [--netns] | down | status
#   up     start the three nodes (about 10 s, about 0.7 GB each); prints RAY_ADDRESS=...
#   up --netns  the same three nodes as three simulated HOSTS: Linux network namespaces on a
#          private bridge, each with its own IP (10.231.N.1-3), so KV really crosses a
#          network between hosts (needs root and iproute2; python -m bench.cluster.simhosts does it).
#          Run the router on the head host:  ip netns exec <head netns> pdcluster serve ...
#   down   stop exactly the processes of this cluster (never a blanket `ray stop`/`pkill`);
#          with --netns: every process inside its namespaces, then the namespaces
#   status print the address and the PIDs of this cluster; exit 1 if it is not running
# Then:   pdcluster serve --ray-address 127.0.0.2:6390 --prefill-workers 2 --decode-workers 2
#
# Environment knobs (defaults in brackets):
#   PDC_RAY_IP [127.0.0.2]    loopback address every node advertises and the GCS listens on.
#                             Not 127.0.0.1: Ray on Linux rewrites "127.0.0.1"/"localhost"
#                             to the machine's routable address (for --node-ip-address and
#                             for a worker's --address alike); any other 127.x.y.z is kept.
#   PDC_RAY_PORT [6390]       GCS port of the head (6379 is left to Redis); the Ray client
#                             server and the dashboard take PORT+1 and PORT+2
#   PDC_RAY_STATE_DIR [/tmp/pdc-ray-<uid>-<port>]  pid file, tag, logs and Ray's temp dir
#                             (kept short: Ray's unix socket paths must stay under 107 bytes)
#   PDC_RAY_CPUS_PER_NODE [2] logical CPUs each node advertises (each worker takes 1)
#   PDC_RAY_BIN               the `ray` executable (default: the repo's .venv, then PATH)
#   PDC_RAY_GRACE_S [10]      seconds `down` waits after SIGTERM before SIGKILL
#   PDC_RAY_AUTH_MODE [disabled]  RAY_AUTH_MODE of the nodes. Ray >= 2.5x turns token auth
#                             on by itself when ~/.ray/auth_token exists (any local
#                             `ray.init()` writes one), and a token rewritten between two
#                             `ray start`s locks the later node out; this cluster listens on
#                             loopback only, so it says what it wants instead of inheriting it.
#
# How `down` finds its processes: every process `up` starts inherits the environment variable
# PDCLUSTER_LOCAL_RAY_TAG=<random tag of this cluster>. Ray's agents rename themselves
# (setproctitle), which can wipe that variable from /proc/PID/environ, so `up` also records
# the whole process tree as "PID STARTTIME" lines, and `down` signals the union of
#   recorded PIDs whose start time still matches (a recycled PID is never touched),
#   live processes carrying the tag (e.g. worker processes forked after `up`),
#   and every live descendant of those.
# Linux only (reads /proc).
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
NODE_IP="${PDC_RAY_IP:-127.0.0.2}"
PORT="${PDC_RAY_PORT:-6390}"
STATE_DIR="${PDC_RAY_STATE_DIR:-/tmp/pdc-ray-$(id -u)-${PORT}}"
TEMP_DIR="${STATE_DIR}/t"
PID_FILE="${STATE_DIR}/pids"
TAG_FILE="${STATE_DIR}/tag"
CPUS="${PDC_RAY_CPUS_PER_NODE:-2}"
GRACE_S="${PDC_RAY_GRACE_S:-10}"
AUTH_MODE="${PDC_RAY_AUTH_MODE:-disabled}"
ADDRESS="${NODE_IP}:${PORT}"
# Object stores are kept small: three nodes share one machine's /dev/shm.
OBJECT_STORE_BYTES=100000000
# A node that cannot reach the GCS retries forever; fail instead.
START_TIMEOUT_S=120

if [[ -n "${PDC_RAY_BIN:-}" ]]; then
  RAY_BIN="${PDC_RAY_BIN}"
elif [[ -x "${REPO_ROOT}/.venv/bin/ray" ]]; then
  RAY_BIN="${REPO_ROOT}/.venv/bin/ray"
else
  RAY_BIN="$(command -v ray || true)"
fi

die() { echo "local_multinode: $*" >&2; exit 1; }

# One line per live (non-zombie) process: "PID PPID STARTTIME" (fields 1, 4 and 22 of
# /proc/PID/stat; the command name in field 2 may hold spaces, so cut after its ')').
proc_table() {
  cat /proc/[0-9]*/stat 2>/dev/null \
    | awk '{pid=$1; sub(/^.*\) /, ""); if ($1 != "Z") print pid, $2, $20}' || true
}

# PIDs of live processes whose environment carries this cluster's tag.
tagged_pids() {
  local f
  for f in $(grep -lzx "PDCLUSTER_LOCAL_RAY_TAG=$1" /proc/[0-9]*/environ 2>/dev/null || true); do
    f="${f#/proc/}"; echo "${f%/environ}"
  done
}

# Every live process of this cluster, one PID a line, sorted.
cluster_pids() {
  local tag="$1" pid ppid start changed=1
  local -A live_start=() parent=() keep=()
  while read -r pid ppid start; do
    live_start[${pid}]="${start}"; parent[${pid}]="${ppid}"
  done < <(proc_table)
  if [[ -f "${PID_FILE}" ]]; then
    while read -r pid start; do
      [[ "${live_start[${pid}]:-}" == "${start}" ]] && keep[${pid}]=1
    done < "${PID_FILE}"
  fi
  for pid in $(tagged_pids "${tag}"); do
    [[ -n "${live_start[${pid}]:-}" ]] && keep[${pid}]=1
  done
  while (( changed )); do
    changed=0
    for pid in "${!parent[@]}"; do
      if [[ -z "${keep[${pid}]:-}" && -n "${keep[${parent[${pid}]}]:-}" ]]; then
        keep[${pid}]=1; changed=1
      fi
    done
  done
  for pid in "${!keep[@]}"; do echo "${pid}"; done | sort -n
}

start_node() {  # start_node NAME TAG [ray start args...]
  local name="$1" tag="$2"; shift 2
  echo "starting ${name} node"
  if ! env PDCLUSTER_LOCAL_RAY_TAG="${tag}" RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE="${AUTH_MODE}" RAY_worker_niceness=0 \
      timeout "${START_TIMEOUT_S}" "${RAY_BIN}" start "$@" > "${STATE_DIR}/${name}.log" 2>&1; then
    tail -n 30 "${STATE_DIR}/${name}.log" >&2
    local log_copy="/tmp/pdc-ray-${name}-$$.log"
    cp "${STATE_DIR}/${name}.log" "${log_copy}"
    cmd_down
    die "${name} node failed to start (log: ${log_copy})"
  fi
}

cmd_up() {
  [[ -n "${RAY_BIN}" && -x "${RAY_BIN}" ]] || die "no 'ray' executable found (set PDC_RAY_BIN)"
  if [[ -f "${TAG_FILE}" ]] && [[ -n "$(cluster_pids "$(cat "${TAG_FILE}")")" ]]; then
    die "a cluster from ${STATE_DIR} is already running; run '$0 down' first"
  fi
  rm -rf "${STATE_DIR}"
  mkdir -p "${TEMP_DIR}"
  local tag
  tag="pdc-$(id -u)-${PORT}-$(od -An -N8 -tx1 /dev/urandom | tr -d ' \n')"
  echo "${tag}" > "${TAG_FILE}"

  local common=(--node-ip-address="${NODE_IP}" --num-cpus="${CPUS}"
                --object-store-memory="${OBJECT_STORE_BYTES}" --disable-usage-stats)
  start_node head "${tag}" --head --port="${PORT}" --temp-dir="${TEMP_DIR}" \
    --ray-client-server-port=$((PORT + 1)) --dashboard-port=$((PORT + 2)) \
    --include-dashboard=false --resources='{"router": 1}' "${common[@]}"
  # Worker nodes take the head's session directory: only the head may set --temp-dir.
  start_node prefill "${tag}" --address="${ADDRESS}" --resources='{"prefill_slot": 2}' "${common[@]}"
  start_node decode "${tag}" --address="${ADDRESS}" --resources='{"decode_slot": 2}' "${common[@]}"

  local pid
  local -A start_of=()
  while read -r pid _ start; do start_of[${pid}]="${start}"; done < <(proc_table)
  for pid in $(cluster_pids "${tag}"); do echo "${pid} ${start_of[${pid}]:-0}"; done > "${PID_FILE}"
  echo "${ADDRESS}" > "${STATE_DIR}/address"
  echo "local Ray cluster up: $(wc -l < "${PID_FILE}") processes (PIDs in ${PID_FILE})"
  echo "RAY_ADDRESS=${ADDRESS}"
  echo "drivers: export RAY_AUTH_MODE=${AUTH_MODE}"
  echo "next: pdcluster serve --ray-address ${ADDRESS} --prefill-workers 2 --decode-workers 2"
}

cmd_down() {
  if [[ ! -f "${TAG_FILE}" ]]; then
    echo "local_multinode: nothing to stop in ${STATE_DIR}"
    return 0
  fi
  local tag pids waited=0
  tag="$(cat "${TAG_FILE}")"
  pids="$(cluster_pids "${tag}" | tr '\n' ' ')"
  if [[ -n "${pids// /}" ]]; then
    echo "stopping PIDs: ${pids}"
    # shellcheck disable=SC2086
    kill -TERM ${pids} 2>/dev/null || true
    while [[ -n "$(cluster_pids "${tag}")" ]] && (( waited < GRACE_S * 2 )); do
      sleep 0.5; waited=$((waited + 1))
    done
    pids="$(cluster_pids "${tag}" | tr '\n' ' ')"
    if [[ -n "${pids// /}" ]]; then
      echo "still running after ${GRACE_S}s, SIGKILL: ${pids}"
      # shellcheck disable=SC2086
      kill -KILL ${pids} 2>/dev/null || true
      sleep 1
    fi
  fi
  pids="$(cluster_pids "${tag}" | tr '\n' ' ')"
  [[ -z "${pids// /}" ]] || die "processes survived SIGKILL: ${pids}"
  rm -rf "${STATE_DIR}"
  echo "local Ray cluster down"
}

cmd_status() {
  [[ -f "${TAG_FILE}" ]] || { echo "not running (no ${TAG_FILE})"; return 1; }
  local pids
  pids="$(cluster_pids "$(cat "${TAG_FILE}")" | tr '\n' ' ')"
  [[ -n "${pids// /}" ]] || { echo "not running (state in ${STATE_DIR} is stale)"; return 1; }
  echo "running at $(cat "${STATE_DIR}/address" 2>/dev/null || echo "${ADDRESS}"); PIDs: ${pids}"
}

# ---- simulated hosts (network namespaces): bench/cluster/simhosts.py owns them ---------------
SIM_STATE="${STATE_DIR}/state.json"

simhosts() {  # simhosts up|down|status
  local py="${PDC_PYTHON:-$(dirname "${RAY_BIN}")/python}"
  [[ -x "${py}" ]] || py="$(command -v python3)"
  (cd "${REPO_ROOT}" && "${py}" -m bench.cluster.simhosts "$1" --state-dir "${STATE_DIR}" \
     --num-cpus "${CPUS}" --hosts "head:router=1" "prefill:prefill_slot=2" "decode:decode_slot=2")
}

cmd_up_netns() {
  [[ -n "${RAY_BIN}" && -x "${RAY_BIN}" ]] || die "no 'ray' executable found (set PDC_RAY_BIN)"
  [[ ! -f "${SIM_STATE}" ]] || die "simulated hosts from ${STATE_DIR} are up; run '$0 down' first"
  simhosts up
  echo "next: ip netns exec <head netns above> pdcluster serve --ray-address <RAY_ADDRESS above> \\"
  echo "        --prefill-workers 2 --decode-workers 2"
}

case "${1:-}" in
  up) if [[ "${2:-}" == "--netns" ]]; then cmd_up_netns; else cmd_up; fi ;;
  down) if [[ -f "${SIM_STATE}" ]]; then simhosts down; else cmd_down; fi ;;
  status) if [[ -f "${SIM_STATE}" ]]; then simhosts status; else cmd_status; fi ;;
  *) echo "usage: $0 up [--netns]|down|status" >&2; exit 2 ;;
esac
