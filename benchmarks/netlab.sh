#!/usr/bin/env bash
# Two "nodes" on one machine: two network namespaces joined by a veth pair rate-limited with
# tc tbf in both directions; loopback inside each namespace plays the fast link inside a node.
# Runs `pipeserve bench ... --nnodes 2` with node 0 in one namespace and node 1 in the other,
# prints node 0's report and the bytes that crossed the link, and removes everything after.
#
#   sudo benchmarks/netlab.sh [options] [--] <pipeserve bench arguments>
#
#   benchmarks/netlab.sh --rate 1gbit -- --pp-size 2 --input-len 8192 --json out.json
#   benchmarks/netlab.sh --layouts 2x1,1x2 -- --input-len 8192 --json out.json
#       (one run per PPxTP layout: out.pp2tp1.json, out.pp1tp2.json, then a summary)
#   benchmarks/netlab.sh --layouts 2x1,pp2cp2 -- --input-len 8192 --json out.json
#       (PP2, then PP2 with two context-parallel ranks per stage: out.pp2tp1cp2.json)
#
# Options (defaults in brackets):
#   --rate RATE       tbf rate each way, tc units [1gbit]
#   --burst SIZE      tbf bucket size, tc units [256kb]
#   --latency TIME    tbf: the longest a packet may wait in the queue [50ms]
#   --addr0 IP        node 0's address on the link (--dist-init-addr) [10.123.0.1]
#   --addr1 IP        node 1's address [10.123.0.2]
#   --prefix N        prefix length of the link's subnet [24]
#   --port PORT       torch.distributed store port on node 0 (and the next T + 2) [29500]
#   --layouts LIST    PPxTP, PPxTPxEP or named ppPtpTepEcpC layouts (each named part
#                     optional, in this order, a left-out one 1) run one after another, e.g.
#                     2x1,1x2,1x1x2,cp2,pp2cp2 (adds --pp-size, --tp-size, --ep-size and
#                     --cp-size, and a .ppPtpT[epE][cpC] suffix to --json/--timeline/--trace)
#   --timeout S       give up on node 0 after S seconds per layout [3600]
#   --grace S         wait this long for node 1 to exit after node 0 is done [60]
# Environment: PIPESERVE (the command; default: this checkout's .venv, then PATH);
#   PIPESERVE_NUM_THREADS (torch threads per node; default: half the cores each).
#   GLOO_SOCKET_IFNAME is dropped: each node picks its veth end by itself.
set -euo pipefail

RATE=1gbit BURST=256kb LATENCY=50ms
ADDR0=10.123.0.1 ADDR1=10.123.0.2 PREFIX=24 PORT=29500
LAYOUTS="" TIMEOUT=3600 GRACE=60
PREFIX_NAME=psnetlab  # namespaces are psnetlab-<pid of this script>-n0 and -n1
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

die() { echo "netlab: $*" >&2; exit 2; }
say() { echo "netlab: $*" >&2; }

usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; }

parse_options() {
    while (($#)); do
        case $1 in
            --rate|--burst|--latency|--addr0|--addr1|--prefix|--port|--layouts|--timeout|--grace)
                (($# >= 2)) || die "$1 needs a value"
                set_option "$1" "$2"
                shift 2 ;;
            -h|--help) usage; exit 0 ;;
            --) shift; break ;;
            *) break ;;
        esac
    done
    BENCH_ARGS=("$@")
}

set_option() {
    case $1 in
        --rate) RATE=$2 ;;
        --burst) BURST=$2 ;;
        --latency) LATENCY=$2 ;;
        --addr0) ADDR0=$2 ;;
        --addr1) ADDR1=$2 ;;
        --prefix) PREFIX=$2 ;;
        --port) PORT=$2 ;;
        --layouts) LAYOUTS=${2//,/ } ;;
        --timeout) TIMEOUT=$2 ;;
        --grace) GRACE=$2 ;;
    esac
}

