// What each kernel does with one chunk of elements: the ops that
// elementwise.cuh's tile walk drives. An op loads its operands for a chunk
// (`load`) and then computes and stores (`apply`); the losses themselves come
// from losses.cuh, the conversions from dtypes.cuh.
#pragma once

#include <type_traits>

#include "dtypes.cuh"
#include "elementwise.cuh"
#include "launch.h"
#include "losses.cuh"

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

__device__ __forceinline__ double load_as_double(const void* p, DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return *static_cast<const float*>(p);
    case DType::kFloat16: return __half2float(*static_cast<const __half*>(p));
    case DType::kBFloat16: return __bfloat162float(*static_cast<const __nv_bfloat16*>(p));
    default: return *static_cast<const double*>(p);
  }
}

// How a reduction weighs its elements, fixed at compile time: Unweighted (the
// plain losses: nothing to load, nothing multiplied, the code of a loss with no
// weight) or Weighted (an ElementWeight and a DeviceScale, read on the device,
// and where `grad` is set, d loss / d weight per element written beside the
// operands' gradients).
struct Unweighted {
  static constexpr bool kHasGradient = false;
  template <int kVec>
  static constexpr int kBlocksPerSmFor = fusedloss::kBlocksPerSm;
  static constexpr int kTileLengthFactor = 1;
  template <int W, typename T>
  struct Values {};
  template <int W, typename T>
  __device__ __forceinline__ void load(Values<W, T>&, int64_t) const {}
  template <class Loss, int W, typename Tgt>
  __device__ __forceinline__ static void load_target(Tgt (&dst)[W], const Tgt* __restrict__ target, int64_t first) {
    load_chunk(dst, target, first);
  }
  template <int W, typename T>
  __device__ __forceinline__ static T times(const Values<W, T>&, int, T x) { return x; }
  template <class Loss, int W, typename T>
  __device__ __forceinline__ static T summand(const Values<W, T>&, int, T x) { return x; }
  template <class Loss, int W, typename T, class Params>
  __device__ __forceinline__ static const Params& params(const Values<W, T>&, int, const Params& own) { return own; }
  template <class Loss, int W, typename T>
  __device__ __forceinline__ static T gradient_factor(const Values<W, T>&, int, T x) { return x; }
  template <int W, typename T>
  __device__ __forceinline__ static void note_row_weight(const Values<W, T>&) {}
  // The gradients' factor: the reduction's (1/N or 1) times grad_output, rounded once.
  template <typename T>
  __device__ __forceinline__ void begin(T& grad_scale, double reduction_scale, double grad_output) const {
    grad_scale = T(reduction_scale * grad_output);
  }
};

// The weight of the row that a block's tile lies in, in a reduction over rows
// (Weighted::per_row, weighted_reduced_loss_kernel).
__device__ __forceinline__ double& row_weight() {
  __shared__ double weight;
  return weight;
}

struct WeightIndex {
  int64_t index, inner_at;
};

template <typename T>
struct Weighted {
  // The weights and the index walk need more than 32 registers a thread; chunks of 8
  // (16-bit operands) more than 40.
  template <int kVec>
  static constexpr int kBlocksPerSmFor = kVec >= 8 ? 5 : 6;
  // A reduction's tiles are twice an unweighted one's: each tile reads the factor, sums
  // its block and stores a partial, and a 16-bit pass lost bandwidth to those at the
  // shorter length.
  static constexpr int kTileLengthFactor = 2;
  using Stored = T;  // float32, or float64 with fp64 operands (ElementWeight)
  template <int W, typename V>
  struct Values {
    alignas(16) Stored w[W];
  };

  static constexpr bool kHasGradient = true;
  __device__ __forceinline__ bool writes_gradient() const { return grad != nullptr; }

  const Stored* __restrict__ weight;
  ElementWeight layout;
  DeviceScale scale;
  void* grad;  // the loss's dtype, the loss's shape; null: not written
  // The weight is constant along each row of the problem (LossProblem::row_length): a
  // reduction's tiles sum the loss unweighted, and each tile's sum is multiplied by its
  // row's weight (weighted_reduced_loss_kernel).
  bool per_row = false;
  // `weight` holds each element's param instead (LossProblem::param_per_element).
  bool param_per_element = false;

