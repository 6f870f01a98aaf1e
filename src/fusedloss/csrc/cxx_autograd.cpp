// An optional host-only accelerator: the autograd of the paths that a small training
// step takes (a loss reduced without gradients in its forward, weighted or not,
// reduction='none', and the Gaussian and Poisson NLL's fused pass), as C++ graph nodes, so that such a step
// runs no Python in its backward. It is compiled per torch with the host C++ compiler (build.py,
// "cxx_autograd"); without it ops.py's autograd.Functions do the same work.
// It calls the fusedloss:: operators below autograd and, for create_graph=True,
// the differentiable fusedloss::loss_gradients, weighted_loss_gradients and
// likelihood_gradients, exactly as ops.py's and likelihood.py's backward do.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/library.h>

#include <array>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>

namespace {

using torch::autograd::Node;
using torch::autograd::SavedVariable;
using torch::autograd::variable_list;
using torch::jit::Stack;
using Tensors2 = std::tuple<at::Tensor, at::Tensor>;
using OptionalTensor = std::optional<at::Tensor>;

// The fusedloss:: operators are called boxed: their kernels are boxed already (stable
// ABI), and a typed call would instantiate the dispatcher's boxing templates for each
// signature, which is most of this file's compile time.
class Op {
 public:
  explicit Op(const char* name) : handle_(c10::Dispatcher::singleton().findSchemaOrThrow(name, "")) {}

  template <typename... Args>
  Stack operator()(Args&&... args) const {
    Stack stack;
    stack.reserve(sizeof...(Args));
    (stack.emplace_back(std::forward<Args>(args)), ...);
    handle_.callBoxed(&stack);
    return stack;
  }

  bool has_kernel_for(c10::DispatchKey key) const { return handle_.hasKernelForDispatchKey(key); }

 private:
  c10::OperatorHandle handle_;
};

Tensors2 first_two(const Stack& out) { return {out[0].toTensor(), out[1].toTensor()}; }

// Differentiable gradients for create_graph=True, summed to each operand's shape.
Tensors2 loss_gradients(const at::Tensor& grad, const at::Tensor& input, const at::Tensor& target,
                        const std::string& loss, double param, const std::string& reduction, bool autocast) {
  static const Op op("fusedloss::loss_gradients");
  return first_two(op(grad, input, target, loss, param, reduction, autocast));
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

void check_no_tangents(const at::Tensor& input, const at::Tensor& target, const char* op,
                       const at::Tensor& var = at::Tensor()) {
  TORCH_CHECK(!torch::autograd::isFwGradDefined(input) && !torch::autograd::isFwGradDefined(target) &&
                  !torch::autograd::isFwGradDefined(var),
              "fusedloss_cxx::", op, " has no forward-mode AD rule; fusedloss's loss functions compute dual "
              "tensors through torch.nn.functional");
}

// A node whose edges go to input and target: the gradients a subclass computes, summed
// to each operand's shape.
struct OperandsBackward : Node {
  SavedVariable input_, target_;

  void save_operands(const at::Tensor& input, const at::Tensor& target) {
    set_next_edges(torch::autograd::collect_next_edges(input, target));
    input_ = SavedVariable(input, false);
    target_ = SavedVariable(target, false);
  }

  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    input_.reset_data();
    target_.reset_data();
    release_constants();
  }

  virtual void release_constants() {}

  // create_graph=True: gradients that autograd can differentiate again.
  virtual Tensors2 differentiable_gradients(const at::Tensor& grad, const at::Tensor& input,
                                            const at::Tensor& target) = 0;

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
      std::tie(grad_input, grad_target) = differentiable_gradients(grad, input, target);
    } else {
      // The backward operators have no autograd kernel of their own.
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      std::tie(grad_input, grad_target) = gradients(grad, input, target, wanted);
    }
    return {wanted[0] ? summed_to(grad_input, input) : at::Tensor(),
            wanted[1] ? summed_to(grad_target, target) : at::Tensor()};
  }
};

struct LossBackward : OperandsBackward {
  std::string loss_;
  std::string reduction_ = "none";
  double param_ = 0.0;
  bool autocast_ = false;

  void save(const at::Tensor& input, const at::Tensor& target, const std::string& loss, double param,
            const std::string& reduction, bool autocast) {
    save_operands(input, target);
    loss_ = loss;
    reduction_ = reduction;
    param_ = param;
    autocast_ = autocast;
  }

  Tensors2 differentiable_gradients(const at::Tensor& grad, const at::Tensor& input,
                                    const at::Tensor& target) override {
    return loss_gradients(grad, input, target, loss_, param_, reduction_, autocast_);
  }
};

