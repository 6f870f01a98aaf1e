// Single-pass loss kernels. One generic kernel per job (reduce, pointwise,
// pointwise backward), parameterised by the loss and the dtype pair.
#include <algorithm>

#include "launch.h"
#include "dtypes.cuh"
#include "losses.cuh"
#include "elementwise.cuh"
#include "exact_sum.cuh"

namespace fusedloss {

// Which gradients a kernel writes, fixed at compile time: a kernel that might
// write the target's gradient needs registers for it, and the common cases
// (none, or the input's) then fit 32 registers (8 blocks per SM) without
// spilling. With kInputAndTarget the input's pointer may still be null.
enum class Grads { kNone, kInput, kInputAndTarget };

template <Grads kGrads, typename In, typename Tgt>
struct GradPointers {
  In* __restrict__ grad_input;
  Tgt* __restrict__ grad_target;
  __device__ __forceinline__ bool writes_input() const {
    return kGrads == Grads::kInput || (kGrads == Grads::kInputAndTarget && grad_input != nullptr);
  }
  static constexpr bool kWritesTarget = kGrads == Grads::kInputAndTarget;
};

// The vector width covers 16 bytes of the narrower operand; one chunk per
// thread and tile unless an op says otherwise.
template <class Loss, typename In, typename Tgt>
struct PairOp {
  using T = opmath_t<In, Tgt>;
  using InT = In;
  using TgtT = Tgt;
  using Out = std::conditional_t<Loss::kOutputHasInputDtype, In, typename Promote<In, Tgt>::type>;
  static constexpr int kVec = 16 / (sizeof(In) < sizeof(Tgt) ? sizeof(In) : sizeof(Tgt));
  static constexpr int kChunksPerThread = 1;
  static constexpr int kChunksInFlight = 1;

  template <int W>
  struct Chunk {
    alignas(16) In input[W];
    alignas(16) Tgt target[W];
    alignas(16) Out grad_output[W];  // used by the pointwise backward only
  };

  const In* __restrict__ input;
  const Tgt* __restrict__ target;
  LossParam<T> param;              // in the loss's dtype
  LossParam<T> input_grad_param;   // in the dtype d loss / d input is computed in
  LossParam<T> target_grad_param;  // in the dtype d loss / d target is computed in

  // The dtypes PyTorch computes the gradients in (see Loss::kGradInOwnDtype).
  using InputGradDtype = std::conditional_t<Loss::kGradInOwnDtype, In, Out>;
  using TargetGradDtype = std::conditional_t<Loss::kGradInOwnDtype, Tgt, Out>;

