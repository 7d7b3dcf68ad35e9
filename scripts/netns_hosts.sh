#!/usr/bin/env bash
# Runs one command per "host" in its own network namespace, the hosts joined by veth pairs to a
# bridge, to test multi-host behaviour on one machine. Needs root and iproute2 (tc for --rate
# and --delay).
#
#   scripts/netns_hosts.sh [--hosts N] [--rate 1gbit] [--delay 1ms] [--cpus C] [--timeout S]
#                          -- CMD [ARGS]
#
# Host i (0-based) gets address 198.18.0.<i+1>/24 (198.18.0.0/15 is reserved for network
# benchmarking) on interface eth0 of namespace cv<pid>h<i>. CMD runs once per host, inside that
# host's namespace, with HOST_INDEX=i, HOSTS=N and HOST_ADDRS="198.18.0.1 ..." in its
# environment; its output goes to the terminal prefixed by nothing, so redirect per host in CMD
# (e.g. `bash -c '... >log.$HOST_INDEX 2>&1'`). --rate (tc units: 100mbit, 1gbit) limits each
# host's link in both directions with a token bucket (tbf) on the host's end and on the
# bridge's end of its veth pair, so a host that many others send to (a parameter server)
# receives at --rate in total, as through one real NIC. --delay adds one-way latency on the
# host's egress with netem, which some kernels lack (then the script stops with tc's error).
# --cpus C (a decimal such as 0.5 or 2) gives each host a CPU share of C cores (a cgroup CPU
# quota, v1 or v2), so hosts do not take each other's cores: the compute/communication balance
# is what a cluster with C cores per host would see, as long as hosts x C fits this machine.
# Every command is killed after --timeout seconds (default 300).
#
# Exit status: 0 when every host's command exited 0, else the first non-zero status (124 on
# timeout); 77 when this machine cannot make namespaces (not root, no `ip netns`) or, with
# --cpus, has no writable cpu cgroup controller. The namespaces, links, bridge and cgroups are
# removed on every exit path, including Ctrl-C.
set -euo pipefail

hosts=2
rate=""
delay=""
cpus=""
timeout_s=300
while [[ $# -gt 0 ]]; do
  case "$1" in
    --hosts) hosts="$2"; shift 2 ;;
    --rate) rate="$2"; shift 2 ;;
    --delay) delay="$2"; shift 2 ;;
    --cpus) cpus="$2"; shift 2 ;;
    --timeout) timeout_s="$2"; shift 2 ;;
    --) shift; break ;;
    *) echo "netns_hosts.sh: unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
  esac
done
if [[ $# -eq 0 ]]; then
  echo "netns_hosts.sh: no command given after --" >&2
  exit 2
fi
if ! [[ "$hosts" =~ ^[0-9]+$ ]] || (( hosts < 1 || hosts > 200 )); then
  echo "netns_hosts.sh: --hosts must be 1..200, got $hosts" >&2
  exit 2
fi
if [[ -n "$cpus" ]] && { ! [[ "$cpus" =~ ^[0-9]+(\.[0-9]+)?$ ]] ||
                         awk -v c="$cpus" 'BEGIN { exit !(c < 0.01) }'; }; then
  echo "netns_hosts.sh: --cpus must be a number of cores of at least 0.01, such as 0.5 or 2," \
       "got $cpus" >&2
  exit 2
fi
tag="cv$$"
# `ip netns list` works unprivileged; only adding one proves we may (CAP_SYS_ADMIN).
if [[ $(id -u) -ne 0 ]] || ! command -v ip >/dev/null ||
   ! ip netns add "${tag}probe" 2>/dev/null; then
  echo "netns_hosts.sh: skipped: needs root and iproute2 (ip netns add failed)" >&2
  exit 77
fi
ip netns del "${tag}probe"

# --cpus: the cgroup directory each host's command joins (cgroup v2's cpu.max, or v1's cpu
# controller with cfs quota), made below; "" without --cpus.
cg_root=""
cg_kind=""
if [[ -n "$cpus" ]]; then
  if [[ -f /sys/fs/cgroup/cgroup.controllers ]] &&
     grep -qw cpu /sys/fs/cgroup/cgroup.controllers &&
     { grep -qw cpu /sys/fs/cgroup/cgroup.subtree_control ||
       echo +cpu >/sys/fs/cgroup/cgroup.subtree_control; } 2>/dev/null; then
    cg_root=/sys/fs/cgroup
    cg_kind=v2
  elif [[ -w /sys/fs/cgroup/cpu/tasks ]] && [[ -f /sys/fs/cgroup/cpu/cpu.cfs_quota_us ]]; then
    cg_root=/sys/fs/cgroup/cpu
    cg_kind=v1
  fi
  # Writable only if a cgroup can be made there (read-only in some containers).
  if [[ -n "$cg_root" ]] && mkdir "$cg_root/${tag}probe" 2>/dev/null; then
    rmdir "$cg_root/${tag}probe"
  else
    echo "netns_hosts.sh: skipped: --cpus needs a writable cpu cgroup controller" >&2
    exit 77
  fi
fi
# CPU quota in microseconds per 100 ms period for --cpus.
cpu_quota() { awk -v c="$cpus" 'BEGIN { printf "%d", c * 100000 }'; }

# tbf burst in bytes for a tc rate like 300mbit: max(64 KiB, 4 ms of traffic).
tbf_burst() {
  local r="${1,,}" bits
  case "$r" in
    *gbit) bits=$(( ${r%gbit} * 1000000000 )) ;;
    *mbit) bits=$(( ${r%mbit} * 1000000 )) ;;
    *kbit) bits=$(( ${r%kbit} * 1000 )) ;;
    *) echo "netns_hosts.sh: --rate $1: use kbit, mbit or gbit (integer)" >&2; exit 2 ;;
  esac
  local b=$(( bits / 8 / 250 ))
  (( b < 65536 )) && b=65536
  echo "$b"
}
[[ -n "$rate" ]] && tbf_burst "$rate" >/dev/null

