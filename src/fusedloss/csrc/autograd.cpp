// Autograd for the fusedloss:: operators on CUDA, in C++: a training step's
// backward then runs no Python. The formulas are ops.py's, which registers them
// for every other device; both hand create_graph=True to the differentiable
// fusedloss::loss_gradients (defined in Python).
#include <ATen/ExpandUtils.h>
#include <ATen/TensorSubclassLikeUtils.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <array>
#include <string>
#include <tuple>

namespace fusedloss {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using Tensors2 = std::tuple<at::Tensor, at::Tensor>;
using Tensors3 = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

template <typename Signature>
c10::TypedOperatorHandle<Signature> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

Tensors3 call_reduced_loss(const at::Tensor& input, const at::Tensor& target, c10::string_view loss, double param,
                           c10::string_view reduction, std::array<bool, 2> output_mask, int64_t slot,
                           bool autocast) {
  static const auto op = find_op<Tensors3(const at::Tensor&, const at::Tensor&, c10::string_view, double,
                                          c10::string_view, std::array<bool, 2>, int64_t, bool)>(
      "fusedloss::reduced_loss");
  return op.call(input, target, loss, param, reduction, output_mask, slot, autocast);
}

Tensors2 call_reduced_loss_backward(const at::Tensor& grad, const at::Tensor& input, const at::Tensor& target,
                                    c10::string_view loss, double param, c10::string_view reduction,
                                    std::array<bool, 2> output_mask, int64_t slot, bool autocast) {
  static const auto op = find_op<Tensors2(const at::Tensor&, const at::Tensor&, const at::Tensor&, c10::string_view,
                                          double, c10::string_view, std::array<bool, 2>, int64_t, bool)>(
      "fusedloss::reduced_loss_backward");
  return op.call(grad, input, target, loss, param, reduction, output_mask, slot, autocast);
}

using OptionalTensor = c10::optional<at::Tensor>;

Tensors3 call_weighted_loss(const at::Tensor& input, const at::Tensor& target, const OptionalTensor& weight,
                            const OptionalTensor& scale, const OptionalTensor& divisor, double host_scale,
                            c10::string_view loss, double param, std::array<bool, 2> output_mask, bool autocast) {
  static const auto op =
      find_op<Tensors3(const at::Tensor&, const at::Tensor&, const OptionalTensor&, const OptionalTensor&,
                       const OptionalTensor&, double, c10::string_view, double, std::array<bool, 2>, bool)>(
          "fusedloss::weighted_loss");
  return op.call(input, target, weight, scale, divisor, host_scale, loss, param, output_mask, autocast);
}

Tensors2 call_weighted_loss_backward(const at::Tensor& grad, const at::Tensor& input, const at::Tensor& target,
                                     const OptionalTensor& weight, const OptionalTensor& scale,
                                     const OptionalTensor& divisor, double host_scale, c10::string_view loss,
                                     double param, std::array<bool, 2> output_mask, bool autocast) {
  static const auto op =
      find_op<Tensors2(const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptionalTensor&,
                       const OptionalTensor&, const OptionalTensor&, double, c10::string_view, double,
                       std::array<bool, 2>, bool)>("fusedloss::weighted_loss_backward");
  return op.call(grad, input, target, weight, scale, divisor, host_scale, loss, param, output_mask, autocast);
}

at::Tensor call_pointwise_loss(const at::Tensor& input, const at::Tensor& target, c10::string_view loss,
                               double param) {
  static const auto op =
      find_op<at::Tensor(const at::Tensor&, const at::Tensor&, c10::string_view, double)>("fusedloss::pointwise_loss");
  return op.call(input, target, loss, param);
}

Tensors2 call_pointwise_loss_backward(const at::Tensor& grad, const at::Tensor& input, const at::Tensor& target,
                                      c10::string_view loss, double param, std::array<bool, 2> output_mask) {
  static const auto op = find_op<Tensors2(const at::Tensor&, const at::Tensor&, const at::Tensor&, c10::string_view,
                                          double, std::array<bool, 2>)>("fusedloss::pointwise_loss_backward");
  return op.call(grad, input, target, loss, param, output_mask);
}

void call_scale_(at::Tensor& self, const at::Tensor& scale, int64_t slot) {
  static const auto op = find_op<void(at::Tensor&, const at::Tensor&, int64_t)>("fusedloss::scale_");
  op.call(self, scale, slot);
}

// create_graph=True: gradients that autograd can differentiate again, already
// summed to each operand's shape.
Tensors2 call_loss_gradients(const at::Tensor& grad, const at::Tensor& input, const at::Tensor& target,
                             c10::string_view loss, double param, c10::string_view reduction, bool autocast) {
  static const auto op = find_op<Tensors2(const at::Tensor&, const at::Tensor&, const at::Tensor&, c10::string_view,
                                          double, c10::string_view, bool)>("fusedloss::loss_gradients");
  return op.call(grad, input, target, loss, param, reduction, autocast);
}

at::Tensor summed_to(const at::Tensor& grad, const at::Tensor& operand) {
  return grad.sizes() == operand.sizes() ? grad : at::sum_to(grad, operand.sizes());
}

bool wants_gradients(const at::Tensor& input, const at::Tensor& target) {
  return at::GradMode::is_enabled() && (input.requires_grad() || target.requires_grad());
}

// A gradient for each forward argument: the two operands, then nothing for the rest.
variable_list operand_gradients(const at::Tensor& grad_input, const at::Tensor& grad_target, size_t arguments) {
  variable_list grads(arguments);
  grads[0] = grad_input;
  grads[1] = grad_target;
  return grads;
}

// The gradients the forward wrote, times grad. Scaled in place, so only the
// first backward through a graph may use them; dropped from the context so
// that autograd can hand them to .grad without a copy.
Tensors2 take_fused_gradients(ska::flat_hash_map<std::string, c10::IValue>& data, std::array<bool, 2> needs,
                              const at::Tensor& grad, int64_t slot) {
  auto take = [&](const char* key, bool needed) {
    at::Tensor fused;
    if (data.count(key) > 0) {
      fused = data[key].toTensor();
      data.erase(key);
    }
    if (!needed) return at::Tensor();
    if (at::isTensorSubclassLike(fused)) return at::mul(fused, grad);  // traced: stay functional
    call_scale_(fused, grad, slot);
    return fused;
  };
  at::Tensor grad_input = take("fused_input", needs[0]);
  return {grad_input, take("fused_target", needs[1])};
}

class ReducedLoss : public torch::autograd::Function<ReducedLoss> {
 public:
  static constexpr size_t kArguments = 8;

