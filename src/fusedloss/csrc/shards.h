// The launchers of launch.h, for a build that compiles each .cu file once per
// input dtype (build.py's shards, so that many small objects compile in
// parallel): each shard defines them in a namespace of its own
// (FUSEDLOSS_KERNELS_BEGIN in launch.h), and these pick one by the problem's
// input dtype. Each operator library defines those of the launchers it calls.
#pragma once

#include "launch.h"

#define FUSEDLOSS_SHARD_DECLARATION(shard, ret, name, params) \
  namespace shard {                                           \
  ret name params;                                            \
  }

// ret name params (whose first parameter is `const LossProblem& problem`), calling
// the shard's with `args`.
#define FUSEDLOSS_SHARD_DISPATCH(ret, name, params, args)                                     \
  FUSEDLOSS_SHARD_DECLARATION(shard_float32, ret, name, params)                               \
  FUSEDLOSS_SHARD_DECLARATION(shard_float16, ret, name, params)                               \
  FUSEDLOSS_SHARD_DECLARATION(shard_bfloat16, ret, name, params)                              \
  FUSEDLOSS_SHARD_DECLARATION(shard_float64, ret, name, params)                               \
  ret name params {                                                                           \
    switch (problem.input_dtype) {                                                            \
      case DType::kFloat32: return shard_float32::name args;                                  \
      case DType::kFloat16: return shard_float16::name args;                                  \
      case DType::kBFloat16: return shard_bfloat16::name args;                                \
      case DType::kFloat64: return shard_float64::name args;                                  \
    }                                                                                         \
    STD_TORCH_CHECK(false, "fusedloss: no kernels for input dtype ", int(problem.input_dtype)); \
  }
