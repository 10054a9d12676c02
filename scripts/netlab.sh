#!/usr/bin/env bash
# A shaped link between two "hosts" on one machine: network namespaces prefill and decode joined by a veth pair,
# shaped with tbf at a given rate on both ends, for running engines whose KV WRITE takes as long as on a network.
#
#   scripts/netlab.sh check                         can namespaces be made here? (exit 0, or 3 and why)
#   scripts/netlab.sh up [--rate 5gbit] [--id ID]   make a lab; prints its NETLAB_* variables (shell syntax)
#   scripts/netlab.sh exec ID prefill|decode CMD..  run CMD in that namespace, UCX on its veth (UCX_TLS=tcp)
#   scripts/netlab.sh down ID                       remove the lab ID: its processes, namespaces, links, qdiscs
#   scripts/netlab.sh run [--rate R] [--id ID] -- CMD..   up, CMD in the decode namespace, down (also on Ctrl-C)
#
# What a lab is (ID: 6 hex digits, random unless given, so parallel labs never collide):
#   namespaces kvl-ID-p (prefill) and kvl-ID-d (decode), each with `lo` up and one end of the veth pair
#   kvlIDp <-> kvlIDd (no IPv6 on it) holding 169.254.77.1/30 (prefill) and 169.254.77.2/30 (decode), the lab's
#   addresses for everything but UCX. No default route, no NAT, no other interface: nothing inside reaches any other
#   network (connecting elsewhere fails at once: "Network is unreachable"). Both ends' egress go through
#   `tbf rate RATE` (RATE as tc writes it: 1gbit, 5gbit, 25gbit; burst max(256 KiB, 1 ms of RATE), latency 10 ms).
#   netem does not exist on this kernel: no added delay.
#   UCX ignores link-local addresses (its TCP transport skips 169.254/16 when it lists devices; no setting changes
#   that), so each veth end also holds 198.18.77.1/30 or 198.18.77.2/30, from RFC 2544's range for benchmarking
#   networks (never routed on the internet): UCX's TCP connections use those, on the same veth, through the same tbf.
# Where the services live is the caller's choice; the benchmark (benchmarks/bench_link.py) runs the rendezvous
# service (bound to 169.254.77.2, which both engines reach), the router and the load in the decode namespace.
#
# `up` and `run` refuse with exit code 3 and a message, having made nothing, where namespaces, veth pairs or tbf
# cannot be made (not root, no CAP_NET_ADMIN/CAP_SYS_ADMIN, no tbf): `check` tries them in a throwaway namespace
# first. An `up` that fails half-way (or is interrupted) removes what it made before it exits, and only that.
# Interrupted (SIGINT, SIGTERM), `up` and `run` clean up first, then die of the signal (a shell's $? is 130, 143).
# `down` is idempotent: it stops the processes left in the lab's namespaces (SIGTERM, SIGKILL after 10 s), then
# deletes the namespaces, which deletes the veth pair and its qdiscs.
# NETLAB_FAIL_AT=STEP makes `up` fail after STEP (ns-prefill, ns-decode, veth, moved, addresses, qdisc-prefill):
# the tests' way to check the clean-up of a half-made lab.
set -euo pipefail

PREFIX=kvl
PREFILL_ADDR=169.254.77.1
DECODE_ADDR=169.254.77.2
PREFILL_UCX_ADDR=198.18.77.1
DECODE_UCX_ADDR=198.18.77.2
PREFIX_LEN=30
TBF_LATENCY=10ms
MIN_BURST=262144
STOP_WAIT_S=10
EXIT_REFUSED=3
EXIT_USAGE=2

usage() {
  sed -n '5,9p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit "$EXIT_USAGE"
}

fail() {  # message, exit code
  echo "netlab: $1" >&2
  exit "${2:-1}"
}

names() {  # ID -> the lab's names
  [[ $1 =~ ^[0-9a-f]{6}$ ]] || fail "bad lab id '$1' (6 hex digits)" "$EXIT_USAGE"
  ID=$1
  NS_PREFILL=$PREFIX-$ID-p
  NS_DECODE=$PREFIX-$ID-d
  DEV_PREFILL=$PREFIX${ID}p
  DEV_DECODE=$PREFIX${ID}d
}

burst_for() {  # RATE (e.g. 5gbit) -> tbf burst in bytes: 1 ms of traffic, at least MIN_BURST
  [[ $1 =~ ^([1-9][0-9]{0,5})(k|m|g)bit$ ]] || fail "bad rate '$1' (e.g. 1gbit, 5gbit, 25gbit, 500mbit)" "$EXIT_USAGE"
  local scale
  case ${BASH_REMATCH[2]} in k) scale=1000 ;; m) scale=1000000 ;; g) scale=1000000000 ;; esac
  local bytes=$((BASH_REMATCH[1] * scale / 8 / 1000))
  echo $((bytes > MIN_BURST ? bytes : MIN_BURST))
}