  static variable_list forward(AutogradContext* ctx, const at::Tensor& input, const at::Tensor& target,
                               const std::string& loss, double param, const std::string& reduction,
                               std::array<bool, 2> output_mask, int64_t slot, bool autocast) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [out, grad_input, grad_target] =
        call_reduced_loss(input, target, loss, param, reduction, output_mask, slot, autocast);
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({input, target});
    ctx->saved_data["loss"] = loss;
    ctx->saved_data["param"] = param;
    ctx->saved_data["reduction"] = reduction;
    ctx->saved_data["slot"] = slot;
    ctx->saved_data["autocast"] = autocast;
    ctx->saved_data["wrote_input"] = output_mask[0];
    ctx->saved_data["wrote_target"] = output_mask[1];
    // Detached: the outputs point back at this node, and a graph dropped
    // without backward would then never be freed.
    if (output_mask[0]) ctx->saved_data["fused_input"] = grad_input.detach();
    if (output_mask[1]) ctx->saved_data["fused_target"] = grad_target.detach();
    ctx->mark_non_differentiable({grad_input, grad_target});
    return {out, grad_input, grad_target};
  }

  // The fused gradient times grad, or the gradient recomputed from the operands:
  // the same bits either way (ops.py).
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor& grad = grads[0];
    if (!grad.defined()) return variable_list(kArguments);
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& input = saved[0];
    const at::Tensor& target = saved[1];
    const std::array<bool, 2> needs = {ctx->needs_input_grad(0), ctx->needs_input_grad(1)};
    auto& data = ctx->saved_data;
    const std::string loss = data["loss"].toStringRef();
    const double param = data["param"].toDouble();
    const std::string reduction = data["reduction"].toStringRef();
    const bool autocast = data["autocast"].toBool();
    if (at::GradMode::is_enabled()) {
      auto [grad_input, grad_target] = call_loss_gradients(grad, input, target, loss, param, reduction, autocast);
      return operand_gradients(needs[0] ? grad_input : at::Tensor(), needs[1] ? grad_target : at::Tensor(),
                               kArguments);
    }
    const int64_t slot = data["slot"].toInt();
    const bool has_fused = data.count("fused_input") > 0 || data.count("fused_target") > 0;
    const bool fused_cover_needs = (data["wrote_input"].toBool() || !needs[0]) &&
                                   (data["wrote_target"].toBool() || !needs[1]);
    at::Tensor grad_input, grad_target;
    if (has_fused && fused_cover_needs) {
      std::tie(grad_input, grad_target) = take_fused_gradients(data, needs, grad, slot);
    } else {
      std::tie(grad_input, grad_target) =
          call_reduced_loss_backward(grad, input, target, loss, param, reduction, needs, slot, autocast);
    }
    return operand_gradients(needs[0] ? summed_to(grad_input, input) : at::Tensor(),
                             needs[1] ? summed_to(grad_target, target) : at::Tensor(), kArguments);
  }
};