struct ReducedLossBackward : LossBackward {
  std::string name() const override { return "ReducedLossBackward"; }
  Tensors2 gradients(const at::Tensor& grad, const at::Tensor& input, const at::Tensor& target,
                     std::array<bool, 2> wanted) override {
    static const Op op("fusedloss::reduced_loss_backward");
    return first_two(op(grad, input, target, loss_, param_, reduction_, wanted, int64_t{-1}, 1.0, autocast_));
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
    static const Op op("fusedloss::pointwise_loss_backward");
    // The weighted family's kernel reads an expanded grad_output where it lies, where it is loaded.
    static const Op broadcast("fusedloss::pointwise_loss_backward_broadcast");
    const bool in_place = grad.is_cuda() && expanded(grad) && broadcast.has_kernel_for(c10::DispatchKey::CUDA);
    return first_two((in_place ? broadcast : op)(grad, input, target, loss_, param_, wanted, autocast_));
  }
};

template <typename NodeType>
at::Tensor with_history(at::Tensor out, const at::Tensor& input, const at::Tensor& target, const std::string& loss,
                        double param, const std::string& reduction, bool autocast) {
  if (at::GradMode::is_enabled() && (input.requires_grad() || target.requires_grad())) {
    auto node = make_node<NodeType>();
    node->save(input, target, loss, param, reduction, autocast);
    torch::autograd::set_history(out, node);
  }
  return out;
}

at::Tensor reduced_loss(const at::Tensor& input, const at::Tensor& target, const std::string& loss, double param,
                        const std::string& reduction, bool autocast) {
  check_no_tangents(input, target, "reduced_loss");
  static const Op op("fusedloss::reduced_loss");
  at::Tensor out;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    out = op(input, target, loss, param, reduction, std::array<bool, 2>{false, false}, 1.0, autocast)[0].toTensor();
  }
  return with_history<ReducedLossBackward>(std::move(out), input, target, loss, param, reduction, autocast);
}

at::Tensor pointwise_loss(const at::Tensor& input, const at::Tensor& target, const std::string& loss, double param,
                          bool autocast) {
  check_no_tangents(input, target, "pointwise_loss");
  static const Op op("fusedloss::pointwise_loss");
  at::Tensor out;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    out = op(input, target, loss, param, autocast)[0].toTensor();
  }
  return with_history<PointwiseLossBackward>(std::move(out), input, target, loss, param, "none", autocast);
}

// The Gaussian and Poisson NLL's fused pass (likelihood.py's FusedLikelihood): the
// forward's gradients, written for the grad_output expected, handed on by the first
// backward and corrected in place on the GPU where grad_output is another; where the
// forward wrote none, and in a later backward (retain_graph), computed.
struct LikelihoodLossBackward : Node {
  SavedVariable input_, target_, var_;
  bool has_var_ = false;
  std::string kind_, reduction_;
  double eps_ = 0.0;
  bool full_ = false;
  double scale_ = 1.0;
  std::array<bool, 3> forward_mask_ = {false, false, false};
  std::array<at::Tensor, 3> written_;
  bool has_written_ = false;
  int64_t history_slot_ = -1;
  double expected_grad_output_ = 1.0;

  std::string name() const override { return "LikelihoodBackward"; }

  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    input_.reset_data();
    target_.reset_data();
    var_.reset_data();
    written_ = {};
    has_written_ = false;
  }

  variable_list apply(variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    const at::Tensor& grad = grads[0];
    if (!grad.defined()) return {at::Tensor(), at::Tensor(), at::Tensor()};
    const at::Tensor input = input_.unpack();
    const at::Tensor target = target_.unpack();
    const OptionalTensor var = has_var_ ? OptionalTensor(var_.unpack()) : std::nullopt;
    const std::array<bool, 3> wanted = {task_should_compute_output(0), task_should_compute_output(1),
                                        has_var_ && task_should_compute_output(2)};
    std::array<at::Tensor, 3> out;
    if (at::GradMode::is_enabled()) {  // create_graph: PyTorch's formula, differentiable again
      static const Op op("fusedloss::likelihood_gradients");
      const Stack result = op(grad, input, target, var, kind_, eps_, full_, reduction_, wanted, scale_);
      out = {result[0].toTensor(), result[1].toTensor(), result[2].toTensor()};
    } else {
      static const Op compute("fusedloss::likelihood_loss_backward");
      static const Op correct("fusedloss::likelihood_loss_backward_");
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      if (has_written_) {
        out = std::move(written_);
        written_ = {};
        has_written_ = false;
        correct(out[0], out[1], out[2], grad, input, target, var, kind_, eps_, full_, reduction_,
                     expected_grad_output_, history_slot_, scale_);
      } else {
        const Stack result = compute(grad, input, target, var, kind_, eps_, full_, reduction_, forward_mask_,
                                     history_slot_, expected_grad_output_, scale_);
        out = {result[0].toTensor(), result[1].toTensor(), result[2].toTensor()};
      }
    }
    return {wanted[0] ? out[0] : at::Tensor(), wanted[1] ? out[1] : at::Tensor(),
            wanted[2] ? out[2] : at::Tensor()};
  }
};