  template <class Loss>
  __device__ __forceinline__ bool params_from_weight() const {
    if constexpr (TakesParamPerElement<Loss>::value) {
      return param_per_element;
    } else {
      return false;
    }
  }

  __device__ __forceinline__ double factor() const {
    double f = scale.host;
    if (scale.scale != nullptr) f *= load_as_double(scale.scale, scale.scale_dtype);
    if (scale.divisor != nullptr) f /= load_as_double(scale.divisor, scale.divisor_dtype);
    return f;
  }

  // Element e's index into the weight (or, kTarget, the target: broadcast_target) and its
  // coordinate in the innermost run: one division per run, by multiplication where the
  // indices fit 32 bits (ElementWeight's magic numbers). 64-bit indices come with at most
  // kWideWeightRuns runs (ElementWeight).
  template <bool kTarget = false>
  __device__ __forceinline__ WeightIndex locate(int64_t e) const {
    const ElementWeight& layout = kTarget ? broadcast_target : this->layout;
    if (layout.index_32bit) {
      uint32_t q = uint32_t(e), index = 0, inner_at = 0;
#pragma unroll
      for (int d = 0; d < kWeightRuns; ++d) {
        if (d < layout.runs) {
          const uint32_t next = uint32_t((uint64_t(__umulhi(q, layout.magic[d])) + q) >> layout.shift[d]);
          const uint32_t at = q - next * uint32_t(layout.size[d]);
          if (d == 0) inner_at = at;
          index += at * uint32_t(layout.stride[d]);
          q = next;
        }
      }
      return {index, inner_at};
    }
    int64_t q = e, index = 0, inner_at = 0;
#pragma unroll
    for (int d = 0; d < kWideWeightRuns; ++d) {
      if (d < layout.runs) {
        const int64_t next = q / layout.size[d], at = q - next * layout.size[d];
        if (d == 0) inner_at = at;
        index += at * layout.stride[d];
        q = next;
      }
    }
    return {index, inner_at};
  }

  // Elements first .. first + W - 1 of the weight, laid out in at least one run: one load (a
  // vector load, or W loads of neighbours) for a chunk within the innermost run, else a walk
  // that locates each run it enters.
  template <int W, typename S>
  __device__ __forceinline__ void load_along_runs(S (&dst)[W], const S* src, int64_t first) const {
    if (layout.dense) {
      load_chunk(dst, src, first);
      return;
    }
    WeightIndex where = locate(first);
    int64_t index = where.index, at = where.inner_at;
    if (at + W <= layout.size[0]) {
      if (layout.stride[0] == 0) {
        const S w = src[index];
#pragma unroll
        for (int k = 0; k < W; ++k) dst[k] = w;
      } else if (layout.vector_loads) {
        static_assert(W <= 8, "vector_loads promises alignment for chunks of up to 8 elements");
        load_chunk(dst, src, index);
      } else {
#pragma unroll
        for (int k = 0; k < W; ++k) dst[k] = src[index + k];
      }
      return;
    }
#pragma unroll
    for (int k = 0; k < W; ++k) {
      dst[k] = src[index];
      if (k + 1 < W) {
        if (++at < layout.size[0]) {
          index += layout.stride[0];
        } else {
          where = locate(first + k + 1);
          index = where.index;
          at = where.inner_at;
        }
      }
    }
  }