OptionalTensor defined_or_none(const at::Tensor& t) { return t.defined() ? OptionalTensor(t) : c10::nullopt; }

// The weighted reductions: ReducedLoss's plan with a weight and a scale, which
// take no gradient here (weighted_loss_autograd refuses them; fusedloss.functional
// computes that case with torch operations). create_graph=True goes through
// ops.py's formulas. needs_input_grad counts defined tensors only: input and
// target are the first two.
class WeightedLoss : public torch::autograd::Function<WeightedLoss> {
 public:
  static constexpr size_t kArguments = 10;

  static variable_list forward(AutogradContext* ctx, const at::Tensor& input, const at::Tensor& target,
                               const OptionalTensor& weight, const OptionalTensor& scale,
                               const OptionalTensor& divisor, double host_scale, const std::string& loss,
                               double param, std::array<bool, 2> output_mask, bool autocast) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [out, grad_input, grad_target] =
        call_weighted_loss(input, target, weight, scale, divisor, host_scale, loss, param, output_mask, autocast);
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({input, target, weight.value_or(at::Tensor()), scale.value_or(at::Tensor()),
                            divisor.value_or(at::Tensor())});
    ctx->saved_data["host_scale"] = host_scale;
    ctx->saved_data["loss"] = loss;
    ctx->saved_data["param"] = param;
    ctx->saved_data["autocast"] = autocast;
    if (output_mask[0]) ctx->saved_data["fused_input"] = grad_input.detach();
    if (output_mask[1]) ctx->saved_data["fused_target"] = grad_target.detach();
    ctx->mark_non_differentiable({grad_input, grad_target});
    return {out, grad_input, grad_target};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor& grad = grads[0];
    if (!grad.defined()) return variable_list(kArguments);
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& input = saved[0];
    const at::Tensor& target = saved[1];
    const OptionalTensor weight = defined_or_none(saved[2]);
    const OptionalTensor scale = defined_or_none(saved[3]);
    const OptionalTensor divisor = defined_or_none(saved[4]);
    const std::array<bool, 2> needs = {ctx->needs_input_grad(0), ctx->needs_input_grad(1)};
    auto& data = ctx->saved_data;
    const double host_scale = data["host_scale"].toDouble();
    const std::string loss = data["loss"].toStringRef();
    const double param = data["param"].toDouble();
    const bool autocast = data["autocast"].toBool();
    if (at::GradMode::is_enabled()) {
      static const auto op =
          find_op<Tensors2(const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptionalTensor&,
                           const OptionalTensor&, const OptionalTensor&, double, c10::string_view, double, bool)>(
              "fusedloss::weighted_loss_gradients");
      auto [grad_input, grad_target] =
          op.call(grad, input, target, weight, scale, divisor, host_scale, loss, param, autocast);
      return operand_gradients(needs[0] ? summed_to(grad_input, input) : at::Tensor(),
                               needs[1] ? summed_to(grad_target, target) : at::Tensor(), kArguments);
    }
    const bool fused_cover_needs = (data.count("fused_input") > 0 || !needs[0]) &&
                                   (data.count("fused_target") > 0 || !needs[1]);
    at::Tensor grad_input, grad_target;
    if (fused_cover_needs && (data.count("fused_input") > 0 || data.count("fused_target") > 0)) {
      std::tie(grad_input, grad_target) = take_fused_gradients(data, needs, grad, -1);
    } else {
      std::tie(grad_input, grad_target) = call_weighted_loss_backward(grad, input, target, weight, scale, divisor,
                                                                      host_scale, loss, param, needs, autocast);
    }
    return operand_gradients(needs[0] ? summed_to(grad_input, input) : at::Tensor(),
                             needs[1] ? summed_to(grad_target, target) : at::Tensor(), kArguments);
  }
};

