// An optional host-only accelerator: the autograd of the two drop-in paths that a
// small training step takes (a loss reduced without gradients in its forward, and
// reduction='none'), as C++ graph nodes, so that such a step runs no Python in its
// backward. It is compiled per torch with the host C++ compiler (build.py,
// "cxx_autograd"); without it ops.py's autograd.Functions do the same work.
// It calls the fusedloss:: operators below autograd and, for create_graph=True,
// the differentiable fusedloss::loss_gradients, exactly as ops.py's backward does.
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

namespace {

using torch::autograd::Node;
using torch::autograd::SavedVariable;
using torch::autograd::variable_list;
using Tensors2 = std::tuple<at::Tensor, at::Tensor>;
using Tensors3 = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

template <typename Signature>
c10::TypedOperatorHandle<Signature> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

using Reduced = Tensors3(const at::Tensor&, const at::Tensor&, c10::string_view, double, c10::string_view,
                         std::array<bool, 2>, double, bool);
using ReducedBackward = Tensors2(const at::Tensor&, const at::Tensor&, const at::Tensor&, c10::string_view, double,
                                 c10::string_view, std::array<bool, 2>, int64_t, double, bool);
using Pointwise = at::Tensor(const at::Tensor&, const at::Tensor&, c10::string_view, double, bool);
using PointwiseBackward = Tensors2(const at::Tensor&, const at::Tensor&, const at::Tensor&, c10::string_view, double,
                                   std::array<bool, 2>, bool);
using LossGradients = Tensors2(const at::Tensor&, const at::Tensor&, const at::Tensor&, c10::string_view, double,
                               c10::string_view, bool);

// Differentiable gradients for create_graph=True, summed to each operand's shape.
Tensors2 loss_gradients(const at::Tensor& grad, const at::Tensor& input, const at::Tensor& target,
                        const std::string& loss, double param, c10::string_view reduction, bool autocast) {
  static const auto op = find_op<LossGradients>("fusedloss::loss_gradients");
  return op.call(grad, input, target, loss, param, reduction, autocast);
}

at::Tensor summed_to(const at::Tensor& grad, const at::Tensor& operand) {
  return grad.sizes() == operand.sizes() ? grad : grad.sum_to_size(operand.sizes());
}

// Graph nodes made as PyTorch's generated code makes its own: a Node with
// SavedVariables and plain fields, lighter than torch::autograd::Function.
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

void check_no_tangents(const at::Tensor& input, const at::Tensor& target, const char* op) {
  TORCH_CHECK(!torch::autograd::isFwGradDefined(input) && !torch::autograd::isFwGradDefined(target),
              "fusedloss_cxx::", op, " has no forward-mode AD rule; fusedloss's loss functions compute dual "
              "tensors through torch.nn.functional");
}

struct LossBackward : Node {
  SavedVariable input_, target_;
  std::string loss_;
  std::string reduction_ = "none";
  double param_ = 0.0;
  bool autocast_ = false;

  void save(const at::Tensor& input, const at::Tensor& target, c10::string_view loss, double param,
            c10::string_view reduction, bool autocast) {
    set_next_edges(torch::autograd::collect_next_edges(input, target));
    input_ = SavedVariable(input, false);
    target_ = SavedVariable(target, false);
    loss_ = std::string(loss);
    reduction_ = std::string(reduction);
    param_ = param;
    autocast_ = autocast;
  }

  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    input_.reset_data();
    target_.reset_data();
  }

  // The kernels' gradients of (grad, input, target) for the operands wanted.
  virtual Tensors2 gradients(const at::Tensor& grad, const at::Tensor& input, const at::Tensor& target,
                             std::array<bool, 2> wanted) = 0;

  variable_list apply(variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    const at::Tensor& grad = grads[0];
    if (!grad.defined()) return {at::Tensor(), at::Tensor()};
    const at::Tensor input = input_.unpack();
    const at::Tensor target = target_.unpack();
    const std::array<bool, 2> wanted = {task_should_compute_output(0), task_should_compute_output(1)};
    at::Tensor grad_input, grad_target;
    if (at::GradMode::is_enabled()) {
      std::tie(grad_input, grad_target) = loss_gradients(grad, input, target, loss_, param_, reduction_, autocast_);
    } else {
      // The backward operators have no autograd kernel of their own.
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      std::tie(grad_input, grad_target) = gradients(grad, input, target, wanted);
    }
    return {wanted[0] ? summed_to(grad_input, input) : at::Tensor(),
            wanted[1] ? summed_to(grad_target, target) : at::Tensor()};
  }
};

