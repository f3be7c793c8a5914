#!/usr/bin/env bash
# Megatron-DeepSpeed's own pretrain_gpt.py with MoE, stock and on turbomoe (run_with_turbomoe, no edit
# of its source), then the MoE layer alone with its ParallelMLP experts. Run from turbomoe's root:
#
#   bash scripts/gpu_megatron_deepspeed.sh 1gpu    # one GPU: the layer timing, two MoE configurations
#   bash scripts/gpu_megatron_deepspeed.sh 2gpu    # two GPUs: tensor parallel 2 with expert parallel 2,
#                                                  # and tensor parallel 2 with expert tensor parallelism
#   bash scripts/gpu_megatron_deepspeed.sh both    # two GPUs, shortest: one-GPU pair side by side,
#                                                  # layer timing, tensor parallel 2 with expert parallel 2
#   bash scripts/gpu_megatron_deepspeed.sh expert_tp  # two GPUs: tensor parallel 2 with expert tensor
#                                                  # parallelism alone
#   bash scripts/gpu_megatron_deepspeed.sh layer   # one GPU: the layer timing alone
# MBS: micro-batch size (default 8; also the global batch: one data-parallel rank). LAYER=0: no layer timing;
# LAYER_EXPERTS: the expert counts it times (default "16 32"); LAYER_PROFILE=1: and prints each layer's kernels.
# NLAYERS, HIDDEN, HEADS, SEQ, EXPERTS: the GPT's layers, hidden size, heads, sequence length and experts
# (defaults 4, 1024, 16, 512, 16; ffn 4 x hidden; experts every other layer, Megatron-DeepSpeed's default).
# REPEAT=N: in 1gpu, 2gpu and expert_tp, each stock / turbomoe pair N times over, alternating.
# PROFILE=START,END: every run profiles those steps (its own --profile pt-full, traces under
# $OUT/trace_NAME_IMPL) and the summaries of where their time goes are printed last.
#
# PEER: a Megatron-DeepSpeed tree at the pinned commit below (git archive of
# github.com/microsoft/Megatron-DeepSpeed; megatron/, pretrain_gpt.py and tools/, which its arguments import) with wheels/ holding a
# pybind11 wheel (its dataset helpers build with it) and six (its tokenizer module imports it). WHL: DeepSpeed's wheel and its pure-Python deps.
# What the GPU machine lacks is handled here: apex (shims from scripts/megatron_deepspeed.py: its
# LayerNorm as F.layer_norm, in both runs), its fused softmax kernels (--no-masked-softmax-fusion:
# not built, torch's softmax), apex's gradient-accumulation fusion (--no-gradient-accumulation-fusion),
# python3-config (a shim for the helpers' Makefile). Data: a tiny indexed dataset written with its
# own builder, NullTokenizer. Logs under $OUT; the side-by-side tables are printed last.
set -uo pipefail
MODE=${1:-1gpu}
MDS_COMMIT=6acc370a41440098031227e881bd9f1f23aa369e  # Megatron-DeepSpeed, 2024-10-18 ('fix moe tflops'): the last commit before its attention rewrite (676a482c, FPDT) broke the non-flash attention path (a .view of a strided slice)
ROOT=$PWD
PEER=$(cd "${PEER:-$ROOT/../mds-peer}" && pwd)
WHL=$(cd "${WHL:-$ROOT/../../.whl}" && pwd)
OUT=${OUT:-/tmp/mds_out}
WORK=${WORK:-/tmp/mds_work}
ITERS=${ITERS:-30}
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1
[ "$(cat "$PEER/COMMIT" 2>/dev/null)" = "$MDS_COMMIT" ] || { echo "PEER=$PEER is not Megatron-DeepSpeed at $MDS_COMMIT"; exit 1; }
date -u

