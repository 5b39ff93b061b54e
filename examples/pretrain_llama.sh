#!/usr/bin/env bash
# Llama-300M / Llama-600M pretraining recipes (the GIFT paper's setups) with megatron-gift.
#
#   MODEL=300m|600m VARIANT=fp32|bf16|euclidean|gift|auto DATA_PATH=... bash examples/pretrain_llama.sh [extra flags]
#   DRY_RUN=1 ... (or --dry-run as the first argument): print the command and exit.
#
# Runs on one node of a multi-node job; start it on every node with the same environment and
# that node's NODE_RANK. Extra arguments are appended to the command (later flags win; the batch
# and parallel sizes among them are also what the batch check uses). It prints, on stderr, the
# planner command that models this run (megatron-gift model).
#
# Model (MODEL): 300m: 24 layers, hidden 1024, 16 heads, FFN 2736, seq 4096;
#                600m: 32 layers, hidden 1280, 20 heads, FFN 3456, seq 2048.
# Both: RoPE, SwiGLU, RMSNorm, no bias, untied embeddings, Megatron's local transformer layers,
# bf16, distributed optimizer, overlapped gradient reduce-scatter and parameter all-gather.
#
# Variant (VARIANT), what the data-parallel gradient reduction sends (examples/README.md):
#   fp32       FP32 gradients, Megatron's own reduce-scatter (Megatron's default with --bf16:
#              --gift-mode off, megatron-gift changes nothing);
#   bf16       BF16 gradients, Megatron's own --grad-reduce-in-bf16 (--gift-mode off): the BF16
#              baseline Megatron users compare with (its gradient buffer, and so micro-batch
#              accumulation, is BF16 too);
#   euclidean  [default] linear-layer weight gradients as plain FP8 (E4M3, 1x128 block scales),
#              the other parameters FP32, summed in FP32;
#   gift       the paper's selection: mlp.linear_fc2 as GIFT-whitened FP8, the other linear
#              weights as plain FP8, the rest FP32; plus GIFT's statistics and factor traffic;
#   auto       every linear weight as GIFT FP8, plain FP8 or BF16, chosen per layer by measurement
#              (--gift-layers auto), the rest FP32; plus the statistics of all candidates.
#   Add GIFT_ARGS="--gift-fp8-format e5m2 --gift-scaling tensor" for the paper's own codec.
#
# Environment (defaults in brackets):
#   NNODES [1]  GPUS_PER_NODE [8]  NODE_RANK [0]  MASTER_ADDR [localhost]  MASTER_PORT [6000]
#   CLUSTER [gh200 with 4 GPUs per node, else h100]  the planner's machine preset (megatron-gift model --cluster)
#   TP [1]  PP [1]              tensor / pipeline parallel sizes (DP = NNODES*GPUS_PER_NODE/(TP*PP))
#   GLOBAL_BATCH [512]  MICRO_BATCH [4, or the largest of 2, 1 with GLOBAL_BATCH a multiple of it x DP]
#   TRANSFORMER_IMPL [local]    --transformer-impl: local (Megatron's own layers, what the plugin is
#                               tested with) or transformer_engine
#   DATA_PATH                   Megatron indexed-dataset prefix (e.g. /data/owt/owt_text_document);
#                               MOCK_DATA=1 trains on Megatron's mock data instead
#   TOKENIZER_TYPE [HuggingFaceTokenizer]  TOKENIZER_MODEL [gpt2]  the tokenizer DATA_PATH was made with
#   TRAIN_ITERS [300m: 3000, 600m: 12000]  (about 6B / 12B tokens)   LR [3e-4]  MIN_LR [3e-5]
#   WARMUP_ITERS [TRAIN_ITERS/20]  SAVE_DIR (unset: no checkpoints)  LOG_INTERVAL [10]
#   TELEMETRY_DIR [SAVE_DIR, else runs/llama-MODEL-VARIANT]: gift_telemetry.jsonl (--gift-log-interval)
#   GIFT_ARGS                   extra --gift-* flags (e.g. "--gift-rank 16 --gift-log-interval 100")
#   PYTHON [python]  (torchrun is run as: $PYTHON -m torch.distributed.run)
set -euo pipefail

dry_run=${DRY_RUN:-0}
if [[ ${1:-} == --dry-run ]]; then
    dry_run=1
    shift
fi

MODEL=${MODEL:-300m}
VARIANT=${VARIANT:-euclidean}
case $MODEL in
    300m) model=(--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --ffn-hidden-size 2736)
          seq=4096 iters=3000 ;;
    600m) model=(--num-layers 32 --hidden-size 1280 --num-attention-heads 20 --ffn-hidden-size 3456)
          seq=2048 iters=12000 ;;
    *) echo "pretrain_llama.sh: MODEL must be 300m or 600m, got '$MODEL'" >&2; exit 2 ;;
esac
case $VARIANT in
    fp32) gift=(--gift-mode off) ;;
    bf16) gift=(--gift-mode off --grad-reduce-in-bf16) ;;
    euclidean) gift=(--gift-mode euclidean) ;;
    gift) gift=(--gift-mode gift --gift-layers '\.mlp\.linear_fc2\.weight$'
                --gift-euclidean-layers '\.linear_(qkv|proj|fc1)\.weight$') ;;
    auto) gift=(--gift-mode gift --gift-layers auto) ;;
    *) echo "pretrain_llama.sh: VARIANT must be fp32, bf16, euclidean, gift or auto, got '$VARIANT'" >&2; exit 2 ;;
