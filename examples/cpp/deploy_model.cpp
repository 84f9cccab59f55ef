// Run in C++ what was trained in Python: loads the two artefacts of
// examples/deploy/export_model.py (an AOTInductor package and a TorchScript trace of a
// model using posenc's three encodings) and checks both against Python's outputs.
//
//   deploy_model OUT_DIR      (OUT_DIR: where export_model.py wrote its files)
//
// The app links posenc::posenc but calls no posenc function: loading the models needs only
// the ops registered, which linking the package guarantees (it keeps libposenc a NEEDED
// entry of the app). Exits non-zero on any mismatch, and unless a position outside the
// model's table raises a clear error.
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/script.h>

#include <cstdio>
#include <string>
#include <vector>

namespace {

int failures = 0;

void check_close(const char* what, const char* size, const at::Tensor& got, const at::Tensor& want) {
  // float32 throughout; the kernels are the same in Python and here, so the outputs agree to
  // the rounding of the generated code around them.
  const double err = (got - want).abs().max().item<double>();
  const bool ok = got.sizes() == want.sizes() && err <= 1e-6;
  std::printf("deploy_model: %-11s %s: max |C++ - Python| = %.3g %s\n", what, size, err, ok ? "ok" : "FAILED");
  failures += ok ? 0 : 1;
}

// The message of the error a call raises, or "" when it returns.
template <typename F>
std::string error_of(F&& call) {
  try {
    call();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

// TorchScript rethrows the kernel's IndexError: "posenc: expected positions in [0,
// max_len=1024), found ...". AOTInductor's runner (torch 2.11) logs that message to stderr
// and throws a generic "run_func_(...) API call failed" here because a later kernel of this
// model reads the op's output (its generated code does not check the op's own call: an
// output returned as it is would come back undefined; docs/deploy.md);
// tests/cpp/run_example.sh checks the log for the posenc message.
void expect_index_error(const char* what, const std::string& message, bool generic_ok) {
  const bool ok = message.find("expected positions in [0, max_len=1024)") != std::string::npos ||
                  (generic_ok && message.find("API call failed") != std::string::npos);
  std::printf("deploy_model: %-11s out-of-range position: %s\n", what,
              ok ? "raised a clear error" : "FAILED");
  if (!ok) std::printf("  got: %s\n", message.empty() ? "(no error)" : message.substr(0, 400).c_str());
  failures += ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s OUT_DIR (written by examples/deploy/export_model.py)\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1];
  torch::NoGradGuard no_grad;
  torch::jit::Module reference = torch::jit::load(dir + "/reference.pt");
  torch::jit::Module traced = torch::jit::load(dir + "/model_traced.pt");
  traced.eval();
  torch::inductor::AOTIModelPackageLoader package(dir + "/model.pt2");

  for (const char* name : {"a", "b"}) {
    const at::Tensor tokens = reference.attr(std::string("tokens_") + name).toTensor();
    const at::Tensor positions = reference.attr(std::string("positions_") + name).toTensor();
    const at::Tensor want = reference.attr(std::string("out_") + name).toTensor();
    const std::string size = "(" + std::to_string(tokens.size(0)) + ", " + std::to_string(tokens.size(1)) + ")";
    check_close("AOTInductor", size.c_str(), package.run({tokens, positions})[0], want);
    check_close("TorchScript", size.c_str(), traced.forward({tokens, positions}).toTensor(), want);
  }

  // A position past the tables (max_len 1024) must raise, not crash or return garbage.
  const at::Tensor tokens = reference.attr("tokens_b").toTensor();
  const at::Tensor bad = reference.attr("positions_b").toTensor() + 5000;
  expect_index_error("AOTInductor", error_of([&] { package.run({tokens, bad}); }), true);
  expect_index_error("TorchScript", error_of([&] { traced.forward({tokens, bad}); }), false);

  if (failures) {
    std::printf("deploy_model: %d check(s) failed\n", failures);
    return 1;
  }
  std::printf("deploy_model: both artefacts match Python's outputs\n");
  return 0;
}