hub="${tag}hub"
addrs=""
for ((i = 0; i < hosts; i++)); do addrs+="198.18.0.$((i + 1)) "; done
addrs="${addrs% }"
pids=()

cleanup() {
  for p in "${pids[@]:-}"; do
    [[ -n "$p" ]] && kill -KILL "$p" 2>/dev/null || true
  done
  for ((i = 0; i < hosts; i++)); do
    # Killing what still runs inside before the namespace goes.
    for p in $(ip netns pids "${tag}h$i" 2>/dev/null); do kill -KILL "$p" 2>/dev/null || true; done
    ip netns del "${tag}h$i" 2>/dev/null || true
    if [[ -n "$cg_root" && -d "$cg_root/${tag}h$i" ]]; then  # empty once the killed exit
      for ((t = 0; t < 50; t++)); do
        rmdir "$cg_root/${tag}h$i" 2>/dev/null && break
        sleep 0.1
      done
    fi
  done
  ip netns del "$hub" 2>/dev/null || true
}
trap cleanup EXIT
trap 'exit 130' INT TERM

ip netns add "$hub"
ip -n "$hub" link add br0 type bridge
ip -n "$hub" link set br0 up
for ((i = 0; i < hosts; i++)); do
  ns="${tag}h$i"
  ip netns add "$ns"
  # Both ends born inside their namespaces: nothing is left in the root namespace if we stop.
  ip link add "${tag}a$i" netns "$ns" type veth peer name "${tag}b$i" netns "$hub"
  ip -n "$ns" link set "${tag}a$i" name eth0
  ip -n "$ns" addr add "198.18.0.$((i + 1))/24" dev eth0
  ip -n "$ns" link set eth0 up
  ip -n "$ns" link set lo up
  ip -n "$hub" link set "${tag}b$i" master br0
  ip -n "$hub" link set "${tag}b$i" up
  if [[ -n "$rate" ]]; then
    # Burst: a 64 KiB segment (veth passes TSO-sized packets) or 4 ms at the rate; queue: 100 ms.
    tbf=(tbf rate "$rate" burst "$(tbf_burst "$rate")" latency 100ms)
    if [[ -n "$delay" ]]; then
      ip netns exec "$ns" tc qdisc add dev eth0 root handle 1: netem delay "$delay"
      ip netns exec "$ns" tc qdisc add dev eth0 parent 1:1 handle 10: "${tbf[@]}"
    else
      ip netns exec "$ns" tc qdisc add dev eth0 root "${tbf[@]}"
    fi
    ip netns exec "$hub" tc qdisc add dev "${tag}b$i" root "${tbf[@]}"
  elif [[ -n "$delay" ]]; then
    ip netns exec "$ns" tc qdisc add dev eth0 root netem delay "$delay"
  fi
done

for ((i = 0; i < hosts; i++)); do
  join=()
  if [[ -n "$cg_root" ]]; then
    cg="$cg_root/${tag}h$i"
    mkdir "$cg"
    if [[ "$cg_kind" == v2 ]]; then
      echo "$(cpu_quota) 100000" >"$cg/cpu.max"
    else
      echo 100000 >"$cg/cpu.cfs_period_us"
      cpu_quota >"$cg/cpu.cfs_quota_us"
    fi
    # The host's command and everything it starts run in its cgroup.
    join=(bash -c 'echo $$ >"$0/cgroup.procs" && exec "$@"' "$cg")
  fi
  HOST_INDEX=$i HOSTS=$hosts HOST_ADDRS="$addrs" \
    timeout --kill-after=5 "$timeout_s" ${join[@]+"${join[@]}"} ip netns exec "${tag}h$i" "$@" &
  pids+=($!)
done
status=0
for p in "${pids[@]}"; do
  if wait "$p"; then :; else
    rc=$?
    [[ $status -eq 0 ]] && status=$rc
  fi
done
pids=()
exit $status