  // v as PyTorch's kernels see it when they compute in dtype D (Huber's forward
  // narrows the target to the input's dtype; an fp16 gradient sees 1e30 as inf).
  template <typename D, typename V>
  __device__ __forceinline__ static T in_dtype(const V& v) {
    if constexpr (std::is_same_v<V, D> || sizeof(V) < sizeof(D)) {
      return to_opmath(v);
    } else {
      return to_opmath(Convert<D>::from(to_opmath(v)));
    }
  }
  // input - target computed in dtype D, held as PyTorch's fp16 kernels hold it.
  template <typename D>
  __device__ __forceinline__ static T diff_in(const In& x, const Tgt& y) {
    return fp16_intermediate<D>(in_dtype<D>(x) - in_dtype<D>(y));
  }
  __device__ __forceinline__ T value(const In& x, const Tgt& y) const {
    return Loss::template value<Out>(diff_in<Out>(x, y), param);
  }
  __device__ __forceinline__ T input_grad(const In& x, const Tgt& y) const {
    return Loss::grad(diff_in<InputGradDtype>(x, y), input_grad_param);
  }
  __device__ __forceinline__ T target_grad(const In& x, const Tgt& y) const {
    if constexpr (std::is_same_v<InputGradDtype, TargetGradDtype>) {
      return -input_grad(x, y);  // the same computation: let the compiler share it
    } else {
      return -Loss::grad(diff_in<TargetGradDtype>(x, y), target_grad_param);
    }
  }
  // The gradients times `factor`, each rounded once into its storage dtype.
  __device__ __forceinline__ In rounded_input_grad(const In& x, const Tgt& y, T factor) const {
    return Convert<In>::from(input_grad(x, y) * factor);
  }
  __device__ __forceinline__ Tgt rounded_target_grad(const In& x, const Tgt& y, T factor) const {
    return Convert<Tgt>::from(target_grad(x, y) * factor);
  }
  template <int W>
  __device__ __forceinline__ void load_pair(Chunk<W>& c, int64_t first) const {
    load_chunk(c.input, input, first);
    load_chunk(c.target, target, first);
  }
};

// Loss sums (per thread, then per tile), plus the gradients (times grad_scale) that kGrads names.
// A thread takes two chunks per tile where they fit 64 bytes: a read-only
// pass's blocks retire so fast that per-block work would show. A pass that
// writes gradients loads them one after the other (both at once spill at 32
// registers), but its tiles and sums are the same, so the loss has the same
// bits whichever gradients are written.
template <class Loss, typename In, typename Tgt, Grads kGrads>
struct ReducedLossOp : PairOp<Loss, In, Tgt>, GradPointers<kGrads, In, Tgt> {
  using Base = PairOp<Loss, In, Tgt>;
  using typename Base::T;
  template <int W>
  using Chunk = typename Base::template Chunk<W>;
  static constexpr int kChunksPerThread = Base::kVec * (sizeof(In) + sizeof(Tgt)) <= 32 ? 2 : 1;
  static constexpr int kChunksInFlight = kGrads == Grads::kNone ? kChunksPerThread : 1;

  T grad_scale;
  double sum;

  template <int W>
  __device__ __forceinline__ void load(Chunk<W>& c, int64_t first) const { this->load_pair(c, first); }

  // One rounding from the fp32 product into each gradient's storage dtype; one
  // loop, so no value outlives its element (register pressure).
  template <int W>
  __device__ __forceinline__ void apply(const Chunk<W>& c, int64_t first) {
    T chunk_sum = 0;
    alignas(16) In gi[W];
    alignas(16) Tgt gt[W];
#pragma unroll
    for (int k = 0; k < W; ++k) {
      chunk_sum += this->value(c.input[k], c.target[k]);
      if (this->writes_input()) gi[k] = this->rounded_input_grad(c.input[k], c.target[k], grad_scale);
      if constexpr (this->kWritesTarget) gt[k] = this->rounded_target_grad(c.input[k], c.target[k], grad_scale);
    }
    sum += double(chunk_sum);
    if (this->writes_input()) store_chunk(this->grad_input, first, gi);
    if constexpr (this->kWritesTarget) store_chunk(this->grad_target, first, gt);
  }
};

template <class Loss, typename In, typename Tgt>
struct PointwiseLossOp : PairOp<Loss, In, Tgt> {
  using Base = PairOp<Loss, In, Tgt>;
  using typename Base::T;
  using typename Base::Out;
  template <int W>
  using Chunk = typename Base::template Chunk<W>;

  Out* __restrict__ out;

  template <int W>
  __device__ __forceinline__ void load(Chunk<W>& c, int64_t first) const { this->load_pair(c, first); }

  template <int W>
  __device__ __forceinline__ void apply(const Chunk<W>& c, int64_t first) const {
    alignas(16) Out values[W];
#pragma unroll
    for (int k = 0; k < W; ++k) {
      values[k] = Convert<Out>::from(this->value(c.input[k], c.target[k]));
    }
    store_chunk(out, first, values);
  }
};

// The gradients of reduction='none' that kGrads names.
template <class Loss, typename In, typename Tgt, Grads kGrads>
struct PointwiseLossBackwardOp : PairOp<Loss, In, Tgt>, GradPointers<kGrads, In, Tgt> {
  using Base = PairOp<Loss, In, Tgt>;
  using typename Base::T;
  using typename Base::Out;
  template <int W>
  using Chunk = typename Base::template Chunk<W>;