# Can this process make namespaces, veth pairs and tbf qdiscs? Tried inside a throwaway namespace (gone when
# `unshare` exits), so a refusal leaves nothing behind. Prints why not.
probe() {
  [ "$(id -u)" -eq 0 ] || { echo "not root (uid $(id -u)): network namespaces need root"; return 1; }
  local tool
  for tool in ip tc unshare; do
    command -v "$tool" >/dev/null || { echo "$tool is not installed"; return 1; }
  done
  local out
  if ! out=$(unshare --net sh -c "ip link add probe0 type veth peer name probe1 && \
      tc qdisc add dev probe0 root tbf rate 1gbit burst $MIN_BURST latency $TBF_LATENCY" 2>&1); then
    echo "cannot make a namespace with a veth pair and a tbf qdisc (CAP_SYS_ADMIN and CAP_NET_ADMIN needed): $out"
    return 1
  fi
  mkdir -p /run/netns 2>/dev/null && [ -w /run/netns ] || { echo "/run/netns is not writable"; return 1; }
}

check_or_refuse() {
  local why
  why=$(probe) || fail "refusing: $why" "$EXIT_REFUSED"
}

stop_processes() {  # NS: SIGTERM what runs in it, SIGKILL what is left after STOP_WAIT_S
  local ns=$1 pids i
  pids=$(ip netns pids "$ns" 2>/dev/null || true)
  [ -n "$pids" ] || return 0
  kill -TERM $pids 2>/dev/null || true
  for ((i = 0; i < STOP_WAIT_S * 10; i++)); do
    pids=$(ip netns pids "$ns" 2>/dev/null || true)
    [ -n "$pids" ] || return 0
    sleep 0.1
  done
  kill -KILL $pids 2>/dev/null || true
}

remove_ns() {  # NS, if it exists
  ip netns list | awk '{print $1}' | grep -qxF "$1" || return 0
  stop_processes "$1"
  ip netns delete "$1"
}

remove_root_link() {  # DEV, if it is still in this namespace (made, not yet moved)
  ip link show "$1" >/dev/null 2>&1 || return 0
  ip link delete "$1"
}

cmd_check() {
  local why
  if why=$(probe); then
    echo "netlab: namespaces, veth pairs and tbf work here"
  else
    fail "cannot run here: $why" "$EXIT_REFUSED"
  fi
}

cmd_down() {
  [ $# -eq 1 ] || usage
  names "$1"
  remove_ns "$NS_PREFILL"
  remove_ns "$NS_DECODE"
  remove_root_link "$DEV_PREFILL"
  remove_root_link "$DEV_DECODE"
}

CHILD=""  # run: the command's process

# SIGINT and SIGTERM end the script through its EXIT trap (the clean-up); then it dies of that signal, as an
# interrupted program should, so that its caller knows (a shell's $? is 130 or 143).
SIGNALLED=""
trap_signals() {
  trap 'SIGNALLED=INT; exit 130' INT
  trap 'SIGNALLED=TERM; exit 143' TERM
}
die_of_signal() {  # last in an EXIT trap
  [ -z "$SIGNALLED" ] || { trap - EXIT "$SIGNALLED"; kill -s "$SIGNALLED" $$; }
}

# What this `up` made, removed again if it does not finish.
MADE_NS=()
MADE_LINKS=()
undo_up() {
  local ns dev
  for dev in "${MADE_LINKS[@]}"; do remove_root_link "$dev" || true; done
  for ns in "${MADE_NS[@]}"; do remove_ns "$ns" || true; done
}

step() {  # STEP: done; fail here if NETLAB_FAIL_AT says so
  [ "${NETLAB_FAIL_AT:-}" != "$1" ] || fail "failing after step $1 (NETLAB_FAIL_AT)"
}

in_ns() { ip netns exec "$@"; }

up_namespace() {  # NS
  ip netns add "$1"
  MADE_NS+=("$1")
  # No IPv6 on the veth (lo keeps ::1): no fe80:: address, no router solicitation; IPv4 link-local only.
  in_ns "$1" sysctl -qw net.ipv6.conf.default.disable_ipv6=1 2>/dev/null || true
  ip -n "$1" link set lo up
}

parse_up_args() {
  RATE=5gbit
  ID=""
  while [ $# -gt 0 ]; do
    case $1 in
      --rate) [ $# -ge 2 ] || usage; RATE=$2; shift 2 ;;
      --id) [ $# -ge 2 ] || usage; ID=$2; shift 2 ;;
      --) shift; break ;;
      *) usage ;;
    esac
  done
  REST=("$@")
  BURST=$(burst_for "$RATE")
  names "${ID:-$(od -An -N3 -tx1 /dev/urandom | tr -d ' \n')}"
}

