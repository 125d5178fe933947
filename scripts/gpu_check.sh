#!/usr/bin/env bash
# mlx-spec at real size on a machine with a GPU (MLX's CUDA backend, or Metal), in one go:
#
#   scripts/gpu_check.sh [OUT]          (default OUT: gpu-check)
#
# 1. widens the demo to ~3B parameters in bfloat16 (scripts/widen_demo.py: same function, real size);
# 2. greedy exactness per drafter: `mlx-spec generate --check` on the widened target, each drafter, by default
#    and with --exact (every forward one width: bit for bit where the start-up probe passes);
# 3. `mlx-spec bench` at temperatures 0 and 1, one sequence and --concurrency 1,4,16: every method's
#    ratio to plain decoding and mlx-lm's, the verification cost curve, the host's work a round.
# It prints as it goes and writes OUT/bench.json and OUT/bench.txt. About 8 minutes on an H200.
# Smaller runs (a CPU, a test): WIDEN="--hidden 384 --heads 6 --intermediate 1024 --layers 10
# --dtype float32" TOKENS=8 PROMPTS=1 CONCURRENCY=1,2 DRAFTERS="student lookup" BENCH_ARGS=--no-mlx-lm.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-gpu-check}
WIDEN=${WIDEN:---size 3b --dtype bfloat16}
TOKENS=${TOKENS:-64}
PROMPTS=${PROMPTS:-4}
CONCURRENCY=${CONCURRENCY:-1,4,16}
DRAFTERS=${DRAFTERS:-student eagle3 dflash lookup suffix}  # the demo's, widened (lookup and suffix need nothing)
mkdir -p "$OUT"
W="$OUT/widened"
step() { printf '\n== %s (%ds)\n' "$*" "$SECONDS"; }

step "device"
mlx-spec doctor

step "widening the demo: $WIDEN"
# shellcheck disable=SC2086  # WIDEN holds several flags
python3 scripts/widen_demo.py "$W" $WIDEN

specs=()
for kind in $DRAFTERS; do
  case $kind in
    student) specs+=("draft=$W/student") ;;
    lookup|suffix) specs+=("$kind") ;;
    *) specs+=("$kind=$W/$kind") ;;
  esac
done
step "greedy exactness, each drafter against plain decoding ($TOKENS tokens), by default and with --exact"
python3 - "$W/target" "$TOKENS" "${specs[@]}" <<'PY'
import sys
from mlx_spec import api, exact
target, n = api.load(sys.argv[1]), int(sys.argv[2])
prompt = api.prompt_ids(target, "def is_prime(n):\n", chat_template=False)
for spec in sys.argv[3:]:
    drafter = api.drafter(spec, target)
    for width, mode in ((None, "(default)"), (api.exact_width(target, [drafter]), "--exact")):
        plain = api.generate(target, prompt, max_tokens=n, width=width).tokens
        out = api.generate(target, prompt, drafter.new_session(), max_tokens=n, width=width)
        parted = exact.parted(target.model, prompt, plain, out.tokens)
        print(f"{spec} {mode}: identical to plain: {plain == out.tokens}" +
              (f" (parted at token {parted[0] + 1}, top-2 margin {parted[1]:.2g})" if parted else "") +
              f", tau {out.metrics.tau:.2f}", flush=True)
PY

step "mlx-spec bench: $PROMPTS code prompts x $TOKENS tokens, temperatures 0 and 1, --concurrency $CONCURRENCY"
# shellcheck disable=SC2086  # BENCH_ARGS holds several flags
mlx-spec bench --model "$W/target" --drafters "$(IFS=,; echo "${specs[*]}")" --prompts code \
  --num-prompts "$PROMPTS" --max-tokens "$TOKENS" --repeats 1 --temps 0 1 --concurrency "$CONCURRENCY" \
  --json "$OUT/bench.json" ${BENCH_ARGS:-} | tee "$OUT/bench.txt"
step "done: $OUT/bench.json, $OUT/bench.txt"