  const Out* __restrict__ grad_output;
  bool grad_output_is_scalar;

  template <int W>
  __device__ __forceinline__ void load(Chunk<W>& c, int64_t first) const {
    this->load_pair(c, first);
    if (!grad_output_is_scalar) load_chunk(c.grad_output, grad_output, first);
  }

  template <int W>
  __device__ __forceinline__ void apply(const Chunk<W>& c, int64_t first) const {
    alignas(16) In gi[W];
    alignas(16) Tgt gt[W];
#pragma unroll
    for (int k = 0; k < W; ++k) {
      const T go = to_opmath(grad_output_is_scalar ? grad_output[0] : c.grad_output[k]);
      if (this->writes_input()) gi[k] = this->rounded_input_grad(c.input[k], c.target[k], go);
      if constexpr (this->kWritesTarget) gt[k] = this->rounded_target_grad(c.input[k], c.target[k], go);
    }
    if (this->writes_input()) store_chunk(this->grad_input, first, gi);
    if constexpr (this->kWritesTarget) store_chunk(this->grad_target, first, gt);
  }
};

// v times factor, rounded once into v's dtype: how backward scales a fused gradient.
template <typename S, typename T>
__device__ __forceinline__ S rounded_product(S v, T factor) {
  return Convert<S>::from(to_opmath(v) * factor);
}

// The gradients of a mean or sum for a one-element grad_output, recomputed from
// input and target: the fused forward's gradients (times grad_scale, rounded)
// times grad_output, rounded again, as scaling those in place does. Either way
// gives the same bits.
template <class Loss, typename In, typename Tgt, Grads kGrads>
struct ReducedLossBackwardOp : PairOp<Loss, In, Tgt>, GradPointers<kGrads, In, Tgt> {
  using Base = PairOp<Loss, In, Tgt>;
  using typename Base::T;
  using typename Base::Out;
  template <int W>
  using Chunk = typename Base::template Chunk<W>;

  T grad_scale;
  const Out* __restrict__ grad_output;

  template <int W>
  __device__ __forceinline__ void load(Chunk<W>& c, int64_t first) const { this->load_pair(c, first); }

  template <int W>
  __device__ __forceinline__ void apply(const Chunk<W>& c, int64_t first) const {
    const T go = to_opmath(*grad_output);
    alignas(16) In gi[W];
    alignas(16) Tgt gt[W];
#pragma unroll
    for (int k = 0; k < W; ++k) {
      if (this->writes_input()) {
        gi[k] = rounded_product(this->rounded_input_grad(c.input[k], c.target[k], grad_scale), go);
      }
      if constexpr (this->kWritesTarget) {
        gt[k] = rounded_product(this->rounded_target_grad(c.input[k], c.target[k], grad_scale), go);
      }
    }
    if (this->writes_input()) store_chunk(this->grad_input, first, gi);
    if constexpr (this->kWritesTarget) store_chunk(this->grad_target, first, gt);
  }
};

template <typename S>
struct ScaleOp {
  using T = opmath_t<S, S>;
  static constexpr int kVec = 16 / sizeof(S);
  static constexpr int kChunksPerThread = 1;
  static constexpr int kChunksInFlight = 1;
  template <int W>
  struct Chunk {
    alignas(16) S data[W];
  };

  S* __restrict__ data;
  T scale;