struct ReducedLossBackward : LossBackward {
  std::string name() const override { return "ReducedLossBackward"; }
  Tensors2 gradients(const at::Tensor& grad, const at::Tensor& input, const at::Tensor& target,
                     std::array<bool, 2> wanted) override {
    static const auto op = find_op<ReducedBackward>("fusedloss::reduced_loss_backward");
    return op.call(grad, input, target, loss_, param_, reduction_, wanted, -1, 1.0, autocast_);
  }
};

// Whether grad is expanded over some of its dimensions, not all (the backward of a sum
// over those), as ops.py's _expanded decides.
bool expanded(const at::Tensor& grad) {
  bool some = false, all = true;
  for (int64_t d = 0; d < grad.dim(); ++d) {
    some = some || (grad.stride(d) == 0 && grad.size(d) > 1);
    all = all && grad.stride(d) == 0;
  }
  return some && !all;
}

struct PointwiseLossBackward : LossBackward {
  std::string name() const override { return "PointwiseLossBackward"; }
  Tensors2 gradients(const at::Tensor& grad, const at::Tensor& input, const at::Tensor& target,
                     std::array<bool, 2> wanted) override {
    static const auto op = find_op<PointwiseBackward>("fusedloss::pointwise_loss_backward");
    // The weighted family's kernel reads an expanded grad_output where it lies, where it is loaded.
    static const auto broadcast = find_op<PointwiseBackward>("fusedloss::pointwise_loss_backward_broadcast");
    const bool in_place = grad.is_cuda() && expanded(grad) && broadcast.hasKernelForDispatchKey(c10::DispatchKey::CUDA);
    return (in_place ? broadcast : op).call(grad, input, target, loss_, param_, wanted, autocast_);
  }
};

template <typename NodeType>
at::Tensor with_history(at::Tensor out, const at::Tensor& input, const at::Tensor& target, c10::string_view loss,
                        double param, c10::string_view reduction, bool autocast) {
  if (at::GradMode::is_enabled() && (input.requires_grad() || target.requires_grad())) {
    auto node = make_node<NodeType>();
    node->save(input, target, loss, param, reduction, autocast);
    torch::autograd::set_history(out, node);
  }
  return out;
}

at::Tensor reduced_loss(const at::Tensor& input, const at::Tensor& target, c10::string_view loss, double param,
                        c10::string_view reduction, bool autocast) {
  check_no_tangents(input, target, "reduced_loss");
  static const auto op = find_op<Reduced>("fusedloss::reduced_loss");
  at::Tensor out;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    out = std::get<0>(op.call(input, target, loss, param, reduction, {false, false}, 1.0, autocast));
  }
  return with_history<ReducedLossBackward>(std::move(out), input, target, loss, param, reduction, autocast);
}

at::Tensor pointwise_loss(const at::Tensor& input, const at::Tensor& target, c10::string_view loss, double param,
                          bool autocast) {
  check_no_tangents(input, target, "pointwise_loss");
  static const auto op = find_op<Pointwise>("fusedloss::pointwise_loss");
  at::Tensor out;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    out = op.call(input, target, loss, param, autocast);
  }
  return with_history<PointwiseLossBackward>(std::move(out), input, target, loss, param, "none", autocast);
}

}  // namespace

// Registered as composites: they make their own graph nodes, for any device the
// fusedloss:: operators serve.
TORCH_LIBRARY(fusedloss_cxx, m) {
  m.def("reduced_loss(Tensor input, Tensor target, str loss, float param, str reduction, bool autocast) -> Tensor",
        &reduced_loss);
  m.def("pointwise_loss(Tensor input, Tensor target, str loss, float param, bool autocast) -> Tensor",
        &pointwise_loss);
}
