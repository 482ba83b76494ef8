#!/usr/bin/env bash
# Attach the selector to chosen pods' network namespaces: one agent per pod,
# started on the node (in the host's namespaces), each running
#   selector run --netns /proc/PID/ns/net --iface eth0 SELECTOR_RUN_ARGS...
# where PID is the pod sandbox's process, found through the container
# runtime (crictl) or given directly. `stop` stops them and runs
# `selector detach` in each namespace. See deploy/kubernetes/README.md.

set -euo pipefail

PROG=${0##*/}

usage() {
    cat <<EOF
Usage:
  $PROG start [OPTIONS] POD... -- SELECTOR_RUN_ARGS...
  $PROG start [OPTIONS] --pid PID [--pid PID]... -- SELECTOR_RUN_ARGS...
  $PROG stop [OPTIONS] [NAME]...
  $PROG list [OPTIONS]

Run on the node, as root (or in a pod with hostPID and hostNetwork), with
the capabilities of 'selector run --netns' (CAP_SYS_ADMIN to enter the
pod's namespace, CAP_BPF, CAP_PERFMON, CAP_NET_ADMIN).

start   For each pod (by name, through crictl, on this node) or each --pid,
        start one agent attached to IFACE in that process's network
        namespace, and wait until it says it is attached. An attachment
        is named NAMESPACE_POD, or pid-PID.
        SELECTOR_RUN_ARGS go to every agent: --group ... or --config FILE,
        --threshold, --timeout, ... (not --netns, --iface or --pin; give
        --metrics-addr only when starting one pod, as the agents listen in
        the host's namespace).
stop    Stop the named attachments (all, without a name): SIGTERM each
        agent (it detaches as it exits), then 'selector detach' in its
        namespace, which removes what an agent that was killed left (on
        kernels without TCX its tc filters outlive it).
list    The attachments started, and whether their agents run.

Options:
  -n, --namespace NS  Kubernetes namespace of the pods named [default: default]
  --pid PID           Attach to the network namespace of process PID
                      (repeatable); no crictl needed
  --iface IF          Interface inside each pod [default: eth0]
  --selector PATH     The selector binary [default: \$SELECTOR_BIN, else
                      'selector' on PATH]
  --state-dir DIR     Where each attachment's settings and log are kept
                      [default: /run/selector-pods]
  --systemd           Run each agent as a transient systemd unit,
                      selector-pod-NAME.service (systemd-run), instead of a
                      background process
  --wait SECS         How long start waits for each agent to attach, and
                      stop for each to exit (its --timeout and more)
                      [default: 10]
  -h, --help          This help

Pods by name: crictl pods --name ^POD\$ --namespace ^NS\$ --state ready, then
crictl inspectp (the sandbox's .info.pid, as containerd reports it).

Examples:
  $PROG start -n shop cart-7d9f-abcde -- --group 10.0.0.1:11211,10.0.0.2:11211
  $PROG start --pid 4242 -- --config /etc/selector/pods.toml
  $PROG stop shop_cart-7d9f-abcde
  $PROG stop
EOF
}

die() {
    echo "$PROG: error: $*" >&2
    exit 1
}

usage_error() {
    echo "$PROG: error: $*" >&2
    echo "Try '$PROG --help'." >&2
    exit 2
}

MODE=
K8S_NAMESPACE=default
IFACE=eth0
SELECTOR=${SELECTOR_BIN:-}
STATE_DIR=/run/selector-pods
USE_SYSTEMD=0
WAIT=10
PODS=()
PIDS=()
NAMES=()
RUN_ARGS=()

parse_args() {
    if [ $# -eq 0 ]; then
        usage_error "no mode given (start, stop or list)"
    fi
    case $1 in
        -h | --help)
            usage
            exit 0
            ;;
        start | stop | list) MODE=$1 ;;
        *) usage_error "unknown mode '$1' (start, stop or list)" ;;
    esac
    shift
    while [ $# -gt 0 ]; do
        case $1 in
            -h | --help)
                usage
                exit 0
                ;;
            -n | --namespace)
                [ $# -ge 2 ] || usage_error "$1 needs a value"
                K8S_NAMESPACE=$2
                shift 2
                ;;
            --pid)
                [ $# -ge 2 ] || usage_error "$1 needs a value"
                PIDS+=("$2")
                shift 2
                ;;
            --iface)
                [ $# -ge 2 ] || usage_error "$1 needs a value"
                IFACE=$2
                shift 2
                ;;
            --selector)
                [ $# -ge 2 ] || usage_error "$1 needs a value"
                SELECTOR=$2
                shift 2
                ;;
            --state-dir)
                [ $# -ge 2 ] || usage_error "$1 needs a value"
                STATE_DIR=$2
                shift 2
                ;;
            --systemd)
                USE_SYSTEMD=1
                shift
                ;;
            --wait)
                [ $# -ge 2 ] || usage_error "$1 needs a value"
                WAIT=$2
                shift 2
                ;;
            --)
                shift
                RUN_ARGS=("$@")
                break
                ;;
            -*) usage_error "unknown option '$1'" ;;
            *)
                if [ "$MODE" = start ]; then
                    PODS+=("$1")
                else
                    NAMES+=("$1")
                fi
                shift
                ;;
        esac
    done
    [[ $WAIT =~ ^[0-9]+$ ]] && [ "$WAIT" -gt 0 ] ||
        usage_error "--wait takes whole seconds, not '$WAIT'"
}