  template <int W>
  __device__ __forceinline__ void load(Chunk<W>& c, int64_t first) const { load_chunk(c.data, data, first); }
  template <int W>
  __device__ __forceinline__ void apply(const Chunk<W>& c, int64_t first) const {
    alignas(16) S scaled[W];
#pragma unroll
    for (int k = 0; k < W; ++k) scaled[k] = rounded_product(c.data[k], scale);
    store_chunk(data, first, scaled);
  }
};

// The reduction's scratch (exact_sum.cuh) is one 512-byte allocator block, as
// small as the 0-d loss's, for launches of fewer than kLargeScratchFromTiles
// tiles (4M to 32M elements, by tile size). From there on it is 2 KiB, 16
// lines for fp32 losses (4 for fp64, whose copies take 4 lines each): with 4
// lines, queued atomics cost a million tiles 5-9% of the bandwidth
// (benchmarks/sum_probe.py). Eager PyTorch's own mean allocates more than that
// for its staging at those sizes, so a training step's peak stays at or below
// eager's (benchmarks/peak_memory.py).
constexpr int64_t kSmallScratchBytes = 512;
constexpr int64_t kLargeScratchBytes = 2048;
constexpr int64_t kLargeScratchFromTiles = 8192;
constexpr int kMaxScratchWords = kLargeScratchBytes / sizeof(Word);

__host__ __device__ constexpr int64_t scratch_bytes(int64_t tiles) {
  return tiles < kLargeScratchFromTiles ? kSmallScratchBytes : kLargeScratchBytes;
}

// How many copies of the exact sum the scratch holds: a power of two.
template <typename T>
__host__ __device__ constexpr int scratch_copies(int64_t tiles) {
  static_assert(ExactSum<T>::kCopyWords * sizeof(Word) <= kSmallScratchBytes, "a copy must fit the scratch");
  return int(scratch_bytes(tiles) / sizeof(Word)) / ExactSum<T>::kCopyWords;
}

// kCopies is a template parameter: chosen at run time, it tips these kernels
// over 32 registers.
template <bool kVectorized, int kCopies, class Op>
__global__ void __launch_bounds__(kBlockThreads, kBlocksPerSm) reduced_loss_kernel(Op op, int64_t n, Word* sum) {
  using Sum = ExactSum<typename Op::T>;
  static_assert(kTileElements<Op> <= Sum::kMaxTileValues);
  op.sum = 0.0;
  visit_tile<kVectorized>(op, n);
  const double total = block_sum(op.sum);
  if (threadIdx.x == 0) Sum::add(sum + blockIdx.x % kCopies * Sum::kCopyWords, total);
}

template <bool kVectorized, class Op>
__global__ void __launch_bounds__(kBlockThreads, kBlocksPerSm) elementwise_kernel(Op op, int64_t n) {
  visit_tile<kVectorized>(op, n);
}

// Notes in `history` (host memory, when set) whether grad_output != 1, and
// walks the tiles from the last: the forward just read those, so the first
// ones are still in L2 (10 us of a 2.4 ms bf16 step at 2^30;
// benchmarks/backward_probe.py).
template <bool kVectorized, class Op>
__global__ void __launch_bounds__(kBlockThreads, kBlocksPerSm) reduced_loss_backward_kernel(Op op, int64_t n,
                                                                                            int32_t* history) {
  if (history != nullptr && blockIdx.x == 0 && threadIdx.x == 0) *history = to_opmath(*op.grad_output) != 1;
  visit_tile<kVectorized>(op, n, int64_t(gridDim.x) - 1 - blockIdx.x);
}

template <typename T, typename Out>
__global__ void __launch_bounds__(kMaxScratchWords) finish_reduction_kernel(const Word* sum, int copies,
                                                                            int64_t numel, bool mean, Out* out) {
  __shared__ Word words[kMaxScratchWords];
  if (threadIdx.x < copies * ExactSum<T>::kCopyWords) words[threadIdx.x] = sum[threadIdx.x];
  __syncthreads();
  if (threadIdx.x == 0) {
    const double total = ExactSum<T>::total(words, copies);
    // An empty mean is 0 / 0 = NaN, as in PyTorch.
    *out = Convert<Out>::from(mean ? total / double(numel) : total);
  }
}

__device__ __forceinline__ double load_as_double(const void* p, DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return *static_cast<const float*>(p);
    case DType::kFloat16: return __half2float(*static_cast<const __half*>(p));
    case DType::kBFloat16: return __bfloat162float(*static_cast<const __nv_bfloat16*>(p));
    default: return *static_cast<const double*>(p);
  }
}