check_args() {
    local arg
    for arg in "${BENCH_ARGS[@]}"; do
        case $arg in
            --nnodes*|--node-rank*|--dist-init-addr*)
                die "$arg is set by this script; leave it out" ;;
            --pp-size*|--tp-size*|--ep-size*|--cp-size*)
                [[ -z $LAYOUTS ]] || die "$arg and --layouts both give the layout; use one" ;;
        esac
    done
    local pp tp ep cp
    for arg in $LAYOUTS; do
        layout_sizes "$arg" >/dev/null ||
            die "--layouts: $arg is not PPxTP, PPxTPxEP or ppPtpTepEcpC (e.g. 2x1,1x1x2,pp2cp2)"
        read -r pp tp ep cp < <(layout_sizes "$arg")
        ((cp == 1 || (tp == 1 && ep == 1))) ||
            die "--layouts: $arg: context parallelism above 1 needs TP 1 and EP 1"
    done
}

# "PP TP EP CP" of a --layouts item: PPxTP, PPxTPxEP or named ppPtpTepEcpC (parts optional,
# in this order, a left-out size 1); fails on anything else.
layout_sizes() {
    local re='^(pp([0-9]+))?(tp([0-9]+))?(ep([0-9]+))?(cp([0-9]+))?$' pp tp ep
    if [[ $1 =~ ^([0-9]+)x([0-9]+)(x([0-9]+))?$ ]]; then
        echo "${BASH_REMATCH[1]} ${BASH_REMATCH[2]} ${BASH_REMATCH[4]:-1} 1"
    elif [[ -n $1 && $1 =~ $re ]]; then
        pp=${BASH_REMATCH[2]:-1} tp=${BASH_REMATCH[4]:-1} ep=${BASH_REMATCH[6]:-1}
        echo "$pp $tp $ep ${BASH_REMATCH[8]:-1}"
    else
        return 1
    fi
}

check_system() {
    ((EUID == 0)) || die "network namespaces need root: run as root (e.g. sudo $0 ...)"
    local tool
    for tool in ip tc timeout; do
        command -v "$tool" >/dev/null || die "$tool not found (ip and tc: iproute2; timeout: coreutils)"
    done
    if [[ -z ${PIPESERVE:-} ]]; then
        if [[ -x $HERE/../.venv/bin/pipeserve ]]; then
            PIPESERVE=$HERE/../.venv/bin/pipeserve
        else
            PIPESERVE=$(command -v pipeserve) || die "pipeserve not found: set PIPESERVE=/path/to/pipeserve"
        fi
    fi
    command -v "$PIPESERVE" >/dev/null || die "PIPESERVE=$PIPESERVE is not a command"
    local cores
    cores=$(nproc)
    export PIPESERVE_NUM_THREADS=${PIPESERVE_NUM_THREADS:-$((cores > 1 ? cores / 2 : 1))}
    export PYTHONUNBUFFERED=1
    unset GLOO_SOCKET_IFNAME  # a host interface is not in the namespaces; pipeserve picks the veth
}

