#!/usr/bin/env bash
# Submit the whole pipeline, each stage starting only when the previous one succeeded
# (--dependency=afterok):
#
#   preprocess (array over NUM_SHARDS shards) -> merge -> pretrain -> context extension
#
#   INPUT='/data/raw/*.jsonl.zst' TOKENIZER_MODEL=/data/tok.model NUM_SHARDS=64 \
#   PARTITION=h100 ACCOUNT=myproj NODES=16 GPUS_PER_NODE=8 \
#   PRETRAIN_CONFIG=examples/configs/paper/lol-360m-L4.yaml CONTEXT_CONFIG=my-ctx.yaml \
#   WORK_DIR=/lustre/me/lol360m bash slurm/submit_pipeline.sh
#
# Variables (defaults):
#   INPUT             corpus files / glob / directory for preprocess      (required)
#   TOKENIZER_TYPE    (SentencePieceTokenizer)    TOKENIZER_MODEL (required for SentencePiece)
#   NUM_SHARDS        preprocess array size                                (4)
#   PREPROCESS_CPUS   CPUs per preprocess task (= tokenizer workers)       (4)
#   WORK_DIR          data/, pretrain/, context_ext/, logs/, jobs.env go here (runs/pipeline)
#   PRETRAIN_CONFIG   (examples/configs/tiny-slurm.yaml)
#   CONTEXT_CONFIG    (examples/configs/tiny-context-ext.yaml); empty = no context-extension stage
#   NODES             nodes for pretrain and context extension           (2)
#   GPUS_PER_NODE     GPUs per node, 0 = CPU nodes with gloo                (0 without nvidia-smi, else 8)
#   PROCS_PER_NODE    training processes per node                         (GPUS_PER_NODE, or 1)
#   CPUS_PER_TASK     CPUs per training task                              (empty: Slurm's default)
#   LAUNCHER          torchrun | srun (see slurm/common.sh)               (torchrun)
#   PARTITION ACCOUNT QOS   Slurm partition / account / QoS               (empty: cluster defaults)
#   PREPROCESS_TIME PRETRAIN_TIME CONTEXT_TIME   --time limits            (empty: partition default)
#   SBATCH_EXTRA      more sbatch flags for every job, e.g. "--exclusive --mem=0" (empty)
#   PRETRAIN_LAUNCHER / CONTEXT_LAUNCHER   per-stage LAUNCHER override    (LAUNCHER)
#   PRETRAIN_ARGS / CONTEXT_ARGS           extra `megatron-lol train` flags per stage (empty)
#   CONTAINER_IMAGE, CONTAINER_MOUNTS, MEGATRON_LOL_PYTHON, NCCL_*: see slurm/common.sh
# Prints the job ids and writes them to $WORK_DIR/jobs.env.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
export MEGATRON_LOL_ROOT="$REPO"

