# shellcheck shell=bash
# Shared by every megatron-lol sbatch script: settings, rendezvous, launch, signals, requeue.
#
# Every cluster-specific value is a variable with a default; set it in the
# environment of `sbatch` (exported to the job) or let submit_pipeline.sh pass it.
# Resource requests (partition, account, time, GPUs) cannot be variables inside
# #SBATCH lines: give them on the sbatch command line or through sbatch's own
# input variables (SBATCH_PARTITION, SBATCH_ACCOUNT, SBATCH_QOS, SBATCH_TIMELIMIT,
# SBATCH_GPUS_PER_NODE, ...), which submit_pipeline.sh does from the variables below.
#
# The job runs in the directory it was submitted from (sbatch's default, or
# --chdir): relative paths in CONFIG, SAVE_DIR, DATA_PREFIX, ... are relative to it.
#
#   MEGATRON_LOL_ROOT   the repository (default: found from the submitted script's path)
#   MEGATRON_LOL_PYTHON python with megatron-lol's dependencies (default: $MEGATRON_LOL_ROOT/.venv/bin/python,
#                                                               `python` inside a container); the
#                       repository's megatron_lol package comes first on its PYTHONPATH
#   GPUS_PER_NODE       GPUs per node; 0 = CPU nodes (gloo)    (default: 0 without nvidia-smi, else its count)
#   PROCS_PER_NODE      training processes per node            (default: GPUS_PER_NODE, 1 on CPU nodes)
#   MEGATRON_LOL_ENTRY  what that python runs for the training / profile launches, as words
#                       (default: `-m megatron_lol`); fault drills use the tests' entry script, e.g.
#                       "$MEGATRON_LOL_ROOT/tests/fault_rank_runner.py nan=6 --" (see docs/slurm.md)
#   LAUNCHER            torchrun: one Slurm task per node running torchrun (needs --ntasks-per-node=1)
#                       srun:     one Slurm task per process (needs --ntasks-per-node=PROCS_PER_NODE)
#                                                              (default: torchrun)
#   RENDEZVOUS_PORT     rendezvous port on the first node      (default: 20000 + job id mod 20000)
#   REQUEUE_EXIT_CODE   status of a run that saved on SIGTERM/SIGUSR1/time limit (default: 85)
#   MAX_REQUEUES        give up requeueing after this many restarts (default: 20)
#   OMP_NUM_THREADS     CPU threads per process                (default: the task's CPUs / its processes)
#   CONTAINER_IMAGE     pyxis/enroot image; empty = no container (default: empty)
#   CONTAINER_MOUNTS    --container-mounts value               (default: the repository and the
#                                                               submit directory at the same paths)
#   CONTAINER_EXTRA     more srun container flags              (default: empty)
#   NCCL_* / GLOO_SOCKET_IFNAME: see lol_network_env below; anything you export wins.
#
# MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK, ... of the submitting shell are
# ignored (sbatch exports the whole environment; a login node's values would win over the
# job's own and hang the rendezvous): the rendezvous comes from the job's node list.
#
# Signals. Slurm's preemption warning is SIGUSR1: to the job steps (--signal=USR1@T,
# `scancel -s USR1`) or to this batch shell (--signal=B:USR1@T, `scancel --batch -s USR1`).
# The batch shell traps it from its first line and writes it to a stop file
# ($SAVE_DIR/.slurm-job-ID/stop) that rank 0 of the trainer reads at every step end;
# launch_task.sh does the same for a signal that reaches a task before the trainer listens.
# Either way the trainer saves at the next step boundary and exits 85; the batch shell requeues.
# SIGTERM (cancel, time limit, preemption) reaches the steps from Slurm itself: the batch
# shell keeps waiting for them, so a save in progress is not cut off by the script ending.

set -euo pipefail

LOL_PENDING_SIGNAL="${LOL_EARLY_SIGNAL:-}"  # set by the sbatch script's first-line trap
LOL_CHILD_PID=""
LOL_STOP_FILE=""
lol_log() { echo "[megatron-lol $(date +%T) job ${SLURM_JOB_ID:-?}${SLURM_RESTART_COUNT:+ restart $SLURM_RESTART_COUNT}] $*"; }

# lol_on_signal NAME: the batch shell got SIGNAME (trap handler; the wait it interrupted resumes).
# The request goes to the trainer through the stop file, not by signalling srun: a signal that
# reaches srun before it set up its own handlers would kill the step.
lol_on_signal() {
    LOL_PENDING_SIGNAL=$1
    if [ -n "$LOL_STOP_FILE" ]; then
        echo "SIG$1" > "$LOL_STOP_FILE" 2>/dev/null || true
        lol_log "batch shell received SIG$1: the trainer saves and stops at its next step boundary"
    else
        lol_log "batch shell received SIG$1 before the launch: the trainer will stop after its first step"
    fi
}
trap 'lol_on_signal USR1' USR1