class PointwiseLoss : public torch::autograd::Function<PointwiseLoss> {
 public:
  static constexpr size_t kArguments = 4;

  static variable_list forward(AutogradContext* ctx, const at::Tensor& input, const at::Tensor& target,
                               const std::string& loss, double param) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    at::Tensor out = call_pointwise_loss(input, target, loss, param);
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({input, target});
    ctx->saved_data["loss"] = loss;
    ctx->saved_data["param"] = param;
    return {out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor& grad = grads[0];
    if (!grad.defined()) return variable_list(kArguments);
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& input = saved[0];
    const at::Tensor& target = saved[1];
    const std::array<bool, 2> needs = {ctx->needs_input_grad(0), ctx->needs_input_grad(1)};
    const std::string loss = ctx->saved_data["loss"].toStringRef();
    const double param = ctx->saved_data["param"].toDouble();
    at::Tensor grad_input, grad_target;
    if (at::GradMode::is_enabled()) {
      std::tie(grad_input, grad_target) = call_loss_gradients(grad, input, target, loss, param, "none", false);
    } else {
      std::tie(grad_input, grad_target) = call_pointwise_loss_backward(grad, input, target, loss, param, needs);
      grad_input = needs[0] ? summed_to(grad_input, input) : at::Tensor();
      grad_target = needs[1] ? summed_to(grad_target, target) : at::Tensor();
    }
    return operand_gradients(needs[0] ? grad_input : at::Tensor(), needs[1] ? grad_target : at::Tensor(),
                             kArguments);
  }
};

// The autograd kernels: with no gradient wanted, straight to the CUDA kernel.
Tensors3 reduced_loss_autograd(const at::Tensor& input, const at::Tensor& target, c10::string_view loss,
                               double param, c10::string_view reduction, std::array<bool, 2> output_mask,
                               int64_t slot, bool autocast) {
  if (!wants_gradients(input, target)) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return call_reduced_loss(input, target, loss, param, reduction, output_mask, slot, autocast);
  }
  const variable_list out = ReducedLoss::apply(input, target, std::string(loss), param, std::string(reduction),
                                               output_mask, slot, autocast);
  return {out[0], out[1], out[2]};
}

Tensors3 weighted_loss_autograd(const at::Tensor& input, const at::Tensor& target, const OptionalTensor& weight,
                                const OptionalTensor& scale, const OptionalTensor& divisor, double host_scale,
                                c10::string_view loss, double param, std::array<bool, 2> output_mask,
                                bool autocast) {
  const auto requires_grad = [](const OptionalTensor& t) { return t.has_value() && t->requires_grad(); };
  TORCH_CHECK(!at::GradMode::is_enabled() || !(requires_grad(weight) || requires_grad(scale) || requires_grad(divisor)),
              "fusedloss::weighted_loss has no gradient for weight, scale or divisor; fusedloss's loss functions "
              "compute those with torch operations");
  if (!wants_gradients(input, target)) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return call_weighted_loss(input, target, weight, scale, divisor, host_scale, loss, param, output_mask, autocast);
  }
  const variable_list out = WeightedLoss::apply(input, target, weight, scale, divisor, host_scale, std::string(loss),
                                                param, output_mask, autocast);
  return {out[0], out[1], out[2]};
}

at::Tensor pointwise_loss_autograd(const at::Tensor& input, const at::Tensor& target, c10::string_view loss,
                                   double param) {
  if (!wants_gradients(input, target)) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return call_pointwise_loss(input, target, loss, param);
  }
  return PointwiseLoss::apply(input, target, std::string(loss), param)[0];
}

}  // namespace

TORCH_LIBRARY_IMPL(fusedloss, AutogradCUDA, m) {
  m.impl("reduced_loss", &reduced_loss_autograd);
  m.impl("pointwise_loss", &pointwise_loss_autograd);
  m.impl("weighted_loss", &weighted_loss_autograd);
}

}  // namespace fusedloss