: "${INPUT:?set INPUT to the corpus files}"
NUM_SHARDS="${NUM_SHARDS:-4}"
PREPROCESS_CPUS="${PREPROCESS_CPUS:-4}"
WORK_DIR="${WORK_DIR:-runs/pipeline}"
case "$WORK_DIR" in /*) ;; *) WORK_DIR="$REPO/$WORK_DIR" ;; esac
PRETRAIN_CONFIG="${PRETRAIN_CONFIG:-examples/configs/tiny-slurm.yaml}"
CONTEXT_CONFIG="${CONTEXT_CONFIG-examples/configs/tiny-context-ext.yaml}"
NODES="${NODES:-2}"
if [ -z "${GPUS_PER_NODE:-}" ]; then
    if command -v nvidia-smi >/dev/null 2>&1; then GPUS_PER_NODE=8; else GPUS_PER_NODE=0; fi
fi
if [ -z "${PROCS_PER_NODE:-}" ]; then
    if [ "$GPUS_PER_NODE" -gt 0 ]; then PROCS_PER_NODE=$GPUS_PER_NODE; else PROCS_PER_NODE=1; fi
fi
LAUNCHER="${LAUNCHER:-torchrun}"
export GPUS_PER_NODE PROCS_PER_NODE

mkdir -p "$WORK_DIR/logs" "$WORK_DIR/data"
DATA_PREFIX_BASE="$WORK_DIR/data/corpus"
DATA_PREFIX="${DATA_PREFIX_BASE}_text_document"

common=(--parsable --chdir="$REPO")
[ -n "${PARTITION:-}" ] && common+=(--partition="$PARTITION")
[ -n "${ACCOUNT:-}" ] && common+=(--account="$ACCOUNT")
[ -n "${QOS:-}" ] && common+=(--qos="$QOS")
# shellcheck disable=SC2206
common+=(${SBATCH_EXTRA:-})

train_flags() {  # train_flags LAUNCHER TIME
    local flags=(--nodes="$NODES")
    if [ "$1" = srun ]; then flags+=(--ntasks-per-node="$PROCS_PER_NODE")
    else flags+=(--ntasks-per-node=1); fi
    [ "$GPUS_PER_NODE" -gt 0 ] && flags+=(--gpus-per-node="$GPUS_PER_NODE")
    [ -n "${CPUS_PER_TASK:-}" ] && flags+=(--cpus-per-task="$CPUS_PER_TASK")
    [ -n "${2:-}" ] && flags+=(--time="$2")
    echo "${flags[@]}"
}
jobid() { cut -d';' -f1; }

pre_flags=(--array=0-$((NUM_SHARDS - 1)) --cpus-per-task="$PREPROCESS_CPUS"
           --output="$WORK_DIR/logs/%x-%A_%a.out")
[ -n "${PREPROCESS_TIME:-}" ] && pre_flags+=(--time="$PREPROCESS_TIME")
PRE=$(INPUT="$INPUT" NUM_SHARDS="$NUM_SHARDS" OUTPUT_PREFIX="$DATA_PREFIX_BASE" \
      sbatch "${common[@]}" "${pre_flags[@]}" slurm/preprocess.sbatch | jobid)

merge_flags=(--dependency=afterok:"$PRE" --cpus-per-task=1 --output="$WORK_DIR/logs/%x-merge-%j.out")
[ -n "${PREPROCESS_TIME:-}" ] && merge_flags+=(--time="$PREPROCESS_TIME")
MERGE=$(PREPROCESS_STEP=merge NUM_SHARDS="$NUM_SHARDS" OUTPUT_PREFIX="$DATA_PREFIX_BASE" \
        sbatch "${common[@]}" "${merge_flags[@]}" slurm/preprocess.sbatch | jobid)

pl="${PRETRAIN_LAUNCHER:-$LAUNCHER}"
# shellcheck disable=SC2046
PRETRAIN=$(LAUNCHER="$pl" CONFIG="$PRETRAIN_CONFIG" SAVE_DIR="$WORK_DIR/pretrain" DATA_PREFIX="$DATA_PREFIX" \
           TRAIN_ARGS="${PRETRAIN_ARGS:-}" \
           sbatch "${common[@]}" $(train_flags "$pl" "${PRETRAIN_TIME:-}") --dependency=afterok:"$MERGE" \
           --output="$WORK_DIR/logs/%x-%j.out" slurm/pretrain.sbatch | jobid)

CONTEXT=""
if [ -n "$CONTEXT_CONFIG" ]; then
    cl="${CONTEXT_LAUNCHER:-$LAUNCHER}"
    # shellcheck disable=SC2046
    CONTEXT=$(LAUNCHER="$cl" CONFIG="$CONTEXT_CONFIG" LOAD_DIR="$WORK_DIR/pretrain" \
              SAVE_DIR="$WORK_DIR/context_ext" DATA_PREFIX="$DATA_PREFIX" TRAIN_ARGS="${CONTEXT_ARGS:-}" \
              sbatch "${common[@]}" $(train_flags "$cl" "${CONTEXT_TIME:-}") --dependency=afterok:"$PRETRAIN" \
              --output="$WORK_DIR/logs/%x-%j.out" slurm/context_extension.sbatch | jobid)
fi

cat > "$WORK_DIR/jobs.env" <<EOT
PREPROCESS_JOB=$PRE
MERGE_JOB=$MERGE
PRETRAIN_JOB=$PRETRAIN
CONTEXT_JOB=$CONTEXT
DATA_PREFIX=$DATA_PREFIX
EOT
echo "preprocess=$PRE merge=$MERGE pretrain=$PRETRAIN context_extension=${CONTEXT:-none} (ids in $WORK_DIR/jobs.env)"