for _v in MASTER_ADDR MASTER_PORT RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE GROUP_RANK NODE_RANK \
          TORCHELASTIC_RUN_ID; do
    if [ -n "${!_v+x}" ]; then
        lol_log "ignoring $_v=${!_v} from the submitting environment (set per job)"
        unset "$_v"
    fi
done
# submit_pipeline.sh submits with HF_HUB_OFFLINE=1 (a tokenizer given by Hub name was fetched on the
# submitting host; compute nodes may have no internet): say so, so a job's log shows where it reads them
if [ "${HF_HUB_OFFLINE:-0}" = 1 ]; then
    lol_log "HF_HUB_OFFLINE=1: Hub files (tokenizers) are read from the local cache only" \
            "(${HF_HUB_CACHE:-${HF_HOME:-${HOME:-~}/.cache/huggingface}/hub})"
fi

: "${MEGATRON_LOL_ROOT:?slurm/common.sh: MEGATRON_LOL_ROOT is not set (source it from an sbatch script)}"
MEGATRON_LOL_ROOT="$(cd "$MEGATRON_LOL_ROOT" && pwd)"
export MEGATRON_LOL_ROOT
export PYTHONPATH="$MEGATRON_LOL_ROOT${PYTHONPATH:+:$PYTHONPATH}"

CONTAINER_IMAGE="${CONTAINER_IMAGE:-}"
CONTAINER_MOUNTS="${CONTAINER_MOUNTS:-$MEGATRON_LOL_ROOT:$MEGATRON_LOL_ROOT}"
if [ "$PWD" != "$MEGATRON_LOL_ROOT" ] && [[ "$CONTAINER_MOUNTS" != *"$PWD:"* ]]; then
    CONTAINER_MOUNTS="$CONTAINER_MOUNTS,$PWD:$PWD"
fi
CONTAINER_EXTRA="${CONTAINER_EXTRA:-}"
if [ -z "${MEGATRON_LOL_PYTHON:-}" ]; then
    if [ -n "$CONTAINER_IMAGE" ]; then MEGATRON_LOL_PYTHON=python
    else MEGATRON_LOL_PYTHON="$MEGATRON_LOL_ROOT/.venv/bin/python"; fi
fi
export MEGATRON_LOL_PYTHON
if [ -z "$CONTAINER_IMAGE" ] && [ ! -x "$MEGATRON_LOL_PYTHON" ] && ! command -v "$MEGATRON_LOL_PYTHON" >/dev/null; then
    echo "megatron-lol: $MEGATRON_LOL_PYTHON not found: run tools/setup_env.sh or set MEGATRON_LOL_PYTHON" >&2
    exit 2
fi

if [ -z "${GPUS_PER_NODE:-}" ]; then
    if command -v nvidia-smi >/dev/null 2>&1; then GPUS_PER_NODE=$(nvidia-smi -L 2>/dev/null | wc -l)
    else GPUS_PER_NODE=0; fi
fi
if [ -z "${PROCS_PER_NODE:-}" ]; then
    if [ "$GPUS_PER_NODE" -gt 0 ]; then PROCS_PER_NODE=$GPUS_PER_NODE; else PROCS_PER_NODE=1; fi
fi
LAUNCHER="${LAUNCHER:-torchrun}"
REQUEUE_EXIT_CODE="${REQUEUE_EXIT_CODE:-85}"
MAX_REQUEUES="${MAX_REQUEUES:-20}"
export GPUS_PER_NODE PROCS_PER_NODE LAUNCHER

