// Autograd for the fusedloss:: operators on CUDA, in C++: a training step's
// backward then runs no Python. The formulas are ops.py's, which registers them
// for every other device; both hand create_graph=True to the differentiable
// fusedloss::loss_gradients (defined in Python).
#include <ATen/ExpandUtils.h>
#include <ATen/TensorSubclassLikeUtils.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/library.h>

#include <array>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>

namespace fusedloss {
namespace {

using torch::autograd::Node;
using torch::autograd::SavedVariable;
using torch::autograd::variable_list;
using Tensors2 = std::tuple<at::Tensor, at::Tensor>;
using Tensors3 = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
using Tensors4 = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

template <typename Signature>
c10::TypedOperatorHandle<Signature> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

Tensors3 call_reduced_loss(const at::Tensor& input, const at::Tensor& target, c10::string_view loss, double param,
                           c10::string_view reduction, std::array<bool, 2> output_mask, int64_t slot,
                           double expected_grad_output, bool autocast) {
  static const auto op = find_op<Tensors3(const at::Tensor&, const at::Tensor&, c10::string_view, double,
                                          c10::string_view, std::array<bool, 2>, int64_t, double, bool)>(
      "fusedloss::reduced_loss");
  return op.call(input, target, loss, param, reduction, output_mask, slot, expected_grad_output, autocast);
}

Tensors2 call_reduced_loss_backward(const at::Tensor& grad, const at::Tensor& input, const at::Tensor& target,
                                    c10::string_view loss, double param, c10::string_view reduction,
                                    std::array<bool, 2> output_mask, int64_t slot, double expected_grad_output,
                                    bool autocast) {
  static const auto op = find_op<Tensors2(const at::Tensor&, const at::Tensor&, const at::Tensor&, c10::string_view,
                                          double, c10::string_view, std::array<bool, 2>, int64_t, double, bool)>(
      "fusedloss::reduced_loss_backward");
  return op.call(grad, input, target, loss, param, reduction, output_mask, slot, expected_grad_output, autocast);
}

void call_reduced_loss_backward_(at::Tensor& grad_input, at::Tensor& grad_target, const at::Tensor& grad,
                                 const at::Tensor& input, const at::Tensor& target, c10::string_view loss,
                                 double param, c10::string_view reduction, double expected_grad_output,
                                 int64_t slot, bool autocast) {
  static const auto op =
      find_op<void(at::Tensor&, at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                   c10::string_view, double, c10::string_view, double, int64_t, bool)>(
          "fusedloss::reduced_loss_backward_");
  op.call(grad_input, grad_target, grad, input, target, loss, param, reduction, expected_grad_output, slot,
          autocast);
}

using OptionalTensor = c10::optional<at::Tensor>;

Tensors4 call_weighted_loss(const at::Tensor& input, const at::Tensor& target, const OptionalTensor& weight,
                            const OptionalTensor& scale, const OptionalTensor& divisor, double host_scale,
                            c10::string_view loss, double param, std::array<bool, 3> output_mask, int64_t slot,
                            double expected_grad_output, bool autocast) {
  static const auto op =
      find_op<Tensors4(const at::Tensor&, const at::Tensor&, const OptionalTensor&, const OptionalTensor&,
                       const OptionalTensor&, double, c10::string_view, double, std::array<bool, 3>, int64_t,
                       double, bool)>("fusedloss::weighted_loss");
  return op.call(input, target, weight, scale, divisor, host_scale, loss, param, output_mask, slot,
                 expected_grad_output, autocast);
}

Tensors3 call_weighted_loss_backward(const at::Tensor& grad, const at::Tensor& input, const at::Tensor& target,
                                     const OptionalTensor& weight, const OptionalTensor& scale,
                                     const OptionalTensor& divisor, double host_scale, c10::string_view loss,
                                     double param, std::array<bool, 3> output_mask, int64_t slot,
                                     double expected_grad_output, bool autocast) {
  static const auto op =
      find_op<Tensors3(const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptionalTensor&,
                       const OptionalTensor&, const OptionalTensor&, double, c10::string_view, double,
                       std::array<bool, 3>, int64_t, double, bool)>("fusedloss::weighted_loss_backward");
  return op.call(grad, input, target, weight, scale, divisor, host_scale, loss, param, output_mask, slot,
                 expected_grad_output, autocast);
}

void call_weighted_loss_backward_(at::Tensor& grad_input, at::Tensor& grad_target, at::Tensor& grad_weight,
                                  const at::Tensor& grad, const at::Tensor& input, const at::Tensor& target,
                                  const OptionalTensor& weight, const OptionalTensor& scale,
                                  const OptionalTensor& divisor, double host_scale, c10::string_view loss,
                                  double param, double expected_grad_output, int64_t slot, bool autocast) {
  static const auto op =
      find_op<void(at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                   const OptionalTensor&, const OptionalTensor&, const OptionalTensor&, double, c10::string_view,
                   double, double, int64_t, bool)>("fusedloss::weighted_loss_backward_");
  op.call(grad_input, grad_target, grad_weight, grad, input, target, weight, scale, divisor, host_scale, loss, param,
          expected_grad_output, slot, autocast);
}

at::Tensor call_pointwise_loss(const at::Tensor& input, const at::Tensor& target, c10::string_view loss,
                               double param, bool autocast) {
  static const auto op = find_op<at::Tensor(const at::Tensor&, const at::Tensor&, c10::string_view, double, bool)>(
      "fusedloss::pointwise_loss");
  return op.call(input, target, loss, param, autocast);
}

Tensors2 call_pointwise_loss_backward(const at::Tensor& grad, const at::Tensor& input, const at::Tensor& target,
                                      c10::string_view loss, double param, std::array<bool, 2> output_mask,
                                      bool autocast) {
  static const auto op = find_op<Tensors2(const at::Tensor&, const at::Tensor&, const at::Tensor&, c10::string_view,
                                          double, std::array<bool, 2>, bool)>("fusedloss::pointwise_loss_backward");
  return op.call(grad, input, target, loss, param, output_mask, autocast);
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

// Each operator's backward is a graph node made as PyTorch's generated code
// makes its own: a Node holding SavedVariables and plain fields. A
// torch::autograd::Function does the same work with a string-keyed map of saved
// values and checks of its outputs against every forward argument, which cost a
// small training step more host time than eager PyTorch's whole loss.
// Node is held by std::shared_ptr in older torch and by c10::intrusive_ptr in newer.
template <typename T>
auto make_node() {
  using NodePtr = decltype(torch::autograd::Edge::function);
  if constexpr (std::is_same_v<NodePtr, std::shared_ptr<Node>>) {
    // deleteNode frees a long chain of nodes without recursing through it.
    return std::shared_ptr<T>(new T(), [](T* node) { deleteNode(node); });
  } else {
    return c10::make_intrusive<T>();
  }
}

// Forward-mode AD has no rule here; fusedloss.functional hands dual tensors to
// torch.nn.functional before they get here, and a direct call must not drop a tangent.
void check_no_tangents(const at::Tensor& input, const at::Tensor& target, const char* op) {
  TORCH_CHECK(!torch::autograd::isFwGradDefined(input) && !torch::autograd::isFwGradDefined(target), "fusedloss::",
              op, " has no forward-mode AD rule; fusedloss's loss functions compute dual tensors through "
              "torch.nn.functional");
}

// What every node keeps: the operands, and the loss with its parameter. Outside
// create_graph the nodes call the kernels below autograd: the backward operators
// have no autograd kernel, and autograd's fallback for them boxes every argument.
struct LossBackward : Node {
  SavedVariable input_, target_;
  std::string loss_;
  double param_ = 0.0;
  bool autocast_ = false;

  void save(const at::Tensor& input, const at::Tensor& target, c10::string_view loss, double param, bool autocast) {
    set_next_edges(torch::autograd::collect_next_edges(input, target));
    input_ = SavedVariable(input, false);
    target_ = SavedVariable(target, false);
    loss_ = std::string(loss);
    param_ = param;
    autocast_ = autocast;
  }

  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    input_.reset_data();
    target_.reset_data();
  }

  std::array<bool, 2> needs() const { return {task_should_compute_output(0), task_should_compute_output(1)}; }

  // Each gradient summed to its operand's shape, and only where wanted.
  static variable_list operand_gradients(const at::Tensor& grad_input, const at::Tensor& grad_target,
                                         const at::Tensor& input, const at::Tensor& target,
                                         std::array<bool, 2> needs) {
    return {needs[0] ? summed_to(grad_input, input) : at::Tensor(),
            needs[1] ? summed_to(grad_target, target) : at::Tensor()};
  }
};

// The gradients the forward wrote for an expected grad_output: input's, target's
// and (for weighted_loss) the weight's, per element. Backward corrects them in place
// where grad_output turns out otherwise (on the GPU), so only the first backward
// through a graph may use them; they are handed over without a copy.
using Needs = std::array<bool, 3>;
using Gradients = std::array<at::Tensor, 3>;

struct FusedGradients {
  Gradients grads;
  int64_t slot = -1;  // where backward notes grad_output
  double expected_grad_output = 1.0;

