#!/usr/bin/env bash
# Two "hosts" on one machine, for tests/test_dist.c (two_hosts_over_tcp_equal_one_host) and for trying a
# multi-host launch without a cluster: runs
#   mpirun -np 2 --hostfile H --mca btl tcp,self --mca btl_tcp_if_include 10.77.0.0/24 ... ARGS
# with rank 0 on host amphost0 (10.77.0.1) and rank 1 on amphost1 (10.77.0.2): two network namespaces joined by
# a veth pair, each with its own host name (a UTS namespace). mpirun starts the second host's Open MPI daemon
# through its rsh launcher, as it would over ssh (plm_rsh_agent is this script), so the ranks meet as they do
# between machines: the daemons over TCP (oob_tcp_if_include), the ranks' messages over TCP on the veth link, no
# shared memory. Everything lives in private network and UTS namespaces that end with the run (no named namespace
# under /run/netns); the machine's own network is not touched.
#   tests/two_hosts.sh AMPTRAIN ARGS...     (from the directory the ranks should run in)
# Prints mpirun's output, then "link: N bytes from amphost0 to amphost1, M back" (the veth link's counters).
# Exit status: mpirun's; 77 where the namespaces cannot be made (not root, no unshare or ip, a container that
# forbids them), with the reason on stderr.
# Needs: root, util-linux (unshare, nsenter), iproute2, Open MPI (mpirun, orted).
set -u
here=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
skip() { echo "two_hosts: cannot simulate two hosts here: $*" >&2; exit 77; }

case ${1:-} in
--agent) # as Open MPI's rsh agent: "--agent HOST CMD..." runs CMD on the second host through a shell, as ssh does
  [ "$2" = amphost1 ] || { echo "two_hosts: no host '$2' here (amphost1 only)" >&2; exit 255; }
  shift 2
  exec nsenter --target "$TWO_HOSTS_PID" --net --uts sh -c "$*" ;;
--inside) # in the private namespaces: this is amphost0; make amphost1 and the link, launch
  shift
  hostname amphost0 && ip link set lo up || skip "cannot name the host or bring loopback up"
  # amphost1's namespaces, held by this process until the launch is over (then by orted and the ranks in them); it
  # ends by itself should this script be killed before its trap runs
  unshare --net --uts sleep 600 &
  TWO_HOSTS_PID=$!
  export TWO_HOSTS_PID
  trap 'kill "$TWO_HOSTS_PID" 2> /dev/null' EXIT
  for _ in $(seq 100); do # until the sleeper is in its own network namespace
    [ "$(readlink "/proc/$TWO_HOSTS_PID/ns/net")" != "$(readlink /proc/self/ns/net)" ] && break
    sleep 0.05
  done
  on1() { nsenter --target "$TWO_HOSTS_PID" --net --uts "$@"; }
  on1 hostname amphost1 && on1 ip link set lo up || skip "cannot make the second host's namespaces"
  err=$(ip link add veth0 type veth peer name veth1 netns "$TWO_HOSTS_PID" 2>&1) || skip "veth: $err"
  ip addr add 10.77.0.1/24 dev veth0 && ip link set veth0 up &&
    on1 ip addr add 10.77.0.2/24 dev veth1 && on1 ip link set veth1 up || skip "cannot configure the veth link"
  hosts=$(mktemp) || exit 1
  printf 'amphost0 slots=1\namphost1 slots=1\n' > "$hosts"
  mpirun --allow-run-as-root -np 2 --hostfile "$hosts" --mca plm_rsh_agent "$here --agent" --oversubscribe --bind-to none \
    --mca btl tcp,self --mca btl_tcp_if_include 10.77.0.0/24 --mca oob_tcp_if_include 10.77.0.0/24 \
    -x OPENBLAS_NUM_THREADS "$@"
  rc=$?
  rm -f "$hosts"
  # /proc/net/dev is this network namespace's: veth0's received and sent bytes
  awk '$1 == "veth0:" { printf "link: %d bytes from amphost0 to amphost1, %d back\n", $10, $2 }' /proc/net/dev
  exit $rc ;;
esac

[ "$(id -u)" = 0 ] || skip "not root (network namespaces need it)"
for tool in unshare nsenter ip mpirun; do
  command -v $tool > /dev/null || skip "no $tool (util-linux, iproute2, Open MPI)"
done
unshare --net --uts true 2> /dev/null || skip "unshare --net --uts is not allowed (a container?)"
exec unshare --net --uts "$here" --inside "$@"