at::Tensor likelihood_loss(const at::Tensor& input, const at::Tensor& target, const OptionalTensor& var,
                           const std::string& kind, double eps, bool full, const std::string& reduction,
                           int64_t history_slot, double expected_grad_output, bool writes, double scale) {
  const at::Tensor no_var;
  const at::Tensor& var_or_none = var.has_value() ? *var : no_var;
  check_no_tangents(input, target, "likelihood_loss", var_or_none);
  static const Op op("fusedloss::likelihood_loss");
  const bool grad_mode = at::GradMode::is_enabled();
  const std::array<bool, 3> mask = {grad_mode && input.requires_grad(), grad_mode && target.requires_grad(),
                                    grad_mode && var_or_none.defined() && var_or_none.requires_grad()};
  Stack result;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    const std::array<bool, 3> written = {writes && mask[0], writes && mask[1], writes && mask[2]};
    result = op(input, target, var, kind, eps, full, reduction, written, expected_grad_output, scale);
  }
  at::Tensor out = result[0].toTensor();
  if (mask[0] || mask[1] || mask[2]) {
    auto node = make_node<LikelihoodLossBackward>();
    node->set_next_edges(torch::autograd::collect_next_edges(input, target, var_or_none));
    node->input_ = SavedVariable(input, false);
    node->target_ = SavedVariable(target, false);
    node->has_var_ = var_or_none.defined();
    if (node->has_var_) node->var_ = SavedVariable(var_or_none, false);
    node->kind_ = kind;
    node->reduction_ = reduction;
    node->eps_ = eps;
    node->full_ = full;
    node->scale_ = scale;
    node->forward_mask_ = mask;
    node->written_ = {result[1].toTensor(), result[2].toTensor(), result[3].toTensor()};
    node->has_written_ = writes;
    node->history_slot_ = history_slot;
    node->expected_grad_output_ = expected_grad_output;
    torch::autograd::set_history(out, node);
  }
  return out;
}

// A weighted reduction (weight=, scale=, a param per element) whose forward wrote no
// gradient, where only input and target take gradients: ops.py's _weighted_backward
// for that case. The weight, scale and divisor are constants of the graph.
struct WeightedLossBackward : OperandsBackward {
  OptionalTensor weight_, scale_, divisor_;
  double host_scale_ = 1.0, param_ = 0.0, expected_grad_output_ = 1.0;
  std::string loss_;
  int64_t history_slot_ = -1;
  bool autocast_ = false, param_per_element_ = false;

  std::string name() const override { return "WeightedLossBackward"; }

  void release_constants() override {
    weight_.reset();
    scale_.reset();
    divisor_.reset();
  }

  Tensors2 differentiable_gradients(const at::Tensor& grad, const at::Tensor& input,
                                    const at::Tensor& target) override {
    static const Op op("fusedloss::weighted_loss_gradients");
    return first_two(op(grad, input, target, weight_, scale_, divisor_, host_scale_, loss_, param_, autocast_,
                        param_per_element_));
  }

  Tensors2 gradients(const at::Tensor& grad, const at::Tensor& input, const at::Tensor& target,
                     std::array<bool, 2> wanted) override {
    static const Op op("fusedloss::weighted_loss_backward");
    return first_two(op(grad, input, target, weight_, scale_, divisor_, host_scale_, loss_, param_,
                        std::array<bool, 3>{wanted[0], wanted[1], false}, history_slot_, expected_grad_output_,
                        autocast_, param_per_element_));
  }
};

bool requires_grad(const OptionalTensor& t) { return t.has_value() && t->defined() && t->requires_grad(); }

