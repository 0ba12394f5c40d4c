// Varlen flash attention on CUDA (issue 37 item 3): libtorch's
// `_flash_attention_forward` / `_flash_attention_backward` over a packed
// row's documents by their cumulative lengths, no padding, as one autograd
// function, so the backward is the kernel's own. tch binds the backward
// but not the forward (it returns five tensors, the RNG state among them),
// hence C++. Built by build.rs with the `cuda` feature (it needs only
// libtorch's headers: the CUDA kernel is found through the dispatcher at
// run time); used by `worker/src/model/varlen.rs`.
//
// The kernel's contract (aten/src/ATen/native/transformers/cuda/
// flash_attn/flash_api.cpp, `mha_varlen_fwd` / `mha_varlen_bwd`, as
// libtorch 2.13 declares the ops), checked by the caller before it calls:
// - q `[total, heads, d]`, k and v `[total, kv_heads, d]`, heads a
//   multiple of kv_heads (grouped-query attention read in place), the last
//   dimension contiguous; fp16 or bf16 (no fp32 kernel), on one CUDA
//   device of compute capability 8.0 or newer; d at most 256;
// - cu_seqlens int32 on the same device, `[documents + 1]`, from 0 to
//   total, non-decreasing; max_seqlen its largest difference;
// - causal: each document's query i sees its keys 0..=i (top-left and
//   bottom-right alignment agree when q and k are the same documents);
// - returns the output `[total, heads, d]` and the log-sum-exp
//   `[heads, total]` (float32) the backward takes with the output, plus
//   the RNG state (unused without dropout; passed back as given).
#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cstdint>
#include <cstring>
#include <exception>

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

struct VarlenFlash : public torch::autograd::Function<VarlenFlash> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, const at::Tensor& cu, int64_t max_len,
                            double scale) {
    auto result = at::_flash_attention_forward(
        q, k, v, cu, cu, max_len, max_len, /*dropout_p=*/0.0, /*is_causal=*/true,
        /*return_debug_mask=*/false, std::optional<double>(scale));
    at::Tensor out = std::get<0>(result);
    ctx->save_for_backward(
        {q, k, v, out, std::get<1>(result), cu, std::get<2>(result), std::get<3>(result)});
    ctx->saved_data["max_len"] = max_len;
    ctx->saved_data["scale"] = scale;
    return out;
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    auto s = ctx->get_saved_variables();
    const int64_t max_len = ctx->saved_data["max_len"].toInt();
    const double scale = ctx->saved_data["scale"].toDouble();
    auto g = at::_flash_attention_backward(
        grads[0].contiguous(), s[0], s[1], s[2], s[3], s[4], s[5], s[5], max_len, max_len,
        /*dropout_p=*/0.0, /*is_causal=*/true, s[6], s[7], std::optional<double>(scale));
    return {std::get<0>(g), std::get<1>(g), std::get<2>(g), at::Tensor(), at::Tensor(),
            at::Tensor()};
  }
};

void copy_message(const char* what, char* err, size_t err_len) {
  if (err_len == 0) return;
  std::strncpy(err, what, err_len - 1);
  err[err_len - 1] = '\0';
}

}  // namespace

extern "C" {

// `*out` = the attention output as a new tensor (tch takes ownership),
// carrying the autograd function. 0 on success; 1 with the error's text in
// `err` (no CUDA kernel for these inputs, a contract the kernel refuses).
int accrue_flash_varlen(at::Tensor* q, at::Tensor* k, at::Tensor* v, at::Tensor* cu,
                        int64_t max_len, double scale, at::Tensor** out, char* err,
                        size_t err_len) {
  try {
    *out = new at::Tensor(VarlenFlash::apply(*q, *k, *v, *cu, max_len, scale));
    return 0;
  } catch (const std::exception& e) {
    copy_message(e.what(), err, err_len);
    return 1;
  } catch (...) {
    copy_message("unknown C++ exception", err, err_len);
    return 1;
  }
}
}