  // Element `first + k`'s weight: 1 without one.
  template <int W, typename V>
  __device__ __forceinline__ void load(Values<W, V>& v, int64_t first) const {
    if (weight == nullptr || layout.runs == 0) {
      const Stored w = weight == nullptr ? Stored(1) : weight[0];
#pragma unroll
      for (int k = 0; k < W; ++k) v.w[k] = w;
      return;
    }
    load_along_runs(v.w, weight, first);
  }
  // The target's chunk: where it lies (broadcast_target) for the quantile loss, so a
  // (..., 1) target against several quantiles is never expanded; else dense.
  template <class Loss, int W, typename Tgt>
  __device__ __forceinline__ void load_target(Tgt (&dst)[W], const Tgt* __restrict__ target, int64_t first) const {
    if constexpr (TakesParamPerElement<Loss>::kTargetWhereItLies) {
      if (broadcast_target.weight != nullptr) {
        // each element located on its own: less code to compile than the weight's walk
#pragma unroll
        for (int k = 0; k < W; ++k) dst[k] = target[locate<true>(first + k).index];
        return;
      }
    }
    load_chunk(dst, target, first);
  }
  template <int W, typename V>
  __device__ __forceinline__ static V times(const Values<W, V>& v, int k, V x) { return V(v.w[k]) * x; }
  // What element k adds to a reduction's sum.
  template <class Loss, int W, typename V>
  __device__ __forceinline__ V summand(const Values<W, V>& v, int k, V x) const {
    return (per_row || params_from_weight<Loss>() ? V(1) : V(v.w[k])) * x;
  }
  // The params element k's loss and gradients see: the op's own, or the element's, NaN
  // where it lies outside the loss's domain (so its loss is NaN, as the formula's path makes
  // it, with no launch to check the tensor).
  template <class Loss, int W, typename V, class Params>
  __device__ __forceinline__ Params params(const Values<W, V>& v, int k, const Params& own) const {
    if constexpr (TakesParamPerElement<Loss>::value) {
      if (param_per_element) {
        const V given = V(v.w[k]);
        const V value = TakesParamPerElement<Loss>::in_domain(given) ? given : V(NAN);
        const LossParam<V> param{value, V(0)};
        return Params{param, param, param};
      }
    }
    return own;
  }
  // What element k's gradients are multiplied by: x times its weight, or x alone where the
  // weight is its param.
  template <class Loss, int W, typename V>
  __device__ __forceinline__ V gradient_factor(const Values<W, V>& v, int k, V x) const {
    return params_from_weight<Loss>() ? x : times(v, k, x);
  }
  // Over rows, every element of a tile has its row's weight: the block's first thread
  // notes the one it loaded (it always loads the tile's first element).
  template <int W, typename V>
  __device__ __forceinline__ void note_row_weight(const Values<W, V>& v) const {
    if (per_row && threadIdx.x == 0) row_weight() = double(v.w[0]);
  }
  // The gradients' factor, scale / divisor times grad_output, rounded once (the
  // reduction's 1/N is in the host's scale).
  template <typename V>
  __device__ __forceinline__ void begin(V& grad_scale, double, double grad_output) const {
    grad_scale = V(factor() * grad_output);
  }
  // The target's layout where it broadcasts (LossProblem::broadcast_target); last, so the
  // other members keep their places in the kernels' parameters.
  ElementWeight broadcast_target;
};

// The vector width covers 16 bytes of the narrower operand; one chunk per
// thread and tile unless an op says otherwise.
template <class Loss, typename In, typename Tgt>
struct PairOp {
  using LossT = Loss;
  using T = opmath_t<In, Tgt>;
  using InT = In;
  using TgtT = Tgt;
  static constexpr bool kFloat32Math = IsFloat32Math<Loss>::value;
  using Out = std::conditional_t<kFloat32Math, float,
                                 std::conditional_t<Loss::kOutputHasInputDtype, In, typename Promote<In, Tgt>::type>>;
  static constexpr int kVec = 16 / (sizeof(In) < sizeof(Tgt) ? sizeof(In) : sizeof(Tgt));
  static constexpr int kChunksPerThread = 1;
  static constexpr int kChunksInFlight = 1;
  static constexpr int kBlocksPerSm = fusedloss::kBlocksPerSm;

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

  // The three, as the loss and its gradients see them: the op's, or an element's own
  // (Weighted::params).
  struct Params {
    LossParam<T> loss, input_grad, target_grad;
  };
  __device__ __forceinline__ Params params() const {
    // Unrounded, the three are one value: one register, so the loss and its gradients share
    // their arithmetic.
    if constexpr (Loss::kParamInLossDtype) {
      return Params{param, input_grad_param, target_grad_param};
    } else {
      return Params{param, param, param};
    }
  }