at::Tensor weighted_loss(const at::Tensor& input, const at::Tensor& target, const OptionalTensor& weight,
                         const OptionalTensor& scale, const OptionalTensor& divisor, double host_scale,
                         const std::string& loss, double param, int64_t history_slot, double expected_grad_output,
                         bool autocast, int64_t weight_kept_dims, bool param_per_element) {
  check_no_tangents(input, target, "weighted_loss");
  TORCH_CHECK(!requires_grad(weight) && !requires_grad(scale) && !requires_grad(divisor),
              "fusedloss_cxx::weighted_loss gives no gradient to weight, scale or divisor; fusedloss's loss "
              "functions take ops.py's autograd for those");
  static const Op op("fusedloss::weighted_loss");
  at::Tensor out;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    out = op(input, target, weight, scale, divisor, host_scale, loss, param, std::array<bool, 3>{false, false, false},
             expected_grad_output, autocast, weight_kept_dims, param_per_element)[0]
              .toTensor();
  }
  if (at::GradMode::is_enabled() && (input.requires_grad() || target.requires_grad())) {
    auto node = make_node<WeightedLossBackward>();
    node->save_operands(input, target);
    node->weight_ = weight;
    node->scale_ = scale;
    node->divisor_ = divisor;
    node->host_scale_ = host_scale;
    node->loss_ = loss;
    node->param_ = param;
    node->history_slot_ = history_slot;
    node->expected_grad_output_ = expected_grad_output;
    node->autocast_ = autocast;
    node->param_per_element_ = param_per_element;
    torch::autograd::set_history(out, node);
  }
  return out;
}

OptionalTensor optional_tensor(const c10::IValue& value) {
  return value.isNone() ? OptionalTensor() : OptionalTensor(value.toTensor());
}

// Boxed entry points, so that registering them instantiates no unboxing templates: each
// reads its arguments from the stack in schema order and leaves its result there.
template <size_t Arguments, typename Call>
void replace_arguments(Stack& stack, Call&& call) {
  at::Tensor out = call(torch::jit::last(stack, Arguments));
  torch::jit::drop(stack, Arguments);
  stack.emplace_back(std::move(out));
}

void reduced_loss_boxed(const c10::OperatorHandle&, Stack* stack) {
  replace_arguments<6>(*stack, [](c10::ArrayRef<c10::IValue> a) {
    return reduced_loss(a[0].toTensor(), a[1].toTensor(), a[2].toStringRef(), a[3].toDouble(), a[4].toStringRef(),
                        a[5].toBool());
  });
}

void pointwise_loss_boxed(const c10::OperatorHandle&, Stack* stack) {
  replace_arguments<5>(*stack, [](c10::ArrayRef<c10::IValue> a) {
    return pointwise_loss(a[0].toTensor(), a[1].toTensor(), a[2].toStringRef(), a[3].toDouble(), a[4].toBool());
  });
}

void weighted_loss_boxed(const c10::OperatorHandle&, Stack* stack) {
  replace_arguments<13>(*stack, [](c10::ArrayRef<c10::IValue> a) {
    return weighted_loss(a[0].toTensor(), a[1].toTensor(), optional_tensor(a[2]), optional_tensor(a[3]),
                         optional_tensor(a[4]), a[5].toDouble(), a[6].toStringRef(), a[7].toDouble(), a[8].toInt(),
                         a[9].toDouble(), a[10].toBool(), a[11].toInt(), a[12].toBool());
  });
}

void likelihood_loss_boxed(const c10::OperatorHandle&, Stack* stack) {
  replace_arguments<11>(*stack, [](c10::ArrayRef<c10::IValue> a) {
    return likelihood_loss(a[0].toTensor(), a[1].toTensor(), optional_tensor(a[2]), a[3].toStringRef(),
                           a[4].toDouble(), a[5].toBool(), a[6].toStringRef(), a[7].toInt(), a[8].toDouble(),
                           a[9].toBool(), a[10].toDouble());
  });
}

}  // namespace

// Registered as composites: they make their own graph nodes, for any device the
// fusedloss:: operators serve.
TORCH_LIBRARY(fusedloss_cxx, m) {
  m.def("reduced_loss(Tensor input, Tensor target, str loss, float param, str reduction, bool autocast) -> Tensor",
        torch::CppFunction::makeFromBoxedFunction<&reduced_loss_boxed>());
  m.def("pointwise_loss(Tensor input, Tensor target, str loss, float param, bool autocast) -> Tensor",
        torch::CppFunction::makeFromBoxedFunction<&pointwise_loss_boxed>());
  m.def("weighted_loss(Tensor input, Tensor target, Tensor? weight, Tensor? scale, Tensor? divisor, "
        "float host_scale, str loss, float param, int history_slot, float expected_grad_output, bool autocast, "
        "int weight_kept_dims, bool param_per_element) -> Tensor",
        torch::CppFunction::makeFromBoxedFunction<&weighted_loss_boxed>());
  m.def("likelihood_loss(Tensor input, Tensor target, Tensor? var, str kind, float eps, bool full, str reduction, "
        "int history_slot, float expected_grad_output, bool writes, float scale=1.0) -> Tensor",
        torch::CppFunction::makeFromBoxedFunction<&likelihood_loss_boxed>());
}