# DeepSpeed and deps (not megatron-core: Megatron-DeepSpeed brings its own megatron package).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
  $(ls "$WHL"/*.whl | grep -v -e megatron_core -e nvidia_cutlass -e liger) "$PEER"/wheels/*.whl 2>&1 | tail -2
python3 "$ROOT/scripts/megatron_deepspeed.py" shims "$WORK/shims" /tmp/site
command -v python3-config >/dev/null || export PATH=$WORK/shims/bin:$PATH
export PATH=/tmp/site/bin:$PATH
export PYTHONPATH=$PEER:$ROOT:/tmp/site:$WORK/shims
export CUDA_DEVICE_MAX_CONNECTIONS=1
# turbomoe's gating on its Triton kernels and torch's grouped GEMM: the CUDA C++ backend and the
# CUTLASS GEMM would each spend a minute or more of nvcc first (TURBOMOE_BUILD=1 builds them).
if [ "${TURBOMOE_BUILD:-0}" = 1 ]; then
  python3 -c "from turbomoe import csrc; print('turbomoe CUDA backend:', csrc.available())"
else
  export TURBOMOE_BACKEND=triton TURBOMOE_GMM_BACKEND=torch
fi
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
python3 -c "import torch, deepspeed; print('torch', torch.__version__, 'deepspeed', deepspeed.__version__, 'gpus', torch.cuda.device_count())"

# Its dataset helpers (pretrain_gpt.py runs this make too; built here once, before any timing).
make -s -C "$PEER/megatron/data" 2>&1 | tail -3
DATA=${DATA:-$WORK/data/markov}  # a carried copy saves its ~10 s of imports and writing
[ -f "$DATA.idx" ] || (mkdir -p "$WORK/data" && python3 "$ROOT/scripts/megatron_deepspeed.py" data "$DATA")
# On the H200 machine of 2026-11-23 02:07 UTC the helpers' build_sample_idx crashed (SIGSEGV, pybind11
# 3.1.0 build) in every run: call it here first, and if it crashes use Megatron-DeepSpeed's own Python
# version of it (the shims' sitecustomize; same maps) unless the maps are already in index-cache/.
(cd "$PEER" && python3 -c "
import numpy as np
from megatron.data import helpers
print('dataset helpers: numpy', np.__version__, 'sample_idx rows',
      helpers.build_sample_idx(np.full(8, 100, np.int32), np.arange(8, dtype=np.int32), 50, 1, 800).shape[0])" \
  | grep -v "^ ") || {
  echo "Megatron-DeepSpeed's dataset helpers crash here (exit $?): its Python build_sample_idx serves instead"
  export MDS_PYTHON_SAMPLE_IDX=1; }
MBS=${MBS:-8}
# ZERO=1: ZeRO stage 1 with fp32 gradient accumulation (DeepSpeed's BF16_Optimizer, as turbomoe's recipes
# run) instead of stage 0 (its FP16_Optimizer in bf16, which checks each parameter for overflow with a host read).
ACCUM=""
[ "${ZERO:-0}" = 1 ] && ACCUM=', "data_types": {"grad_accum_dtype": "fp32"}'
cat > "$WORK/ds.json" <<EOF
{"train_batch_size": $MBS, "train_micro_batch_size_per_gpu": $MBS, "steps_per_print": 100000,
 "gradient_clipping": 1.0, "zero_optimization": {"stage": ${ZERO:-0}}, "bf16": {"enabled": true},
 "wall_clock_breakdown": false$ACCUM}
EOF

SEQ=${SEQ:-512}
GPT="--num-layers ${NLAYERS:-4} --hidden-size ${HIDDEN:-1024} --num-attention-heads ${HEADS:-16} --seq-length $SEQ
 --max-position-embeddings $SEQ
 --micro-batch-size $MBS --global-batch-size $MBS --train-iters $ITERS --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine
 --lr-warmup-iters 5 --weight-decay 0.1 --clip-grad 1.0 --init-method-std 0.02 --hidden-dropout 0
 --attention-dropout 0 --tokenizer-type NullTokenizer --vocab-size 1024 --data-path $DATA --split 98,2,0
 --bf16 --log-interval 1 --eval-interval 100000 --eval-iters 0 --seed 1234 --num-workers 0
 --no-masked-softmax-fusion --no-gradient-accumulation-fusion --no-pipeline-parallel --distributed-backend nccl"
DS="--deepspeed --deepspeed_config $WORK/ds.json"
MOE="--num-experts ${EXPERTS:-16} --topk 2 --moe-train-capacity-factor 1.0 --moe-eval-capacity-factor 1.0 --moe-min-capacity 4
 --moe-loss-coeff 0.01 --create-moe-param-group --disable-moe-top2-2nd-expert-sampling"
PORT=29611

train() {  # train NAME GPUS stock|turbo EXTRA_ARGS...: pretrain_gpt.py through DeepSpeed's launcher.
  # GPUS: a count (--num_gpus), or localhost:I to run on GPU I alone (two one-GPU runs side by side;
  # the port then depends on I: a background job's PORT increment is not seen by the next job).
  local name=$1 gpus=$2 impl=$3; shift 3
  local module="" where="--num_gpus $gpus"
  [ "$impl" = turbo ] && module="--module turbomoe.integrations.run_with_turbomoe"
  [[ "$gpus" == localhost:* ]] && where="--include $gpus"
  [ -n "${PROFILE:-}" ] && set -- "$@" --profile pt-full --profile_steps "$PROFILE" --tensorboard-dir "$OUT/trace_${name}_$impl"
  PORT=$((PORT + 10 + ${gpus#localhost:}))
  echo "== $name $impl: deepspeed $where $module pretrain_gpt.py $MOE $*" | tr -s ' \n' ' '; echo
  (cd "$PEER" && timeout "${RUN_TIMEOUT:-170}" python3 -m deepspeed.launcher.runner $where \
     --master_port $PORT $module pretrain_gpt.py $GPT $MOE $DS "$@") > "$OUT/${name}_$impl.log" 2>&1
  echo "   $name $impl: exit $? ($(grep -c 'lm loss' "$OUT/${name}_$impl.log") logged steps)"; date -u
  grep -m3 -E "Error|error:|Traceback" "$OUT/${name}_$impl.log" | head -3
}

layer() {  # the MoE layer alone (one process: Megatron's initialize without the launcher), on GPU $1
  (cd "$PEER" && CUDA_VISIBLE_DEVICES=$1 RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29610 \
     timeout "${LAYER_TIMEOUT:-150}" python3 "$ROOT/scripts/megatron_deepspeed.py" layer --experts ${LAYER_EXPERTS:-16 32} --tokens 8192 ${LAYER_PROFILE:+--profile} \
     --json "$OUT/layer.json" $GPT $MOE --moe-expert-parallel-size 1) > "$OUT/layer.log" 2>&1
  echo "== layer: exit $?"; date -u
}

ONE="--moe-expert-parallel-size 1"
DROPLESS_RESIDUAL="--moe-expert-parallel-size 1 --disable-moe-token-dropping --mlp-type residual"
TP2_EP2="--tensor-model-parallel-size 2 --moe-expert-parallel-size 2"
TP2_ETP="--tensor-model-parallel-size 2 --moe-expert-parallel-size 1 --enable-expert-tensor-parallelism"
SUMMARY=()
pair() {  # pair NAME GPUS ARGS...: stock, then turbomoe, REPEAT times (default 1: alternating pairs put a
  # spread on a host-bound ratio), each pair into the summary (NAME_1, NAME_2, ... when repeated)
  local name=$1 gpus=$2 run r impl; shift 2
  for r in $(seq "${REPEAT:-1}"); do
    run=$name; [ "${REPEAT:-1}" -gt 1 ] && run=${name}_$r
    for impl in stock turbo; do train "$run" "$gpus" $impl "$@"; done
    SUMMARY+=("$run" "$OUT/${run}_stock.log" "$OUT/${run}_turbo.log")
  done
}
case "$MODE" in
  1gpu)  # one GPU, one run at a time (LAYER=0: without the layer timing)
    [ "${LAYER:-1}" = 1 ] && layer 0
    pair capacity 1 $ONE
    pair dropless_residual 1 $DROPLESS_RESIDUAL ;;
  2gpu)  # two GPUs: TP 2 with EP 2, then TP 2 with expert tensor parallelism (EXPERT_TP=0: not that)
    pair tp2_ep2 2 $TP2_EP2
    [ "${EXPERT_TP:-1}" = 1 ] && pair tp2_expert_tp 2 $TP2_ETP ;;
  both)  # one call on two GPUs: the one-GPU pair side by side (stock on GPU 0, turbomoe on GPU 1),
         # the layer timing, then TP 2 with EP 2
    train capacity localhost:0 stock $ONE & train capacity localhost:1 turbo $ONE & wait
    SUMMARY+=(capacity "$OUT/capacity_stock.log" "$OUT/capacity_turbo.log")
    [ "${LAYER:-1}" = 1 ] && layer 0
    pair tp2_ep2 2 $TP2_EP2 ;;
  expert_tp)  # two GPUs: TP 2 with expert tensor parallelism alone
    pair tp2_expert_tp 2 $TP2_ETP ;;
  layer)  # one GPU: the MoE layer alone (how much of a step the MoE layers can take)
    layer 0 ;;
  *) echo "usage: $0 1gpu|2gpu|both|expert_tp|layer"; exit 2 ;;
esac
[ ${#SUMMARY[@]} -gt 0 ] && python3 "$ROOT/scripts/megatron_deepspeed.py" summary "${SUMMARY[@]}" | tee "$OUT/summary.txt"
[ -f "$OUT/layer.log" ] && { [ -n "${LAYER_PROFILE:-}" ] && grep -A21 "kernel time" "$OUT/layer.log"; sed -n '/^weight gradients/,$p' "$OUT/layer.log"; }
[ -n "${PROFILE:-}" ] && python3 "$ROOT/scripts/megatron_deepspeed.py" trace "$OUT"/trace_* | tee "$OUT/trace_summary.txt"
date -u