# The selector binary, checked.
find_selector() {
    if [ -z "$SELECTOR" ]; then
        SELECTOR=$(command -v selector) ||
            die "no selector binary: none on PATH; give --selector PATH or set SELECTOR_BIN"
    fi
    [ -f "$SELECTOR" ] && [ -x "$SELECTOR" ] ||
        die "no selector binary at '$SELECTOR' (not an executable file)"
}

# The sandbox PID of pod $1 in $K8S_NAMESPACE, through crictl.
pod_pid() {
    local pod=$1 ids pid
    ids=$(crictl pods --name "^${pod}\$" --namespace "^${K8S_NAMESPACE}\$" --state ready -q) ||
        die "crictl pods failed for pod $pod in namespace $K8S_NAMESPACE"
    case $(printf '%s\n' "$ids" | grep -c .) in
        0) die "no ready pod '$pod' in namespace '$K8S_NAMESPACE' on this node (crictl pods)" ;;
        1) ;;
        *) die "more than one ready sandbox for pod '$pod' in namespace '$K8S_NAMESPACE': $(echo "$ids" | tr '\n' ' ')" ;;
    esac
    pid=$(crictl inspectp -o go-template --template '{{.info.pid}}' "$ids") ||
        die "crictl inspectp $ids (pod $pod) failed"
    [[ $pid =~ ^[1-9][0-9]*$ ]] ||
        die "crictl inspectp $ids (pod $pod) gave no sandbox PID ('$pid'); find one and give --pid PID"
    echo "$pid"
}

# The inode of network namespace file $1 ('' if it cannot be read).
netns_inode() {
    stat -L -c %i "$1" 2>/dev/null || true
}

state_file() { echo "$STATE_DIR/$1.env"; }

# Loads attachment $1's settings (written by save_state).
load_state() {
    local file
    file=$(state_file "$1")
    [ -f "$file" ] || die "no attachment named '$1' (see: $PROG list --state-dir $STATE_DIR)"
    NETNS= NETNS_INODE= ATTACH_IFACE= AGENT_PID= UNIT= TARGET=
    # shellcheck disable=SC1090 # written by save_state, quoted with %q
    . "$file"
}

save_state() {
    local name=$1
    {
        printf 'TARGET=%q\n' "$TARGET"
        printf 'NETNS=%q\n' "$NETNS"
        printf 'NETNS_INODE=%q\n' "$NETNS_INODE"
        printf 'ATTACH_IFACE=%q\n' "$ATTACH_IFACE"
        printf 'AGENT_PID=%q\n' "$AGENT_PID"
        printf 'UNIT=%q\n' "$UNIT"
    } >"$(state_file "$name").tmp"
    mv "$(state_file "$name").tmp" "$(state_file "$name")"
}