# ------------------------------------------------------------------ environment
lol_network_env() {
    if [ "$GPUS_PER_NODE" -gt 0 ]; then
        # Megatron: kernels of TP/SP communication must queue in order
        export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"
        export TORCH_NCCL_AVOID_RECORD_STREAMS="${TORCH_NCCL_AVOID_RECORD_STREAMS:-1}"
        export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"
        export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
        # InfiniBand (H100/H800 clusters): long IB timeout for large jobs; the HCA list, socket
        # interface and GID index (RoCE: usually 3) are site values: exported only when set.
        export NCCL_IB_TIMEOUT="${NCCL_IB_TIMEOUT:-22}"
        export NCCL_IB_RETRY_CNT="${NCCL_IB_RETRY_CNT:-7}"
        for v in NCCL_IB_HCA NCCL_SOCKET_IFNAME NCCL_IB_GID_INDEX NCCL_IB_SL NCCL_NET_GDR_LEVEL \
                 NCCL_IB_QPS_PER_CONNECTION NCCL_NVLS_ENABLE NCCL_CROSS_NIC NCCL_ALGO NCCL_PROTO; do
            if [ -n "${!v:-}" ]; then export "${v?}"; fi
        done
    fi
    if [ -n "${GLOO_SOCKET_IFNAME:-}" ]; then export GLOO_SOCKET_IFNAME; fi
    if [ -z "${OMP_NUM_THREADS:-}" ]; then
        # per process: the task's CPUs over the processes of the task (torchrun: all of the
        # node's; srun: one), or the job's CPUs on the node over the processes of the node
        local cpus procs=$PROCS_PER_NODE
        if [ -n "${SLURM_CPUS_PER_TASK:-}" ]; then
            cpus=$SLURM_CPUS_PER_TASK
            [ "$LAUNCHER" = srun ] && procs=1
        else
            cpus=${SLURM_CPUS_ON_NODE:-1}
        fi
        OMP_NUM_THREADS=$(( cpus / procs > 0 ? cpus / procs : 1 ))
    fi
    export OMP_NUM_THREADS
    export PYTHONUNBUFFERED=1
}

lol_rendezvous() {
    MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
    MASTER_PORT="${RENDEZVOUS_PORT:-$(( 20000 + ${SLURM_JOB_ID:-0} % 20000 ))}"
    export MASTER_ADDR MASTER_PORT
}

# lol_wait PID: wait until PID has exited (a trapped signal interrupts `wait`); its status
lol_wait() {
    local rc
    while :; do
        rc=0
        wait "$1" || rc=$?
        kill -0 "$1" 2>/dev/null || return "$rc"
    done
}

# ------------------------------------------------------------------ launch
# lol_srun VERB ARGS...: run `megatron-lol VERB ARGS` on every node of the job, as
# one torchrun per node or one task per process; returns the srun status.
lol_srun() {
    lol_network_env
    lol_rendezvous
    local ntasks_per_node=1
    [ "$LAUNCHER" = srun ] && ntasks_per_node=$PROCS_PER_NODE
    local step=(--nodes="${SLURM_JOB_NUM_NODES:-1}" --ntasks-per-node="$ntasks_per_node" --kill-on-bad-exit=1)
    # since Slurm 22.05 a step no longer inherits the job's --cpus-per-task
    [ -n "${SLURM_CPUS_PER_TASK:-}" ] && step+=(--cpus-per-task="$SLURM_CPUS_PER_TASK")
    if [ -n "$CONTAINER_IMAGE" ]; then
        step+=(--container-image="$CONTAINER_IMAGE" --container-mounts="$CONTAINER_MOUNTS"
               --container-workdir="$PWD")
        # shellcheck disable=SC2206
        step+=($CONTAINER_EXTRA)
    fi
    lol_log "launch: $LAUNCHER, ${SLURM_JOB_NUM_NODES:-1} node(s) x $PROCS_PER_NODE process(es), GPUs/node $GPUS_PER_NODE," \
            "rendezvous $MASTER_ADDR:$MASTER_PORT, $OMP_NUM_THREADS thread(s)/process, python $MEGATRON_LOL_PYTHON" \
            "${MEGATRON_LOL_ENTRY:+(entry: $MEGATRON_LOL_ENTRY)}"
    trap ':' TERM  # keep waiting for the step (it got SIGTERM too and may be saving)
    local rc=0
    srun "${step[@]}" bash "$MEGATRON_LOL_ROOT/slurm/launch_task.sh" "$@" &
    LOL_CHILD_PID=$!
    lol_wait "$LOL_CHILD_PID" || rc=$?
    LOL_CHILD_PID=""
    trap - TERM
    return $rc
}

# lol_check_layout TRAIN_ARGS...: before the launch, stop the job (status 2) when the layout of these
# `megatron-lol train` arguments does not run on this allocation (SLURM_JOB_NUM_NODES x PROCS_PER_NODE
# ranks): `megatron-lol plan-layout --check` prints why and the planner's first proposal (the flags to
# pass, or `plan-layout --output` for a derived config); other errors are the trainer's to report.
# CHECK_LAYOUT=0 skips it; in a container the
# batch host may have no python with megatron-lol, and the trainer's own check (status 2) stands.
lol_check_layout() {
    [ "${CHECK_LAYOUT:-1}" = 1 ] || return 0
    if [ -n "$CONTAINER_IMAGE" ]; then lol_log "layout check left to the trainer (container)"; return 0; fi
    local out rc=0
    out=$("$MEGATRON_LOL_PYTHON" -m megatron_lol plan-layout --check --nodes "${SLURM_JOB_NUM_NODES:-1}" \
          --gpus-per-node "$PROCS_PER_NODE" "$@" 2>&1) || rc=$?
    out=$(grep '^megatron-lol' <<<"$out" || true)
    # a layout that does not fit says so with a proposal line; any other error (a config typo) is
    # left to the trainer, which reports it in its own words
    if [ "$rc" -ne 0 ] && grep -q '^megatron-lol plan-layout: \(first\|no\) proposal' <<<"$out"; then
        lol_log "layout check failed (status $rc), nothing launched:"
        echo "$out" >&2
        lol_job_comment "megatron-lol: status 2: $(head -n 1 <<<"$out")"
        exit 2
    fi
    [ "$rc" -eq 0 ] && lol_log "${out#megatron-lol plan-layout: }"
    return 0
}