  // The dtypes PyTorch computes the gradients in (see Loss::kGradInOwnDtype).
  using InputGradDtype = std::conditional_t<Loss::kGradInOwnDtype && !kFloat32Math, In, Out>;
  using TargetGradDtype = std::conditional_t<Loss::kGradInOwnDtype && !kFloat32Math, Tgt, Out>;
  // The wider of the gradients' storage dtypes: the target's may be the input's, negated.
  using GradOut = typename Promote<In, Tgt>::type;

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
  __device__ __forceinline__ T value(const In& x, const Tgt& y, const Params& p) const {
    return Loss::template value<Out>(diff_in<Out>(x, y), p.loss);
  }
  __device__ __forceinline__ T value(const In& x, const Tgt& y) const { return value(x, y, params()); }
  // Whether the loss and d loss / d input may come from one computation: the loss has
  // value_and_grad, and both see the same d, param and dtype, so the bits are value's and
  // input_grad's (and the target's gradient is the input's, negated).
  static constexpr bool kSharesValueAndGrad =
      HasValueAndGrad<Loss>::value && !Loss::kParamInLossDtype && std::is_same_v<InputGradDtype, Out> &&
      std::is_same_v<TargetGradDtype, Out> && std::is_same_v<GradOut, Out>;
  __device__ __forceinline__ ValueAndGrad<T> value_and_input_grad(const In& x, const Tgt& y, const Params& p) const {
    static_assert(kSharesValueAndGrad, "value and input_grad apart otherwise");
    return Loss::template value_and_grad<Out>(diff_in<Out>(x, y), p.loss);
  }
  __device__ __forceinline__ T input_grad(const In& x, const Tgt& y, const Params& p) const {
    return Loss::template grad<GradOut>(diff_in<InputGradDtype>(x, y), p.input_grad);
  }
  __device__ __forceinline__ T target_grad(const In& x, const Tgt& y, const Params& p) const {
    if constexpr (std::is_same_v<InputGradDtype, TargetGradDtype>) {
      return -input_grad(x, y, p);  // the same computation: let the compiler share it
    } else {
      return -Loss::template grad<GradOut>(diff_in<TargetGradDtype>(x, y), p.target_grad);
    }
  }
  // The gradients times `factor`, each rounded once into its storage dtype.
  __device__ __forceinline__ In rounded_input_grad(const In& x, const Tgt& y, T factor, const Params& p) const {
    return Convert<In>::from(input_grad(x, y, p) * factor);
  }
  __device__ __forceinline__ In rounded_input_grad(const In& x, const Tgt& y, T factor) const {
    return rounded_input_grad(x, y, factor, params());
  }
  __device__ __forceinline__ Tgt rounded_target_grad(const In& x, const Tgt& y, T factor, const Params& p) const {
    return Convert<Tgt>::from(target_grad(x, y, p) * factor);
  }
  __device__ __forceinline__ Tgt rounded_target_grad(const In& x, const Tgt& y, T factor) const {
    return rounded_target_grad(x, y, factor, params());
  }
  template <int W>
  __device__ __forceinline__ void load_pair(Chunk<W>& c, int64_t first) const {
    load_chunk(c.input, input, first);
    load_chunk(c.target, target, first);
  }
};

// Loss sums (per thread, then per tile), plus the gradients (times grad_scale) that kGrads names.
// A thread takes two chunks per tile where they fit 64 bytes (times the weights'
// kTileLengthFactor): a read-only pass's blocks retire so fast that per-block work would
// otherwise show. A read-only pass loads two chunks at once; a pass that writes gradients
// loads them one after the other (both at once spill at 32 registers), but its tiles and
// sums are the same, so the loss has the same bits whichever gradients are written.
template <class Loss, typename In, typename Tgt, Grads kGrads, class Weights = Unweighted>
struct ReducedLossOp : PairOp<Loss, In, Tgt>, GradPointers<kGrads, In, Tgt> {
  using Base = PairOp<Loss, In, Tgt>;
  using typename Base::T;
  template <int W>
  struct Chunk : Base::template Chunk<W> {
    typename Weights::template Values<W, T> weight;
  };
  static constexpr int kChunksPerUnweightedTile = Base::kVec * (sizeof(In) + sizeof(Tgt)) <= 32 ? 2 : 1;
  static constexpr int kChunksPerThread = kChunksPerUnweightedTile * Weights::kTileLengthFactor;
  static constexpr int kChunksInFlight = kGrads == Grads::kNone ? kChunksPerUnweightedTile : 1;