  // What the forward wrote: the reduction's outputs after the loss, where asked.
  template <class Outputs>
  void keep(const Outputs& outputs, Needs written) {
    if (written[0]) grads[0] = std::get<1>(outputs);
    if (written[1]) grads[1] = std::get<2>(outputs);
    if constexpr (std::tuple_size_v<Outputs> > 3) {
      if (written[2]) grads[2] = std::get<3>(outputs);
    }
  }

  // Whether they hold every gradient wanted, as tensors the kernels can correct (a
  // traced subclass recomputes them instead).
  bool cover(Needs needs) const {
    bool any = false;
    for (size_t i = 0; i < grads.size(); ++i) {
      if (needs[i] && !grads[i].defined()) return false;
      if (grads[i].defined() && at::isTensorSubclassLike(grads[i])) return false;
      any = any || grads[i].defined();
    }
    return any;
  }

  // The wanted gradients, after `correct` has had them in place (an empty tensor
  // stands for each one not wanted).
  template <class Correct>
  Gradients take(Needs needs, const at::Tensor& like, Correct&& correct) {
    Gradients out, args;
    for (size_t i = 0; i < grads.size(); ++i) {
      at::Tensor fused = std::move(grads[i]);
      if (needs[i]) out[i] = std::move(fused);
      args[i] = out[i].defined() ? out[i] : at::empty({0}, like.options());
    }
    {
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      correct(args[0], args[1], args[2]);
    }
    for (const at::Tensor& g : out) {
      if (g.defined()) torch::autograd::impl::bump_version(g);
    }
    return out;
  }
};

// The fused gradient, corrected where grad_output was not the one expected, or
// the gradient recomputed from the operands: the same bits either way (ops.py).
struct ReducedLossBackward : LossBackward {
  std::string reduction_;
  FusedGradients fused_;

