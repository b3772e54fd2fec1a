// Runs a TorchScript module from C++, for tests/python/test_torchscript.py (the Python <-> C++ round trips):
//   hierpar_torchscript_run <module.pt> <input.pt> <output.pt>
// loads the module with torch::jit::load (its torch.ops.hierpar calls resolve because this program links
// libhierpar_ops, which registers them when it loads), calls forward in eval mode without autograd on the
// tensor that Python torch.save'd to <input.pt>, and writes the result where Python's torch.load reads it.
#include <torch/script.h>

#include <fstream>
#include <iostream>
#include <iterator>
#include <vector>

int main(int argc, char** argv) {
  if (argc != 4) {
    std::cerr << "usage: " << argv[0] << " <module.pt> <input.pt> <output.pt>\n";
    return 2;
  }
  try {
    torch::jit::Module module = torch::jit::load(argv[1]);
    module.eval();
    std::ifstream in(argv[2], std::ios::binary);
    if (!in) throw std::runtime_error(std::string("cannot read ") + argv[2]);
    const std::vector<char> input_bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const at::Tensor input = torch::jit::pickle_load(input_bytes).toTensor();
    torch::NoGradGuard no_grad;
    const at::Tensor output = module.forward({input}).toTensor();
    const std::vector<char> output_bytes = torch::jit::pickle_save(output);
    std::ofstream out(argv[3], std::ios::binary);
    out.write(output_bytes.data(), static_cast<std::streamsize>(output_bytes.size()));
    if (!out) throw std::runtime_error(std::string("cannot write ") + argv[3]);
  } catch (const std::exception& e) {
    std::cerr << "hierpar_torchscript_run: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