esac
read -r -a gift_extra <<<"${GIFT_ARGS:-}"

NNODES=${NNODES:-1} GPUS_PER_NODE=${GPUS_PER_NODE:-8} TP=${TP:-1} PP=${PP:-1} GLOBAL_BATCH=${GLOBAL_BATCH:-512}
micro_batch=${MICRO_BATCH:-}
args=("$@")
for ((i = 0; i + 1 < ${#args[@]}; i++)); do  # appended flags win: the check below uses their values
    case ${args[i]} in
        --micro-batch-size) micro_batch=${args[i + 1]} ;;
        --global-batch-size) GLOBAL_BATCH=${args[i + 1]} ;;
        --tensor-model-parallel-size) TP=${args[i + 1]} ;;
        --pipeline-model-parallel-size) PP=${args[i + 1]} ;;
    esac
done
world=$((NNODES * GPUS_PER_NODE))
if ((world % (TP * PP))); then
    echo "pretrain_llama.sh: $world GPUs are not divisible by TP*PP = $((TP * PP))" >&2; exit 2
fi
dp=$((world / (TP * PP)))
if [[ -z $micro_batch ]]; then  # the largest of 4, 2, 1 that fits the global batch at this DP size
    for micro_batch in 4 2 1; do
        ((GLOBAL_BATCH % (micro_batch * dp))) || break
    done
fi
MICRO_BATCH=$micro_batch
if ((GLOBAL_BATCH % (MICRO_BATCH * dp))); then
    echo "pretrain_llama.sh: global batch $GLOBAL_BATCH is not a multiple of micro-batch $MICRO_BATCH x DP $dp" >&2
    exit 2
fi
TRAIN_ITERS=${TRAIN_ITERS:-$iters}

if [[ ${MOCK_DATA:-0} == 1 ]]; then
    data=(--mock-data)
elif [[ -n ${DATA_PATH:-} ]]; then
    data=(--data-path "$DATA_PATH" --split 949,50,1)
elif [[ $dry_run == 1 ]]; then
    data=(--data-path '${DATA_PATH}' --split 949,50,1)
else
    echo "pretrain_llama.sh: set DATA_PATH to an indexed-dataset prefix (see examples/README.md) or MOCK_DATA=1" >&2
    exit 2
fi
parallel=(--tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP")
((TP > 1)) && parallel+=(--sequence-parallel)
ckpt=()
[[ -n ${SAVE_DIR:-} ]] && ckpt=(--save "$SAVE_DIR" --load "$SAVE_DIR" --save-interval 1000)

cmd=(
    "${PYTHON:-python}" -m torch.distributed.run
    --nnodes "$NNODES" --nproc-per-node "$GPUS_PER_NODE" --node-rank "${NODE_RANK:-0}"
    --master-addr "${MASTER_ADDR:-localhost}" --master-port "${MASTER_PORT:-6000}"
    -m megatron_gift.pretrain_gpt
    "${model[@]}" --seq-length "$seq" --max-position-embeddings "$seq"
    --position-embedding-type rope --rotary-base 10000 --swiglu --normalization RMSNorm
    --disable-bias-linear --untie-embeddings-and-output-weights --transformer-impl "${TRANSFORMER_IMPL:-local}"
    --attention-dropout 0.0 --hidden-dropout 0.0 --init-method-std 0.02
    --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH" --train-iters "$TRAIN_ITERS"
    --bf16 --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
    "${parallel[@]}"
    --optimizer adam --adam-beta1 0.9 --adam-beta2 0.95 --weight-decay 0.1 --clip-grad 1.0
    --lr "${LR:-3e-4}" --min-lr "${MIN_LR:-3e-5}" --lr-decay-style cosine
    --lr-warmup-iters "${WARMUP_ITERS:-$((TRAIN_ITERS / 20))}"
    "${data[@]}" --tokenizer-type "${TOKENIZER_TYPE:-HuggingFaceTokenizer}"
    --tokenizer-model "${TOKENIZER_MODEL:-gpt2}"
    --log-interval "${LOG_INTERVAL:-10}" --log-throughput --eval-interval 1000 --eval-iters 10
    "${ckpt[@]}" --gift-telemetry-dir "${TELEMETRY_DIR:-${SAVE_DIR:-runs/llama-$MODEL-$VARIANT}}"
    "${gift[@]}" "${gift_extra[@]}"
    "$@"
)

case $VARIANT in euclidean) plan=euclidean-2level ;; gift | auto) plan=gift-2level ;; *) plan=$VARIANT ;; esac
cluster=${CLUSTER:-$([[ $GPUS_PER_NODE == 4 ]] && echo gh200 || echo h100)}
echo "pretrain_llama.sh: this run in the planner (row $plan): megatron-gift model --model $MODEL --gpus $world" \
    "--cluster $cluster --gpus-per-node $GPUS_PER_NODE --tp $TP --pp $PP --micro-batch $MICRO_BATCH" \
    "--global-batch $GLOBAL_BATCH" \
    "--fp8-params linear --gift-schedule lagged" >&2
if [[ $dry_run == 1 ]]; then
    printf '%q ' "${cmd[@]}"
    echo
    exit 0
fi
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
exec "${cmd[@]}"