  std::string name() const override { return "ReducedLossBackward"; }

  void release_variables() override {
    LossBackward::release_variables();
    std::lock_guard<std::mutex> lock(mutex_);
    fused_ = FusedGradients();
  }

  variable_list apply(variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    const at::Tensor& grad = grads[0];
    if (!grad.defined()) return {at::Tensor(), at::Tensor()};
    const at::Tensor input = input_.unpack();
    const at::Tensor target = target_.unpack();
    const auto wanted = needs();
    at::Tensor grad_input, grad_target;
    if (at::GradMode::is_enabled()) {
      std::tie(grad_input, grad_target) =
          call_loss_gradients(grad, input, target, loss_, param_, reduction_, autocast_);
    } else if (const Needs operands{wanted[0], wanted[1], false}; fused_.cover(operands)) {
      Gradients fused = fused_.take(operands, input, [&](at::Tensor& gi, at::Tensor& gt, at::Tensor&) {
        call_reduced_loss_backward_(gi, gt, grad, input, target, loss_, param_, reduction_,
                                    fused_.expected_grad_output, fused_.slot, autocast_);
      });
      grad_input = std::move(fused[0]);
      grad_target = std::move(fused[1]);
    } else {
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      std::tie(grad_input, grad_target) =
          call_reduced_loss_backward(grad, input, target, loss_, param_, reduction_, wanted, fused_.slot,
                                     fused_.expected_grad_output, autocast_);
    }
    return operand_gradients(grad_input, grad_target, input, target, wanted);
  }
};

OptionalTensor defined_or_none(const at::Tensor& t) { return t.defined() ? OptionalTensor(t) : c10::nullopt; }

// The weighted reductions: ReducedLoss's plan with a weight, whose gradient per
// element (scale times the element's loss) the kernels write beside the
// operands', and a divisor, d out / d divisor = -out / divisor. A scale takes no
// gradient here (weighted_loss_autograd refuses it; fusedloss.functional
// computes that case with torch operations). create_graph=True, and a weight's
// gradient wanted alone, go through ops.py's formulas.
struct WeightedLossBackward : LossBackward {
  SavedVariable weight_, scale_, divisor_, out_;
  double host_scale_ = 1.0;
  FusedGradients fused_;