  static constexpr int kBlocksPerSm = Weights::template kBlocksPerSmFor<Base::kVec>;
  using typename Base::Out;
  // The weight's gradient goes with the operands' (a pass that writes none keeps its registers).
  static constexpr bool kWritesWeightGradient = Weights::kHasGradient && kGrads != Grads::kNone;
  double reduction_scale;  // 1/N or 1 (Unweighted)
  double expected_grad_output;
  T grad_scale;  // set by begin
  double sum;
  Weights weights;

  // The gradients' factor, for the grad_output that backward is expected to bring, as
  // ReducedLossBackwardOp::begin computes it for the real one.
  __device__ __forceinline__ void begin() { weights.begin(grad_scale, reduction_scale, expected_grad_output); }

  template <int W>
  __device__ __forceinline__ void load(Chunk<W>& c, int64_t first) const {
    load_chunk(c.input, this->input, first);
    weights.template load_target<Loss>(c.target, this->target, first);
    weights.load(c.weight, first);
  }

  // One rounding from the fp32 product into each gradient's storage dtype; one
  // loop, so no value outlives its element (register pressure).
  template <int W>
  __device__ __forceinline__ void apply(const Chunk<W>& c, int64_t first) {
    T chunk_sum = 0;
    alignas(16) In gi[W];
    alignas(16) Tgt gt[W];
    alignas(16) Out gw[kWritesWeightGradient ? W : 1];
    weights.note_row_weight(c.weight);
#pragma unroll
    for (int k = 0; k < W; ++k) {
      const auto params = weights.template params<Loss>(c.weight, k, this->params());
      if constexpr (Base::kSharesValueAndGrad && kGrads != Grads::kNone) {
        const ValueAndGrad<T> both = this->value_and_input_grad(c.input[k], c.target[k], params);
        chunk_sum += weights.template summand<Loss>(c.weight, k, both.value);
        const T factor = weights.template gradient_factor<Loss>(c.weight, k, grad_scale);
        // rounded as rounded_input_grad and rounded_target_grad round them
        if (this->writes_input()) gi[k] = Convert<In>::from(both.grad * factor);
        if constexpr (GradPointers<kGrads, In, Tgt>::kWritesTarget) gt[k] = Convert<Tgt>::from(-both.grad * factor);
        if constexpr (kWritesWeightGradient) gw[k] = Convert<Out>::from(both.value * grad_scale);
      } else {
        const T value = this->value(c.input[k], c.target[k], params);
        chunk_sum += weights.template summand<Loss>(c.weight, k, value);
        const T factor = weights.template gradient_factor<Loss>(c.weight, k, grad_scale);
        if (this->writes_input()) gi[k] = this->rounded_input_grad(c.input[k], c.target[k], factor, params);
        if constexpr (GradPointers<kGrads, In, Tgt>::kWritesTarget) {
          gt[k] = this->rounded_target_grad(c.input[k], c.target[k], factor, params);
        }
        if constexpr (kWritesWeightGradient) gw[k] = Convert<Out>::from(value * grad_scale);
      }
    }
    sum += double(chunk_sum);
    if (this->writes_input()) store_chunk(this->grad_input, first, gi);
    if constexpr (GradPointers<kGrads, In, Tgt>::kWritesTarget) store_chunk(this->grad_target, first, gt);
    if constexpr (kWritesWeightGradient) {
      if (weights.writes_gradient()) store_chunk(static_cast<Out*>(weights.grad), first, gw);
    }
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

// The gradients of reduction='none' that kGrads names, times grad_output: of
// the loss's shape or one value (Unweighted), or with a Weighted policy one that
// broadcasts to the loss's shape, read where it lies as a weight is (the backward
// of a sum over some dimensions hands over such an expanded grad_output).
template <class Loss, typename In, typename Tgt, Grads kGrads, class Weights = Unweighted>
struct PointwiseLossBackwardOp : PairOp<Loss, In, Tgt>, GradPointers<kGrads, In, Tgt> {
  using Base = PairOp<Loss, In, Tgt>;
  using typename Base::T;
  using typename Base::Out;
  template <int W>
  struct Chunk : Base::template Chunk<W> {
    typename Weights::template Values<W, T> weight;
  };
  static constexpr bool kBroadcast = !std::is_same_v<Weights, Unweighted>;
  static constexpr int kBlocksPerSm = Weights::template kBlocksPerSmFor<Base::kVec>;

  const Out* __restrict__ grad_output;  // Unweighted only
  bool grad_output_is_scalar;
  Weights weights;  // the broadcast grad_output

  template <int W>
  __device__ __forceinline__ void load(Chunk<W>& c, int64_t first) const {
    this->load_pair(c, first);
    if constexpr (kBroadcast) {
      weights.load(c.weight, first);
    } else if (!grad_output_is_scalar) {
      load_chunk(c.grad_output, grad_output, first);
    }
  }

  template <int W>
  __device__ __forceinline__ void apply(const Chunk<W>& c, int64_t first) const {
    alignas(16) In gi[W];
    alignas(16) Tgt gt[W];
#pragma unroll
    for (int k = 0; k < W; ++k) {
      T go;
      if constexpr (kBroadcast) {
        go = Weights::times(c.weight, k, T(1));
      } else {
        go = to_opmath(grad_output_is_scalar ? grad_output[0] : c.grad_output[k]);
      }
      if (this->writes_input()) gi[k] = this->rounded_input_grad(c.input[k], c.target[k], go);
      if constexpr (GradPointers<kGrads, In, Tgt>::kWritesTarget) gt[k] = this->rounded_target_grad(c.input[k], c.target[k], go);
    }
    if (this->writes_input()) store_chunk(this->grad_input, first, gi);
    if constexpr (GradPointers<kGrads, In, Tgt>::kWritesTarget) store_chunk(this->grad_target, first, gt);
  }
};

// The gradients of a mean or sum for a one-element grad_output, recomputed from
// input and target: every factor (the reduction's, the weight, grad_output)
// applied in float32 (float64 for fp64 data) and each gradient rounded once, with
// the bits the forward's pass writes when it expects this grad_output.
template <class Loss, typename In, typename Tgt, Grads kGrads, class Weights = Unweighted>
struct ReducedLossBackwardOp : PairOp<Loss, In, Tgt>, GradPointers<kGrads, In, Tgt> {
  using Base = PairOp<Loss, In, Tgt>;
  using typename Base::T;
  using typename Base::Out;
  template <int W>
  struct Chunk : Base::template Chunk<W> {
    typename Weights::template Values<W, T> weight;
  };

  static constexpr int kBlocksPerSm = Weights::template kBlocksPerSmFor<Base::kVec>;
  double reduction_scale;  // as in ReducedLossOp
  T grad_scale;
  const Out* __restrict__ grad_output;
  Weights weights;

  __device__ __forceinline__ void begin(T go) { weights.begin(grad_scale, reduction_scale, double(go)); }

  template <int W>
  __device__ __forceinline__ void load(Chunk<W>& c, int64_t first) const {
    load_chunk(c.input, this->input, first);
    weights.template load_target<Loss>(c.target, this->target, first);
    weights.load(c.weight, first);
  }

  template <int W>
  __device__ __forceinline__ void apply(const Chunk<W>& c, int64_t first) const {
    alignas(16) In gi[W];
    alignas(16) Tgt gt[W];
    alignas(16) Out gw[Weights::kHasGradient ? W : 1];
#pragma unroll
    for (int k = 0; k < W; ++k) {
      const auto params = weights.template params<Loss>(c.weight, k, this->params());
      const T factor = weights.template gradient_factor<Loss>(c.weight, k, grad_scale);
      if (this->writes_input()) gi[k] = this->rounded_input_grad(c.input[k], c.target[k], factor, params);
      if constexpr (GradPointers<kGrads, In, Tgt>::kWritesTarget) {
        gt[k] = this->rounded_target_grad(c.input[k], c.target[k], factor, params);
      }
      if constexpr (Weights::kHasGradient) {
        if (weights.writes_gradient()) gw[k] = Convert<Out>::from(this->value(c.input[k], c.target[k]) * grad_scale);
      }
    }
    if (this->writes_input()) store_chunk(this->grad_input, first, gi);
    if constexpr (GradPointers<kGrads, In, Tgt>::kWritesTarget) store_chunk(this->grad_target, first, gt);
    if constexpr (Weights::kHasGradient) {
      if (weights.writes_gradient()) store_chunk(static_cast<Out*>(weights.grad), first, gw);
    }
  }
};

}  // namespace fusedloss