# Namespaces named after a script that is no longer running are leftovers of a crash.
remove_stale() {
    local ns pid
    for ns in $(ip netns list | awk '{print $1}' | grep -E "^$PREFIX_NAME-[0-9]+-n[01]$" || true); do
        pid=${ns#"$PREFIX_NAME"-}
        pid=${pid%-n*}
        if ! grep -qa netlab "/proc/$pid/cmdline" 2>/dev/null; then  # gone, or pid reused
            say "removing $ns, left by an earlier run (pid $pid) that is gone"
            remove_namespace "$ns"
        fi
    done
}

kill_namespace_procs() {
    local ns=$1 signal=$2 pids
    mapfile -t pids < <(ip netns pids "$ns" 2>/dev/null || true)
    ((${#pids[@]} == 0)) || kill "-$signal" "${pids[@]}" 2>/dev/null || true
}

remove_namespace() {
    local ns=$1 i
    kill_namespace_procs "$ns" TERM
    for i in 1 2 3 4 5 6 7 8 9 10; do
        [[ -n $(ip netns pids "$ns" 2>/dev/null) ]] || break
        sleep 0.5
    done
    kill_namespace_procs "$ns" KILL
    ip netns del "$ns" 2>/dev/null || true  # its veth end goes with it, and so the pair
}

CLEANED=0
cleanup() {
    ((CLEANED)) && return
    CLEANED=1
    local pid
    for pid in $(jobs -p); do kill -TERM "$pid" 2>/dev/null || true; done
    for ns in "${NS[@]}"; do
        remove_namespace "$ns"
        ! ip netns list | grep -qE "^$ns( |$)" || say "could not remove $ns: see 'ip netns list'"
    done
    [[ -z ${TMP:-} ]] || rm -rf "$TMP"
}

setup_link() {
    NS0=$PREFIX_NAME-$$-n0 NS1=$PREFIX_NAME-$$-n1
    NS=()
    local ns
    for ns in "$NS0" "$NS1"; do
        ip netns list | grep -qE "^$ns( |$)" && die "namespace $ns exists already"
        ip netns add "$ns"
        NS+=("$ns")
        ip -n "$ns" link set lo up
    done
    ip link add veth0 netns "$NS0" type veth peer name veth1 netns "$NS1"
    ip -n "$NS0" addr add "$ADDR0/$PREFIX" dev veth0
    ip -n "$NS1" addr add "$ADDR1/$PREFIX" dev veth1
    for i in 0 1; do
        ns=${NS[$i]}
        ip -n "$ns" link set "veth$i" up
        tc -n "$ns" qdisc add dev "veth$i" root tbf rate "$RATE" burst "$BURST" latency "$LATENCY"
    done
    say "$NS0 (node 0, $ADDR0) <-> $NS1 (node 1, $ADDR1): tbf $RATE each way," \
        "burst $BURST, latency $LATENCY; $PIPESERVE_NUM_THREADS thread(s) per node"
}

tx_bytes() {  # bytes sent by node $1 over the link so far
    ip netns exec "${NS[$1]}" cat "/sys/class/net/veth$1/statistics/tx_bytes"
}

# The bench arguments with `.TAG` put before the extension of --json/--timeline/--trace paths.
tagged_args() {
    local tag=$1 arg next=""
    shift
    for arg in "$@"; do
        if [[ -n $next ]]; then
            arg=$(add_tag "$arg" "$tag")
            next=""
        else
            case $arg in
                --json|--timeline|--trace) next=1 ;;
                --json=*|--timeline=*|--trace=*) arg=${arg%%=*}=$(add_tag "${arg#*=}" "$tag") ;;
            esac
        fi
        printf '%s\0' "$arg"
    done
}

add_tag() {
    local path=$1 tag=$2 base=${1##*/}
    if [[ $base == *.* ]]; then echo "${path%.*}.$tag.${path##*.}"; else echo "$path.$tag"; fi
}

json_path() {  # the --json value among the arguments, if any
    local prev="" arg
    for arg in "$@"; do
        [[ $prev == --json ]] && { echo "$arg"; return; }
        [[ $arg == --json=* ]] && { echo "${arg#--json=}"; return; }
        prev=$arg
    done
}

# Node 1 in the background (its output marked), node 0 in the background too so a Ctrl-C
# reaches the trap at once; returns node 0's exit status (or node 1's if it failed first).
run_nodes() {
    local common=(--nnodes 2 --dist-init-addr "$ADDR0:$PORT") pid0 pid1 rc0 rc1
    ip netns exec "$NS1" "$PIPESERVE" bench "$@" "${common[@]}" --node-rank 1 \
        > >(sed -u 's/^/[node 1] /' >&2) 2>&1 &
    pid1=$!
    timeout "$TIMEOUT" ip netns exec "$NS0" "$PIPESERVE" bench "$@" "${common[@]}" --node-rank 0 &
    pid0=$!
    while kill -0 "$pid0" 2>/dev/null; do
        if ! kill -0 "$pid1" 2>/dev/null; then
            rc1=0
            wait "$pid1" || rc1=$?
            if ((rc1)); then
                say "node 1 failed (exit $rc1); stopping node 0"
                kill_namespace_procs "$NS0" TERM
                wait "$pid0" || true
                return "$rc1"
            fi
            pid1=""
            break
        fi
        sleep 0.5
    done
    rc0=0
    wait "$pid0" || rc0=$?
    ((rc0 != 124)) || say "node 0 did not finish within --timeout $TIMEOUT s"
    if [[ -n $pid1 ]] && ((rc0)); then  # node 1's workers would wait for node 0 in vain
        kill_namespace_procs "$NS1" TERM
        wait "$pid1" || true
    elif [[ -n $pid1 ]]; then
        wait_node1 "$pid1" || rc0=1
    fi
    return "$rc0"
}

wait_node1() {
    local pid=$1 i rc=0
    for ((i = 0; i < GRACE * 2; i++)); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.5
    done
    if kill -0 "$pid" 2>/dev/null; then
        say "node 1 still running ${GRACE}s after node 0 finished; killing it"
        kill_namespace_procs "$NS1" KILL
        wait "$pid" || true
        return 1
    fi
    wait "$pid" || rc=$?
    ((rc == 0)) || say "node 1 exited with status $rc"
    return "$rc"
}

# One layout: run both nodes, then print what crossed the link.
run_layout() {
    local tag=$1 before0 before1 sent0 sent1 rc=0 i
    shift
    before0=$(tx_bytes 0) before1=$(tx_bytes 1)
    run_nodes "$@" || rc=$?
    sent0=$(($(tx_bytes 0) - before0)) sent1=$(($(tx_bytes 1) - before1))
    say "link ${tag:+($tag) }bytes: node 0 -> 1 $sent0, node 1 -> 0 $sent1"
    for i in 0 1; do  # cumulative; overlimits > 0: the rate limit held packets back
        say "tbf on node $i's side:" "$(tc -n "${NS[$i]}" -s qdisc show dev "veth$i" | grep Sent)"
    done
    SUMMARY+=("$tag $sent0 $sent1")
    return "$rc"
}

run_layouts() {
    local layout pp tp ep cp tag json args=() rc=0
    TMP=$(mktemp -d)
    for layout in $LAYOUTS; do
        read -r pp tp ep cp < <(layout_sizes "$layout")
        tag=pp${pp}tp${tp}
        ((ep == 1)) || tag+=ep${ep}
        ((cp == 1)) || tag+=cp${cp}
        mapfile -d '' args < <(tagged_args "$tag" "${BENCH_ARGS[@]}")
        json=$(json_path "${args[@]}")
        [[ -n $json ]] || { json=$TMP/$tag.json; args+=(--json "$json"); }
        JSONS+=("$json")
        say "layout PP$pp x TP$tp x EP$ep x CP$cp"
        run_layout "$tag" "${args[@]}" --pp-size "$pp" --tp-size "$tp" --ep-size "$ep" \
            --cp-size "$cp" || { rc=$?; break; }
    done
    ((rc)) || print_summary
    return "$rc"
}

print_summary() {
    local i row
    printf '%-14s%11s%11s%11s%14s%14s\n' layout "TTFT mean" "prefill s" "in tok/s" \
        "bytes 0->1" "bytes 1->0"
    for i in "${!JSONS[@]}"; do
        read -ra row <<<"${SUMMARY[$i]}"
        python3 - "${JSONS[$i]}" "${row[@]}" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
print(f"{sys.argv[2]:<14}{r['ttft_mean_s']:>11.3f}{r['prefill_s']:>11.3f}"
      f"{r['input_throughput_tok_s']:>11.1f}{int(sys.argv[3]):>14}{int(sys.argv[4]):>14}")
EOF
    done
}

main() {
    parse_options "$@"
    check_args
    check_system
    NS=() NS0="" NS1="" SUMMARY=() JSONS=() TMP=""
    trap cleanup EXIT
    trap 'say interrupted; exit 130' INT
    trap 'exit 143' TERM HUP
    remove_stale
    setup_link
    if [[ -n $LAYOUTS ]]; then
        run_layouts
    else
        run_layout "" "${BENCH_ARGS[@]}"
    fi
}

main "$@"