  std::string name() const override { return "WeightedLossBackward"; }

  void release_variables() override {
    LossBackward::release_variables();
    std::lock_guard<std::mutex> lock(mutex_);
    weight_.reset_data();
    scale_.reset_data();
    divisor_.reset_data();
    out_.reset_data();
    fused_ = FusedGradients();
  }

  variable_list apply(variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    const at::Tensor& grad = grads[0];
    if (!grad.defined()) return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    const at::Tensor input = input_.unpack();
    const at::Tensor target = target_.unpack();
    const at::Tensor weight_tensor = weight_.unpack();
    const OptionalTensor weight = defined_or_none(weight_tensor);
    const OptionalTensor scale = defined_or_none(scale_.unpack());
    const at::Tensor divisor = divisor_.unpack();
    const Needs wanted = {task_should_compute_output(0), task_should_compute_output(1),
                          task_should_compute_output(2)};
    Gradients g;
    if (at::GradMode::is_enabled() || (wanted[2] && !wanted[0] && !wanted[1])) {
      static const auto op =
          find_op<Tensors3(const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptionalTensor&,
                           const OptionalTensor&, const OptionalTensor&, double, c10::string_view, double, bool)>(
              "fusedloss::weighted_loss_gradients");
      std::tie(g[0], g[1], g[2]) = op.call(grad, input, target, weight, scale, defined_or_none(divisor), host_scale_,
                                           loss_, param_, autocast_);
    } else if (fused_.cover(wanted)) {
      g = fused_.take(wanted, input, [&](at::Tensor& gi, at::Tensor& gt, at::Tensor& gw) {
        call_weighted_loss_backward_(gi, gt, gw, grad, input, target, weight, scale, defined_or_none(divisor),
                                     host_scale_, loss_, param_, fused_.expected_grad_output, fused_.slot,
                                     autocast_);
      });
    } else {
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      std::tie(g[0], g[1], g[2]) = call_weighted_loss_backward(grad, input, target, weight, scale,
                                                               defined_or_none(divisor), host_scale_, loss_, param_,
                                                               wanted, fused_.slot, fused_.expected_grad_output,
                                                               autocast_);
    }
    variable_list out = operand_gradients(g[0], g[1], input, target, {wanted[0], wanted[1]});
    out.push_back(wanted[2] ? summed_to(g[2], weight_tensor).to(weight_tensor.scalar_type()) : at::Tensor());
    at::Tensor grad_divisor;
    if (task_should_compute_output(3)) {
      const at::ScalarType dtype = divisor.scalar_type();
      grad_divisor = at::div(at::neg(at::mul(grad.to(dtype), out_.unpack(getptr()).to(dtype))), divisor);
    }
    out.push_back(grad_divisor);
    return out;
  }
};

struct PointwiseLossBackward : LossBackward {
  std::string name() const override { return "PointwiseLossBackward"; }