// One wave of blocks, each walking every gridDim.x-th tile: when scale == 1
// (the common loss.backward()) the whole launch is one wave that exits at
// once, not a million blocks. Notes in `history` (when set) whether scale != 1.
template <bool kVectorized, typename S>
__global__ void __launch_bounds__(kBlockThreads, kBlocksPerSm) scale_in_place_kernel(S* data, int64_t n, int64_t tiles,
                                                                                     const void* scale,
                                                                                     DType scale_dtype,
                                                                                     int32_t* history) {
  const double s = load_as_double(scale, scale_dtype);
  if (history != nullptr && blockIdx.x == 0 && threadIdx.x == 0) *history = s != 1.0;
  if (s == 1.0) return;
  ScaleOp<S> op{data, static_cast<typename ScaleOp<S>::T>(s)};
#pragma unroll 1
  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) visit_tile<kVectorized>(op, n, tile);
}

// ---- host-side dispatch -------------------------------------------------

template <class F>
void with_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kFloat32: f(float{}); break;
    case DType::kFloat16: f(__half{}); break;
    case DType::kBFloat16: f(__nv_bfloat16{}); break;
    case DType::kFloat64: f(double{}); break;
  }
}

template <class F>
void with_loss(LossKind loss, F&& f) {
  switch (loss) {
    case LossKind::kMse: f(MseLoss{}); break;
    case LossKind::kL1: f(L1Loss{}); break;
    case LossKind::kSmoothL1: f(SmoothL1Loss{}); break;
    case LossKind::kHuber: f(HuberLoss{}); break;
  }
}

// Calls f(Loss{}, In{}, Tgt{}) for the problem's loss and dtype pair. fp64 is
// taken only paired with fp64; the host code converts the other operand.
template <class F>
cudaError_t with_problem_types(const LossProblem& p, F&& f) {
  cudaError_t err = cudaErrorInvalidValue;
  with_dtype(p.input_dtype, [&](auto in) {
    with_dtype(p.target_dtype, [&](auto tgt) {
      using In = decltype(in);
      using Tgt = decltype(tgt);
      if constexpr (std::is_same_v<In, double> == std::is_same_v<Tgt, double>) {
        with_loss(p.loss, [&](auto loss) { err = f(loss, in, tgt); });
      }
    });
  });
  return err;
}

template <Grads kGrads>
using GradsConstant = std::integral_constant<Grads, kGrads>;

// The same, with a fourth argument: the Grads that writing these gradients takes.
template <class F>
cudaError_t with_problem_types(const LossProblem& p, bool writes_input, bool writes_target, F&& f) {
  return with_problem_types(p, [&](auto loss, auto in, auto tgt) {
    if (writes_target) return f(loss, in, tgt, GradsConstant<Grads::kInputAndTarget>{});
    if (writes_input) return f(loss, in, tgt, GradsConstant<Grads::kInput>{});
    return f(loss, in, tgt, GradsConstant<Grads::kNone>{});
  });
}

// beta or delta converted to dtype D, as PyTorch does (1e6 is inf in fp16).
template <typename D, typename T>
LossParam<T> loss_param_in(double param) {
  const T value = to_opmath(Convert<D>::from(static_cast<T>(param)));
  return LossParam<T>{value, value != T(0) ? T(1) / value : T(0)};
}

template <class Op>
Op make_op(const LossProblem& p) {
  Op op{};
  op.input = static_cast<const typename Op::InT*>(p.input);
  op.target = static_cast<const typename Op::TgtT*>(p.target);
  using T = typename Op::T;
  op.param = loss_param_in<typename Op::Out, T>(p.param);
  op.input_grad_param = loss_param_in<typename Op::InputGradDtype, T>(p.param);
  op.target_grad_param = loss_param_in<typename Op::TargetGradDtype, T>(p.param);
  return op;
}

