// OpProgram: a list of dispatcher op calls, recorded once from Python (kernels/replay.py) and run
// again in one C++ call. It knows no model: each step names an operator, where each argument
// comes from (a register holding an input, a kept weight or an earlier step's tensor; a list of
// such registers; or a non-tensor constant captured at recording) and which registers the
// tensors it returns go to. What a run saves against the Python code it was recorded from is the
// interpreter between the ops.
#include <ATen/ScalarOps.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <string>
#include <vector>

namespace {

struct OpProgram : torch::CustomClassHolder {
  struct Step {
    c10::OperatorHandle op;
    std::vector<int64_t> sources;     // per argument: a register, kConstant or kTensorList
    std::vector<c10::IValue> values;  // per argument: the constant (None where a register)
    std::vector<std::vector<int64_t>> lists;  // per argument: a tensor list's registers
    std::vector<int64_t> outputs;     // registers of the returned tensors, lists flattened
    std::vector<int64_t> last_reads;  // registers no later step reads: released after this one
  };

  static constexpr int64_t kConstant = -1;
  static constexpr int64_t kTensorList = -2;

  OpProgram(int64_t num_inputs) : num_inputs_(num_inputs), num_registers_(num_inputs) {
    TORCH_CHECK(num_inputs >= 0, "OpProgram: negative input count ", num_inputs);
  }

  // A tensor every run finds in the returned register (a weight the recorded code reads).
  int64_t keep(const at::Tensor& tensor) {
    kept_.emplace_back(num_registers_, tensor);
    return num_registers_++;
  }

  // One op call; returns the first register of its outputs (they are numbered in order).
  int64_t add(const std::string& name, const std::string& overload,
              const std::vector<int64_t>& sources, std::vector<c10::IValue> values,
              std::vector<std::vector<int64_t>> lists, int64_t num_outputs) {
    auto op = c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), overload.c_str());
    const size_t arguments = op.schema().arguments().size();
    TORCH_CHECK(sources.size() == arguments && values.size() == arguments &&
                    lists.size() == arguments,
                "OpProgram: ", name, " takes ", arguments, " arguments, got ", sources.size(),
                " sources, ", values.size(), " values and ", lists.size(), " lists");
    auto check = [&](int64_t reg) {
      TORCH_CHECK(reg >= 0 && reg < num_registers_, "OpProgram: ", name, " reads register ",
                  reg, " before it is written");
    };
    for (size_t a = 0; a < arguments; ++a) {
      const auto& type = op.schema().arguments()[a].type();
      if (sources[a] == kConstant && values[a].isScalar() &&
          type->kind() == c10::TypeKind::TensorType) {
        // A Python number where the op takes a tensor (`x + 1e-6`): the wrapped-number tensor
        // torch's argument parser makes of it, so type promotion treats it the same.
        at::Tensor wrapped = c10::scalar_to_tensor(values[a].toScalar());
        wrapped.unsafeGetTensorImpl()->set_wrapped_number(true);
        values[a] = std::move(wrapped);
      }
      if (sources[a] == kTensorList) {
        for (const int64_t reg : lists[a]) check(reg);
      } else if (sources[a] != kConstant) {
        check(sources[a]);
      }
    }
    TORCH_CHECK(num_outputs >= 0, "OpProgram: negative output count for ", name);
    Step step{op, sources, std::move(values), std::move(lists), {}, {}};
    const int64_t first = num_registers_;
    for (int64_t i = 0; i < num_outputs; ++i) step.outputs.push_back(num_registers_++);
    steps_.push_back(std::move(step));
    return first;
  }

  // Ends the recording: `reg` is what run returns. Every other tensor is released after the
  // last step that reads it (or makes it, if none does), as the recorded code's frees did, so
  // a step's buffers are reused by the next ones while still in the cache.
  void set_result(int64_t reg) {
    TORCH_CHECK(reg >= 0 && reg < num_registers_, "OpProgram: no register ", reg);
    result_ = reg;
    std::vector<int64_t> last(num_registers_, -1);  // the step that last reads or makes it
    for (int64_t i = 0; i < static_cast<int64_t>(steps_.size()); ++i) {
      const Step& step = steps_[i];
      for (size_t a = 0; a < step.sources.size(); ++a) {
        if (step.sources[a] >= 0) last[step.sources[a]] = i;
        if (step.sources[a] == kTensorList) {
          for (const int64_t read : step.lists[a]) last[read] = i;
        }
      }
      for (const int64_t made : step.outputs) last[made] = i;
    }
    for (Step& step : steps_) step.last_reads.clear();
    for (int64_t r = 0; r < num_registers_; ++r) {
      if (r != result_ && last[r] >= 0) steps_[last[r]].last_reads.push_back(r);
    }
  }

  int64_t num_steps() const { return static_cast<int64_t>(steps_.size()); }

  at::Tensor run(const std::vector<at::Tensor>& inputs) const {
    TORCH_CHECK(static_cast<int64_t>(inputs.size()) == num_inputs_, "OpProgram: takes ",
                num_inputs_, " inputs, got ", inputs.size());
    TORCH_CHECK(result_ >= 0, "OpProgram: run before set_result");
    std::vector<c10::IValue> registers(num_registers_);
    for (int64_t i = 0; i < num_inputs_; ++i) registers[i] = inputs[i];
    for (const auto& [reg, tensor] : kept_) registers[reg] = tensor;
    torch::jit::Stack stack;
    for (const Step& step : steps_) {
      stack.clear();
      for (size_t a = 0; a < step.sources.size(); ++a) {
        const int64_t source = step.sources[a];
        if (source == kConstant) {
          stack.push_back(step.values[a]);
        } else if (source == kTensorList) {
          c10::List<at::Tensor> list;
          list.reserve(step.lists[a].size());
          for (const int64_t reg : step.lists[a]) list.push_back(registers[reg].toTensor());
          stack.emplace_back(std::move(list));
        } else {
          stack.push_back(registers[source]);
        }
      }
      step.op.callBoxed(&stack);
      size_t out = 0;
      for (c10::IValue& value : stack) {
        if (value.isTensor()) {
          TORCH_CHECK(out < step.outputs.size(), "OpProgram: ", step.op.schema().name(),
                      " returned more tensors than recorded");
          registers[step.outputs[out++]] = std::move(value);
        } else if (value.isTensorList()) {
          for (const at::Tensor& tensor : value.toTensorVector()) {
            TORCH_CHECK(out < step.outputs.size(), "OpProgram: ", step.op.schema().name(),
                        " returned more tensors than recorded");
            registers[step.outputs[out++]] = tensor;
          }
        }
      }
      TORCH_CHECK(out == step.outputs.size(), "OpProgram: ", step.op.schema().name(),
                  " returned ", out, " tensors, recorded ", step.outputs.size());
      for (const int64_t reg : step.last_reads) registers[reg] = c10::IValue();
    }
    return registers[result_].toTensor();
  }

 private:
  int64_t num_inputs_;
  int64_t num_registers_;
  int64_t result_ = -1;
  std::vector<Step> steps_;
  std::vector<std::pair<int64_t, at::Tensor>> kept_;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(tgq_cpu_ops, m) {
  m.class_<OpProgram>("OpProgram")
      .def(torch::init<int64_t>())
      .def("keep", &OpProgram::keep)
      .def("add", &OpProgram::add)
      .def("set_result", &OpProgram::set_result)
      .def("num_steps", &OpProgram::num_steps)
      .def("run", &OpProgram::run);
}