  variable_list apply(variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    const at::Tensor& grad = grads[0];
    if (!grad.defined()) return {at::Tensor(), at::Tensor()};
    const at::Tensor input = input_.unpack();
    const at::Tensor target = target_.unpack();
    const auto wanted = needs();
    at::Tensor grad_input, grad_target;
    if (at::GradMode::is_enabled()) {  // already summed to each operand's shape
      std::tie(grad_input, grad_target) = call_loss_gradients(grad, input, target, loss_, param_, "none", autocast_);
    } else {
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      std::tie(grad_input, grad_target) =
          call_pointwise_loss_backward(grad, input, target, loss_, param_, wanted, autocast_);
    }
    return operand_gradients(grad_input, grad_target, input, target, wanted);
  }
};

// The autograd kernels: with no gradient wanted, straight to the CUDA kernel.
Tensors3 reduced_loss_autograd(const at::Tensor& input, const at::Tensor& target, c10::string_view loss,
                               double param, c10::string_view reduction, std::array<bool, 2> output_mask,
                               int64_t slot, double expected_grad_output, bool autocast) {
  check_no_tangents(input, target, "reduced_loss");
  Tensors3 outputs;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    outputs = call_reduced_loss(input, target, loss, param, reduction, output_mask, slot, expected_grad_output,
                                autocast);
  }
  if (!wants_gradients(input, target)) return outputs;
  auto node = make_node<ReducedLossBackward>();
  node->save(input, target, loss, param, autocast);
  node->reduction_ = std::string(reduction);
  node->fused_.slot = slot;
  node->fused_.expected_grad_output = expected_grad_output;
  node->fused_.keep(outputs, {output_mask[0], output_mask[1], false});
  torch::autograd::set_history(std::get<0>(outputs), node);
  return outputs;
}

Tensors4 weighted_loss_autograd(const at::Tensor& input, const at::Tensor& target, const OptionalTensor& weight,
                                const OptionalTensor& scale, const OptionalTensor& divisor, double host_scale,
                                c10::string_view loss, double param, std::array<bool, 3> output_mask, int64_t slot,
                                double expected_grad_output, bool autocast) {
  check_no_tangents(input, target, "weighted_loss");
  const at::Tensor weight_tensor = weight.value_or(at::Tensor());
  const at::Tensor divisor_tensor = divisor.value_or(at::Tensor());
  TORCH_CHECK(!torch::autograd::isFwGradDefined(weight_tensor) && !torch::autograd::isFwGradDefined(divisor_tensor),
              "fusedloss::weighted_loss has no forward-mode AD rule; fusedloss's loss functions compute dual "
              "tensors through torch.nn.functional");
  const bool grad_mode = at::GradMode::is_enabled();
  TORCH_CHECK(!grad_mode || !(scale.has_value() && scale->requires_grad()),
              "fusedloss::weighted_loss has no gradient for scale; fusedloss's loss functions compute it with "
              "torch operations");
  Tensors4 outputs;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    outputs = call_weighted_loss(input, target, weight, scale, divisor, host_scale, loss, param, output_mask, slot,
                                 expected_grad_output, autocast);
  }
  const bool weight_grad = weight_tensor.defined() && weight_tensor.requires_grad();
  const bool divisor_grad = divisor_tensor.defined() && divisor_tensor.requires_grad();
  if (!grad_mode || !(input.requires_grad() || target.requires_grad() || weight_grad || divisor_grad)) {
    return outputs;
  }
  auto node = make_node<WeightedLossBackward>();
  node->save(input, target, loss, param, autocast);
  node->set_next_edges(torch::autograd::collect_next_edges(input, target, weight_tensor, divisor_tensor));
  node->weight_ = SavedVariable(weight_tensor, false);
  node->scale_ = SavedVariable(scale.value_or(at::Tensor()), false);
  node->divisor_ = SavedVariable(divisor_tensor, false);
  node->host_scale_ = host_scale;
  node->fused_.slot = slot;
  node->fused_.expected_grad_output = expected_grad_output;
  node->fused_.keep(outputs, output_mask);
  torch::autograd::set_history(std::get<0>(outputs), node);
  if (divisor_grad) node->out_ = SavedVariable(std::get<0>(outputs), true);
  return outputs;
}

at::Tensor pointwise_loss_autograd(const at::Tensor& input, const at::Tensor& target, c10::string_view loss,
                                   double param, bool autocast) {
  check_no_tangents(input, target, "pointwise_loss");
  at::Tensor out;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    out = call_pointwise_loss(input, target, loss, param, autocast);
  }
  if (!wants_gradients(input, target)) return out;
  auto node = make_node<PointwiseLossBackward>();
  node->save(input, target, loss, param, autocast);
  torch::autograd::set_history(out, node);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(fusedloss, AutogradCUDA, m) {
  m.impl("reduced_loss", &reduced_loss_autograd);
  m.impl("pointwise_loss", &pointwise_loss_autograd);
  m.impl("weighted_loss", &weighted_loss_autograd);
}

}  // namespace fusedloss