int64_t reduced_loss_scratch_bytes(const LossProblem& p, bool writes_input, bool writes_target) {
  int64_t bytes = 0;
  with_problem_types(p, writes_input, writes_target, [&](auto loss, auto in, auto tgt, auto grads) {
    bytes = scratch_bytes(num_tiles<ReducedLossOp<decltype(loss), decltype(in), decltype(tgt), grads()>>(p.numel));
    return cudaSuccess;
  });
  return bytes;
}

cudaError_t launch_reduced_loss(const LossProblem& p, void* scratch, void* grad_input, void* grad_target,
                                bool mean, void* out, cudaStream_t stream) {
  Word* sum = static_cast<Word*>(scratch);
  return with_problem_types(p, grad_input != nullptr, grad_target != nullptr, [&](auto loss, auto in, auto tgt,
                                                                                  auto grads) {
    using In = decltype(in);
    using Tgt = decltype(tgt);
    using Op = ReducedLossOp<decltype(loss), In, Tgt, grads()>;
    using T = typename Op::T;
    const int64_t tiles = num_tiles<Op>(p.numel);
    if (tiles > (int64_t(1) << kMaxTilesLog2)) return cudaErrorInvalidValue;  // the digits could overflow
    cudaError_t err = cudaMemsetAsync(sum, 0, scratch_bytes(tiles), stream);
    if (err != cudaSuccess) return err;
    if (tiles > 0) {
      Op op = make_op<Op>(p);
      op.grad_input = static_cast<In*>(grad_input);
      op.grad_target = static_cast<Tgt*>(grad_target);
      op.grad_scale = static_cast<T>(mean ? 1.0 / double(p.numel) : 1.0);
      const bool vectorized = is_aligned16(p.input) && is_aligned16(p.target) &&
                              is_aligned16(grad_input) && is_aligned16(grad_target);
      constexpr int kSmall = scratch_copies<T>(0);
      constexpr int kLarge = scratch_copies<T>(kLargeScratchFromTiles);
      const auto small_kernel =
          vectorized ? reduced_loss_kernel<true, kSmall, Op> : reduced_loss_kernel<false, kSmall, Op>;
      const auto large_kernel =
          vectorized ? reduced_loss_kernel<true, kLarge, Op> : reduced_loss_kernel<false, kLarge, Op>;
      const auto kernel = scratch_copies<T>(tiles) == kLarge ? large_kernel : small_kernel;
      kernel<<<tiles, kBlockThreads, 0, stream>>>(op, p.numel, sum);
      err = cudaGetLastError();
      if (err != cudaSuccess) return err;
    }
    using Out = typename Op::Out;
    finish_reduction_kernel<T, Out><<<1, kMaxScratchWords, 0, stream>>>(sum, scratch_copies<T>(tiles), p.numel, mean,
                                                                         static_cast<Out*>(out));
    return cudaGetLastError();
  });
}

cudaError_t launch_pointwise_loss(const LossProblem& p, void* out, cudaStream_t stream) {
  return with_problem_types(p, [&](auto loss, auto in, auto tgt) {
    using Op = PointwiseLossOp<decltype(loss), decltype(in), decltype(tgt)>;
    const int64_t tiles = num_tiles<Op>(p.numel);
    if (tiles == 0) return cudaSuccess;
    Op op = make_op<Op>(p);
    op.out = static_cast<typename Op::Out*>(out);
    const bool vectorized = is_aligned16(p.input) && is_aligned16(p.target) && is_aligned16(out);
    const auto kernel = vectorized ? elementwise_kernel<true, Op> : elementwise_kernel<false, Op>;
    kernel<<<tiles, kBlockThreads, 0, stream>>>(op, p.numel);
    return cudaGetLastError();
  });
}