make_lab() {  # after parse_up_args; undo_up must be armed by the caller
  up_namespace "$NS_PREFILL"
  step ns-prefill
  up_namespace "$NS_DECODE"
  step ns-decode
  ip link add "$DEV_PREFILL" type veth peer name "$DEV_DECODE"
  MADE_LINKS+=("$DEV_PREFILL" "$DEV_DECODE")
  step veth
  ip link set "$DEV_PREFILL" netns "$NS_PREFILL"
  ip link set "$DEV_DECODE" netns "$NS_DECODE"
  MADE_LINKS=()  # they go with their namespaces now
  step moved
  ip -n "$NS_PREFILL" addr add "$PREFILL_ADDR/$PREFIX_LEN" dev "$DEV_PREFILL"
  ip -n "$NS_DECODE" addr add "$DECODE_ADDR/$PREFIX_LEN" dev "$DEV_DECODE"
  ip -n "$NS_PREFILL" addr add "$PREFILL_UCX_ADDR/$PREFIX_LEN" dev "$DEV_PREFILL"
  ip -n "$NS_DECODE" addr add "$DECODE_UCX_ADDR/$PREFIX_LEN" dev "$DEV_DECODE"
  step addresses
  in_ns "$NS_PREFILL" tc qdisc add dev "$DEV_PREFILL" root tbf rate "$RATE" burst "$BURST" latency "$TBF_LATENCY"
  step qdisc-prefill
  in_ns "$NS_DECODE" tc qdisc add dev "$DEV_DECODE" root tbf rate "$RATE" burst "$BURST" latency "$TBF_LATENCY"
  ip -n "$NS_PREFILL" link set "$DEV_PREFILL" up
  ip -n "$NS_DECODE" link set "$DEV_DECODE" up
}

print_lab() {
  [ -z "${RATE:-}" ] || echo "NETLAB_RATE=$RATE"
  cat <<EOF
NETLAB_ID=$ID
NETLAB_PREFILL_NS=$NS_PREFILL
NETLAB_DECODE_NS=$NS_DECODE
NETLAB_PREFILL_DEV=$DEV_PREFILL
NETLAB_DECODE_DEV=$DEV_DECODE
NETLAB_PREFILL_ADDR=$PREFILL_ADDR
NETLAB_DECODE_ADDR=$DECODE_ADDR
EOF
}

up_or_undo() {
  check_or_refuse
  trap 'undo_up; die_of_signal' EXIT
  trap_signals
  make_lab
  trap - EXIT INT TERM
}

cmd_up() {
  parse_up_args "$@"
  [ ${#REST[@]} -eq 0 ] || usage
  up_or_undo
  print_lab
}

lab_env() {  # ROLE -> env assignments for a process on that side
  local dev=$DEV_DECODE
  [ "$1" = prefill ] && dev=$DEV_PREFILL
  print_lab
  echo "UCX_TLS=tcp"
  echo "UCX_NET_DEVICES=$dev"
}

namespace_of() {  # ROLE
  case $1 in
    prefill) echo "$NS_PREFILL" ;;
    decode) echo "$NS_DECODE" ;;
    *) fail "role must be prefill or decode, not '$1'" "$EXIT_USAGE" ;;
  esac
}

cmd_exec() {
  [ $# -ge 3 ] || usage
  names "$1"
  local ns env_lines
  ns=$(namespace_of "$2")
  RATE=""  # not known here (`tc qdisc show` has it): no NETLAB_RATE
  env_lines=$(lab_env "$2")
  shift 2
  mapfile -t assignments <<<"$env_lines"
  exec ip netns exec "$ns" env "${assignments[@]}" "$@"
}

cmd_run() {
  parse_up_args "$@"
  [ ${#REST[@]} -gt 0 ] || usage
  up_or_undo
  # From here the lab exists: whatever ends this script (the command, Ctrl-C, SIGTERM) removes it.
  trap 'status=$?; [ -z "$CHILD" ] || kill -TERM "$CHILD" 2>/dev/null || true; cmd_down "$ID"; die_of_signal
    exit "$status"' EXIT
  trap_signals
  print_lab >&2
  local env_lines
  env_lines=$(lab_env decode)
  mapfile -t assignments <<<"$env_lines"
  ip netns exec "$NS_DECODE" env "${assignments[@]}" "${REST[@]}" &
  CHILD=$!
  wait "$CHILD"
}

[ $# -ge 1 ] || usage
command=$1
shift
case $command in
  check) [ $# -eq 0 ] || usage; cmd_check ;;
  up) cmd_up "$@" ;;
  down) cmd_down "$@" ;;
  exec) cmd_exec "$@" ;;
  run) cmd_run "$@" ;;
  *) usage ;;
esac