# lol_rank_status DIR: "STATUS MESSAGE" recorded by the lowest rank that failed, or nothing
lol_rank_status() {
    local f
    f=$(find "$1" -maxdepth 1 -name 'rank-*.status' 2>/dev/null | sort -V | head -n 1)
    [ -n "$f" ] && head -n 1 "$f"
    return 0
}

# lol_job_comment TEXT: show TEXT in `scontrol show job` / `squeue -O comment` (best effort)
lol_job_comment() {
    [ -n "${SLURM_JOB_ID:-}" ] && scontrol update JobId="$SLURM_JOB_ID" Comment="${1:0:250}" >/dev/null 2>&1
    return 0
}

# lol_train_and_requeue SAVE_DIR TRAIN_ARGS...: train; requeue this job when the run saved
# because of a preemption signal or its time limit (a rank's status 85, srun's status 85 or
# the REQUEUE_REQUESTED marker written during this launch). Any other failure ends the job
# with the ranks' own status and one-line error (not torchrun's 1 or srun's 143).
lol_train_and_requeue() {
    local save_dir=$1; shift
    local state="$save_dir/.slurm-job-${SLURM_JOB_ID:-0}"
    local marker="$save_dir/REQUEUE_REQUESTED"
    mkdir -p "$save_dir"
    rm -rf "$state"; mkdir -p "$state"
    if [ -f "$marker" ]; then  # an earlier job's: never a reason to requeue this one
        lol_log "removing $marker left by an earlier run ($(head -c 200 "$marker"))"
        rm -f "$marker"
    fi
    LOL_STOP_FILE="$state/stop"
    if [ -n "$LOL_PENDING_SIGNAL" ]; then echo "SIG$LOL_PENDING_SIGNAL" > "$LOL_STOP_FILE"; fi
    export MEGATRON_LOL_STOP_FILE="$LOL_STOP_FILE" MEGATRON_LOL_STATUS_DIR="$state"

    local rc=0
    lol_srun train "$@" || rc=$?
    local status code="" msg=""
    status=$(lol_rank_status "$state")
    if [ -n "$status" ]; then code=${status%% *}; msg=${status#* }; fi
    LOL_STOP_FILE=""
    rm -rf "$state"

    if [ "$code" = "$REQUEUE_EXIT_CODE" ] || [ "$rc" -eq "$REQUEUE_EXIT_CODE" ] || [ -f "$marker" ]; then
        local why=""; [ -f "$marker" ] && why=$(cat "$marker")
        rm -f "$marker"
        if [ "${SLURM_RESTART_COUNT:-0}" -ge "$MAX_REQUEUES" ]; then
            lol_log "checkpoint saved ($why) but MAX_REQUEUES=$MAX_REQUEUES reached: not requeueing"
            return "$REQUEUE_EXIT_CODE"
        fi
        lol_log "checkpoint saved ($why, status ${code:-$rc}): requeueing job $SLURM_JOB_ID"
        trap - USR1 TERM  # the requeue ends this script with SIGTERM: let it, at once
        local out
        if ! out=$(scontrol requeue "$SLURM_JOB_ID" 2>&1); then
            lol_log "scontrol requeue failed: $out"
            lol_job_comment "megatron-lol: saved, requeue failed: relaunch to continue"
            return "$REQUEUE_EXIT_CODE"
        fi
        sleep 300
        return 0
    fi
    if [ "$rc" -eq 0 ] && [ -z "$code" ]; then return 0; fi
    if [ -n "$code" ]; then
        lol_log "training failed with status $code: $msg"
    else
        code=$rc
        msg="no rank recorded an error; srun ended with status $rc (a process killed by a signal, e.g. out of memory?)"
        lol_log "training failed: $msg"
    fi
    lol_job_comment "megatron-lol: status $code: $msg"
    return "$code"
}