// Calls f(op, tiles, aligned) with an OpT for the gradients that grad_input and
// grad_target ask for, its operands and gradient pointers set (`aligned`: all
// of those 16-byte aligned); nothing to do when none is asked for or the
// problem is empty.
template <template <class, typename, typename, Grads> class OpT, class F>
cudaError_t with_gradient_op(const LossProblem& p, void* grad_input, void* grad_target, F&& f) {
  return with_problem_types(p, grad_input != nullptr, grad_target != nullptr, [&](auto loss, auto in, auto tgt,
                                                                                  auto grads) {
    using In = decltype(in);
    using Tgt = decltype(tgt);
    using Op = OpT<decltype(loss), In, Tgt, grads()>;
    if constexpr (grads() == Grads::kNone) {
      return cudaSuccess;
    } else {
      const int64_t tiles = num_tiles<Op>(p.numel);
      if (tiles == 0) return cudaSuccess;
      Op op = make_op<Op>(p);
      op.grad_input = static_cast<In*>(grad_input);
      op.grad_target = static_cast<Tgt*>(grad_target);
      const bool aligned = is_aligned16(p.input) && is_aligned16(p.target) && is_aligned16(grad_input) &&
                           is_aligned16(grad_target);
      return f(op, tiles, aligned);
    }
  });
}

cudaError_t launch_pointwise_loss_backward(const LossProblem& p, const void* grad_output,
                                           bool grad_output_is_scalar, void* grad_input,
                                           void* grad_target, cudaStream_t stream) {
  return with_gradient_op<PointwiseLossBackwardOp>(p, grad_input, grad_target, [&](auto op, int64_t tiles,
                                                                                    bool aligned) {
    using Op = decltype(op);
    op.grad_output = static_cast<const typename Op::Out*>(grad_output);
    op.grad_output_is_scalar = grad_output_is_scalar;
    const bool vectorized = aligned && (grad_output_is_scalar || is_aligned16(grad_output));
    const auto kernel = vectorized ? elementwise_kernel<true, Op> : elementwise_kernel<false, Op>;
    kernel<<<tiles, kBlockThreads, 0, stream>>>(op, p.numel);
    return cudaGetLastError();
  });
}

cudaError_t launch_reduced_loss_backward(const LossProblem& p, const void* grad_output, bool mean, void* grad_input,
                                         void* grad_target, int32_t* history, cudaStream_t stream) {
  return with_gradient_op<ReducedLossBackwardOp>(p, grad_input, grad_target, [&](auto op, int64_t tiles,
                                                                                  bool aligned) {
    using Op = decltype(op);
    op.grad_scale = static_cast<typename Op::T>(mean ? 1.0 / double(p.numel) : 1.0);
    op.grad_output = static_cast<const typename Op::Out*>(grad_output);
    const auto kernel = aligned ? reduced_loss_backward_kernel<true, Op> : reduced_loss_backward_kernel<false, Op>;
    kernel<<<tiles, kBlockThreads, 0, stream>>>(op, p.numel, history);
    return cudaGetLastError();
  });
}

cudaError_t launch_scale_in_place(void* data, DType dtype, int64_t numel, const void* scale,
                                  DType scale_dtype, int num_sms, int32_t* history, cudaStream_t stream) {
  cudaError_t err = cudaSuccess;
  with_dtype(dtype, [&](auto s) {
    using S = decltype(s);
    const int64_t tiles = num_tiles<ScaleOp<S>>(numel);
    if (tiles == 0) return;
    const int64_t wave = std::min<int64_t>(tiles, int64_t(num_sms) * kBlocksPerSm);
    const auto kernel = is_aligned16(data) ? scale_in_place_kernel<true, S> : scale_in_place_kernel<false, S>;
    kernel<<<wave, kBlockThreads, 0, stream>>>(static_cast<S*>(data), numel, tiles, scale, scale_dtype, history);
    err = cudaGetLastError();
  });
  return err;
}

}  // namespace fusedloss