# Whether process $1 runs (exists and is not a zombie awaiting its reaper).
pid_alive() {
    local stat
    stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
    stat=${stat##*) }
    [ "${stat:0:1}" != Z ]
}

# Whether the agent of the loaded attachment runs.
agent_alive() {
    if [ -n "$UNIT" ]; then
        systemctl is-active --quiet "$UNIT"
    else
        [ -n "$AGENT_PID" ] && pid_alive "$AGENT_PID" &&
            tr '\0' ' ' <"/proc/$AGENT_PID/cmdline" 2>/dev/null | grep -q -- " run --netns $NETNS "
    fi
}

# Starts one agent: name, target (what it is for), sandbox PID.
start_one() {
    local name=$1 target=$2 pid=$3 log unit
    NETNS=/proc/$pid/ns/net
    [ -e "$NETNS" ] || die "$target: no process $pid (no $NETNS)"
    NETNS_INODE=$(netns_inode "$NETNS")
    [ -n "$NETNS_INODE" ] || die "$target: cannot read $NETNS (run as root)"
    TARGET=$target
    ATTACH_IFACE=$IFACE
    AGENT_PID=
    UNIT=
    if [ -f "$(state_file "$name")" ]; then
        (
            load_state "$name"
            ! agent_alive
        ) || die "$target is already attached ($name); '$PROG stop $name' first"
    fi
    log=$STATE_DIR/$name.log
    : >"$log"
    local cmd=("$SELECTOR" run --netns "$NETNS" --iface "$IFACE" "${RUN_ARGS[@]}")
    if [ "$USE_SYSTEMD" = 1 ]; then
        command -v systemd-run >/dev/null || die "--systemd: systemd-run not found"
        unit=selector-pod-$name.service
        local env=()
        [ -n "${SELECTOR_TC_ATTACH:-}" ] && env+=(--setenv="SELECTOR_TC_ATTACH=$SELECTOR_TC_ATTACH")
        [ -n "${RUST_LOG:-}" ] && env+=(--setenv="RUST_LOG=$RUST_LOG")
        # Type=notify: systemd-run returns once the agent says READY=1
        # (after attaching), or fails.
        if ! systemd-run --quiet --collect --unit "$unit" \
            --description "selector attached to $IFACE of $target" \
            -p Type=notify -p NotifyAccess=main -p "TimeoutStartSec=$WAIT" \
            -p KillSignal=SIGTERM -p "TimeoutStopSec=$WAIT" \
            "${env[@]}" -- "${cmd[@]}"; then
            journalctl -u "$unit" -n 20 --no-pager >&2 || true
            die "$target: the agent did not start (unit $unit)"
        fi
        UNIT=$unit
        save_state "$name"
        echo "$PROG: $target: attached to $IFACE in $NETNS (unit $unit)"
        return
    fi
    # Its own session (no SIGHUP, which would be a reload, when the
    # terminal goes); output to the log; nothing inherited from ours.
    setsid "${cmd[@]}" </dev/null >>"$log" 2>&1 &
    AGENT_PID=$!
    save_state "$name"
    local deadline=$((SECONDS + WAIT))
    while ! grep -q '^selector: attached to' "$log"; do
        if ! pid_alive "$AGENT_PID"; then
            rm -f "$(state_file "$name")"
            cat "$log" >&2
            die "$target: the agent exited without attaching (log above, in $log)"
        fi
        if [ "$SECONDS" -ge "$deadline" ]; then
            kill -TERM "$AGENT_PID" 2>/dev/null || true
            rm -f "$(state_file "$name")"
            cat "$log" >&2
            die "$target: the agent did not attach within $WAIT s (stopped; log in $log)"
        fi
        sleep 0.1
    done
    echo "$PROG: $target: $(grep -m1 '^selector: attached to' "$log" | sed 's/^selector: //') (agent $AGENT_PID, log $log)"
}

do_start() {
    [ ${#PODS[@]} -gt 0 ] || [ ${#PIDS[@]} -gt 0 ] ||
        usage_error "start: name pods, or give --pid PID"
    find_selector
    if [ ${#PODS[@]} -gt 0 ] && ! command -v crictl >/dev/null; then
        die "crictl not found: it is needed to find pods by name (or give --pid PID)"
    fi
    local pid pod targets=() names=() pids=()
    for pid in "${PIDS[@]}"; do
        [[ $pid =~ ^[1-9][0-9]*$ ]] || usage_error "--pid takes a process id, not '$pid'"
        targets+=("pid $pid")
        names+=("pid-$pid")
        pids+=("$pid")
    done
    # Every pod is looked up before any agent starts: a typo starts none.
    for pod in "${PODS[@]}"; do
        pid=$(pod_pid "$pod")
        targets+=("pod $K8S_NAMESPACE/$pod")
        names+=("${K8S_NAMESPACE}_$pod")
        pids+=("$pid")
    done
    mkdir -p "$STATE_DIR"
    local i
    for i in "${!names[@]}"; do
        start_one "${names[$i]}" "${targets[$i]}" "${pids[$i]}"
    done
}

# Stops attachment $1 and detaches what is left; returns non-zero if
# something could not be removed.
stop_one() {
    local name=$1 out code
    load_state "$name"
    if agent_alive; then
        if [ -n "$UNIT" ]; then
            systemctl stop "$UNIT" || true
        else
            kill -TERM "$AGENT_PID" 2>/dev/null || true
            local deadline=$((SECONDS + WAIT))
            while pid_alive "$AGENT_PID" && [ "$SECONDS" -lt "$deadline" ]; do
                sleep 0.1
            done
            if pid_alive "$AGENT_PID"; then
                echo "$PROG: $TARGET: the agent did not exit within $WAIT s: killed" >&2
                kill -KILL "$AGENT_PID" 2>/dev/null || true
            fi
        fi
        echo "$PROG: $TARGET: agent stopped"
    else
        echo "$PROG: $TARGET: the agent had already exited"
    fi
    # The same namespace still there (not a new process with the same PID)?
    if [ "$(netns_inode "$NETNS")" != "$NETNS_INODE" ]; then
        echo "$PROG: $TARGET: its network namespace is gone (the pod ended): nothing to detach"
        rm -f "$(state_file "$name")"
        return 0
    fi
    code=0
    out=$("$SELECTOR" detach --netns "$NETNS" --iface "$ATTACH_IFACE" 2>&1) || code=$?
    if [ "$code" = 0 ]; then
        printf '%s\n' "$out" | sed "s|^selector: |$PROG: $TARGET: |"
    elif printf '%s\n' "$out" | grep -q 'nothing of the selector is attached'; then
        echo "$PROG: $TARGET: nothing left attached to $ATTACH_IFACE"
    else
        printf '%s\n' "$out" >&2
        echo "$PROG: $TARGET: selector detach failed; the attachment is kept (retry '$PROG stop $name')" >&2
        return 1
    fi
    rm -f "$(state_file "$name")"
}

# Every attachment in the state directory.
all_names() {
    local f
    [ -d "$STATE_DIR" ] || return 0
    for f in "$STATE_DIR"/*.env; do
        [ -e "$f" ] || continue
        f=${f##*/}
        echo "${f%.env}"
    done
}

do_stop() {
    find_selector
    local names=("${NAMES[@]}") name rc=0
    if [ ${#names[@]} -eq 0 ]; then
        mapfile -t names < <(all_names)
        if [ ${#names[@]} -eq 0 ]; then
            echo "$PROG: no attachments in $STATE_DIR"
            return 0
        fi
    else
        for name in "${names[@]}"; do
            [ -f "$(state_file "$name")" ] ||
                die "no attachment named '$name' (see: $PROG list --state-dir $STATE_DIR)"
        done
    fi
    for name in "${names[@]}"; do
        stop_one "$name" || rc=1
    done
    return $rc
}

do_list() {
    local name names
    mapfile -t names < <(all_names)
    for name in "${names[@]}"; do
        load_state "$name"
        local how=${UNIT:-agent $AGENT_PID} state=exited
        agent_alive && state=running
        printf '%s\t%s\t%s\t%s %s\t%s\n' "$name" "$TARGET" "$ATTACH_IFACE" "$how" "$state" "$NETNS"
    done
}

parse_args "$@"
case $MODE in
    start) do_start ;;
    stop) do_stop ;;
    list) do_list ;;
esac
