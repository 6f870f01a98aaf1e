// The Gaussian and Poisson negative log-likelihoods' problem and launchers, which the
// likelihood family's host code (likelihood_ops.cpp) and kernels (likelihood_loss.cu) share.
#pragma once

#include "launch.h"

namespace fusedloss {

// PyTorch's gaussian_nll_loss, and poisson_nll_loss of a log rate or a rate.
enum class Likelihood : int { kGaussian, kPoissonLogRate, kPoissonRate };

// A mean or sum (or, pointwise, each element) over `numel` elements of operands of one dtype
// and one shape, contiguous and 16-byte aligned; `var` for the Gaussian only.
struct LikelihoodProblem {
  Likelihood kind;
  DType input_dtype;  // every operand's, and the loss's (shards.h dispatches on it)
  const void* input;
  const void* target;
  const void* var;
  int64_t numel;
  double eps;       // the Gaussian's var is clamped at it; the Poisson rate shifted by it
  double constant;  // added to each element's loss: the Gaussian's full term, else 0
  bool stirling;    // the Poisson loss's full term, Stirling's approximation of log(target!)
  double scale;     // the reduction's (1 / numel for a mean, else 1) times the caller's scale
  // The grad_output the forward's gradients are written for (grad_output_prediction.py).
  double expected_grad_output = 1.0;
};

}  // namespace fusedloss

FUSEDLOSS_KERNELS_BEGIN

// How many partial sums launch_likelihood_loss takes.
int64_t likelihood_partials(const LikelihoodProblem& problem);
// The loss into `out` (the operands' dtype), and each gradient whose pointer is set, for
// the problem's expected grad_output, rounded once.
cudaError_t launch_likelihood_loss(const LikelihoodProblem& problem, double* partials, void* grad_input,
                                   void* grad_target, void* grad_var, void* out, cudaStream_t stream);
// The gradients for *grad_output, noted in options.history: with options.correct_in_place,
// those launch_likelihood_loss wrote, recomputed in place where grad_output is not the
// expected one (decided on the GPU) by one wave of blocks; else computed, a tile a block.
cudaError_t launch_likelihood_backward(const LikelihoodProblem& problem, const void* grad_output,
                                       const BackwardOptions& options, void* grad_input, void* grad_target,
                                       void* grad_var, cudaStream_t stream);
// reduction='none': the loss per element times the problem's scale into `out` (the operands'
// dtype and shape).
cudaError_t launch_likelihood_pointwise(const LikelihoodProblem& problem, void* out, cudaStream_t stream);
// Its backward for a grad_output of the loss's shape, contiguous: each gradient whose pointer
// is set, times the scale and the element's grad_output.
cudaError_t launch_likelihood_pointwise_backward(const LikelihoodProblem& problem, const void* grad_output,
                                                 void* grad_input, void* grad_target, void* grad_var,
                                                 cudaStream_t stream);

FUSEDLOSS_KERNELS_END
