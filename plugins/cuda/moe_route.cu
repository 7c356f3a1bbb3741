// The MoE router on the device (MOE_ROUTE): scores, group-limited top-k and the routing weights;
// and MOE_ROUTE_EXPERTS' entry, whose expert kernels (moe.cu) route one token themselves.
#include "common.h"
#include "device_utils.cuh"
#include "moe_route.cuh"

#include <algorithm>
#include <cmath>

namespace xcuda {
namespace {

// ---- router --------------------------------------------------------------------------------------

// One block per token (route_token, moe_route.cuh).
__global__ void route_kernel(const float* logits /*[T, E]*/, const float* bias /*[E] or null*/, int E,
                             xinfer_route_params p, int32_t* ids /*[T, top_k]*/, float* weights /*[T, top_k]*/) {
    extern __shared__ __align__(16) float smem[];
    pdl_begin();
    const int64_t t = blockIdx.x;
    const RouteScratch s = route_scratch_at(smem, E, p.n_group, p.top_k);
    route_token(logits + t * E, bias, E, p, s, true);
    for (int i = threadIdx.x; i < p.top_k; i += blockDim.x) {
        ids[t * p.top_k + i] = s.chosen[i];
        weights[t * p.top_k + i] = s.weight[i];
    }
}

}  // namespace

size_t route_smem_bytes(int E, const xinfer_route_params& rp) {
    return size_t(route_scratch_words(E, rp.n_group, rp.top_k)) * 4;
}

int check_route(Context* c, const xinfer_op* op, const xinfer_tensor& logits, const xinfer_tensor& bias,
                const xinfer_route_params& rp) {
    if (logits.dtype != XINFER_DTYPE_F32 || logits.rank != 2)
        return unsupported(c, op, "logits %s must be f32 [T, E]", shape_str(logits).c_str());
    const int64_t E = logits.shape[1];
    if (!absent(bias) && (bias.dtype != XINFER_DTYPE_F32 || numel(bias) != E))
        return unsupported(c, op, "bias %s must be f32 [%lld]", shape_str(bias).c_str(), (long long)E);
    if (rp.scoring != 0 && rp.scoring != 1) return unsupported(c, op, "scoring %d (0 softmax, 1 sigmoid)", rp.scoring);
    if (rp.n_group < 1 || E % rp.n_group != 0 || rp.topk_group < 1 || rp.topk_group > rp.n_group)
        return unsupported(c, op, "n_group %d must divide E=%lld and topk_group %d be in [1, n_group]", rp.n_group,
                           (long long)E, rp.topk_group);
    if (rp.top_k < 1 || rp.top_k > 64 || rp.top_k > rp.topk_group * (E / rp.n_group))
        return unsupported(c, op, "top_k %d must be in [1, min(64, topk_group x experts per group = %lld)]", rp.top_k,
                           (long long)(rp.topk_group * (E / rp.n_group)));
    if (E > 16384 || route_smem_bytes(int(E), rp) > 48 * 1024)
        return unsupported(c, op, "E=%lld experts exceed the router's shared memory", (long long)E);
    return XINFER_OK;
}

int op_moe_route(Context* c, const xinfer_op* op, bool run) {
    const xinfer_tensor &logits = op->src[0], &bias = op->src[1], &ids = op->dst[0], &weights = op->dst[1];
    const xinfer_route_params& rp = op->params.route;
    if (int rc = check_route(c, op, logits, bias, rp)) return rc;
    const int64_t T = logits.shape[0], E = logits.shape[1];
    if (ids.dtype != XINFER_DTYPE_I32 || weights.dtype != XINFER_DTYPE_F32 || ids.rank != 2 || weights.rank != 2 ||
        ids.shape[0] != T || ids.shape[1] != rp.top_k || weights.shape[0] != T || weights.shape[1] != rp.top_k)
        return unsupported(c, op, "ids %s / weights %s must be i32 / f32 [T=%lld, top_k=%d]", shape_str(ids).c_str(),
                           shape_str(weights).c_str(), (long long)T, rp.top_k);
    if (!run || T == 0) return XINFER_OK;
    const int threads = int(std::min<int64_t>(256, std::max<int64_t>(32, ceil_div(E, 32) * 32)));
    return launch_pdl(c, "route_kernel", route_kernel, dim3(unsigned(T)), dim3(threads), route_smem_bytes(int(E), rp),
                      static_cast<const float*>(logits.data),
                      absent(bias) ? nullptr : static_cast<const float*>(bias.data), int(E), rp,
                      static_cast<int32_t*>(ids.data), static_cast<float*>(weights.data));
}

// XINFER_CUDA_ROUTE_EXPERTS=0: MOE_ROUTE_EXPERTS answers supports_op 0, so xinfer runs MOE_ROUTE
// (its own launch) and MOE_EXPERTS (A/B).
bool route_experts_enabled() {
    static const bool enabled = env_flag("XINFER_CUDA_ROUTE_EXPERTS", true);
    return enabled;
}

// One token over FP8 experts (moe.cu): the gate_up kernel's blocks each route the token before
// their first weight request (instead of reading the ids after the router's own launch), and the
// down kernel routes it again before its PDL wait, for its plan and the combine's weights. Both
// read the same complete logits and compute the same ranks, so they agree.
int op_moe_route_experts(Context* c, const xinfer_op* op, bool run) {
    const xinfer_tensor &logits = op->src[1], &bias = op->src[2], &gate_up = op->src[3];
    const auto& p = op->params.route_experts;
    if (!route_experts_enabled()) return unsupported(c, op, "XINFER_CUDA_ROUTE_EXPERTS=0");
    if (int rc = check_route(c, op, logits, bias, p.route)) return rc;
    if (gate_up.rank != 3 || gate_up.shape[0] != logits.shape[1])
        return unsupported(c, op, "logits %s must have one column per expert of gate_up %s", shape_str(logits).c_str(),
                           shape_str(gate_up).c_str());
    // The experts' op, with ids and weights of the router's shape and no data (the kernels route).
    xinfer_op experts = *op;
    experts.type = XINFER_OP_MOE_EXPERTS;
    experts.src[1] = xinfer_tensor{nullptr, XINFER_DTYPE_I32, 2, {logits.shape[0], p.route.top_k}};
    experts.src[2] = xinfer_tensor{nullptr, XINFER_DTYPE_F32, 2, {logits.shape[0], p.route.top_k}};
    experts.params.matmul.block_rows = p.block_rows;
    experts.params.matmul.block_cols = p.block_cols;
    const RouteArgs route{static_cast<const float*>(logits.data),
                          absent(bias) ? nullptr : static_cast<const float*>(bias.data), p.route, 0};
    return run_moe_experts(c, &experts, run, &route);
}

}  // namespace xcuda
