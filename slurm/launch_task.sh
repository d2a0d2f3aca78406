#!/usr/bin/env bash
# One Slurm task of a megatron-lol job (called by lol_srun in common.sh):
#   LAUNCHER=torchrun: torchrun for PROCS_PER_NODE processes of this node;
#   LAUNCHER=srun:     this task is one rank (RANK/WORLD_SIZE/LOCAL_RANK from Slurm).
# Usage: launch_task.sh VERB ARGS...  (runs `megatron-lol VERB ARGS`, or
# `python $MEGATRON_LOL_ENTRY VERB ARGS` when MEGATRON_LOL_ENTRY is set: see common.sh)
#
# Slurm signals every process of the step (--signal=USR1@T, scancel -s USR1). The
# launcher runs with SIGUSR1 ignored -- torchrun would die of it and take its workers
# down mid-save -- and so do the training processes until the trainer installs its
# handler, which takes seconds (imports, model, checkpoint). This shell stays alive
# meanwhile and writes any SIGUSR1 it gets to $MEGATRON_LOL_STOP_FILE, which the
# trainer reads at every step end: a signal during start-up is not lost. SIGTERM is
# not ignored: torchrun forwards it to its workers and waits 30 s for them.
set -uo pipefail
PY="${MEGATRON_LOL_PYTHON:-python}"
STOP_FILE="${MEGATRON_LOL_STOP_FILE:-}"
read -r -a ENTRY <<< "${MEGATRON_LOL_ENTRY:--m megatron_lol}"

on_usr1() {
    if [ -n "$STOP_FILE" ]; then echo "SIGUSR1" > "$STOP_FILE" 2>/dev/null || true; fi
}
trap on_usr1 USR1
trap ':' TERM  # stay until the launcher has finished (it gets SIGTERM from Slurm too)

case "${LAUNCHER:-torchrun}" in
    torchrun)
        cmd=("$PY" -m torch.distributed.run
             --nnodes="${SLURM_JOB_NUM_NODES:-1}" --node-rank="${SLURM_NODEID:-0}"
             --nproc-per-node="${PROCS_PER_NODE:-1}"
             --master-addr="$MASTER_ADDR" --master-port="$MASTER_PORT"
             "${ENTRY[@]}" "$@")
        ;;
    srun)
        export RANK="$SLURM_PROCID" WORLD_SIZE="$SLURM_NTASKS" LOCAL_RANK="$SLURM_LOCALID"
        export LOCAL_WORLD_SIZE="${SLURM_NTASKS_PER_NODE:-1}"
        LOCAL_WORLD_SIZE="${LOCAL_WORLD_SIZE%%(*}"
        cmd=("$PY" "${ENTRY[@]}" "$@")
        ;;
    *)
        echo "launch_task.sh: LAUNCHER must be torchrun or srun (got $LAUNCHER)" >&2
        exit 2
        ;;
esac

( trap '' USR1; exec "${cmd[@]}" ) &
child=$!
while :; do
    rc=0
    wait "$child" || rc=$?
    kill -0 "$child" 2>/dev/null || break  # else a trapped signal interrupted the wait
done
exit "$rc"
