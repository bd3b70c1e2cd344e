// Registering a C++ library's CPU kernels for ops of the `prefill` namespace (declared in
// Python: parallel/graph_op.py), for the libraries engine/rank/cpp_library.py builds against
// torch. Each library exports `extern "C" int register_ops()`, which calls this once per load.
#pragma once
#include <exception>

#include <torch/library.h>

// `add(library)` adds the kernels (library.impl(...)) the first time; returns 0, or 1 where
// registering throws. A later copy of a library (loaded from another path) replaces an earlier
// one's kernels, with torch's warning.
template <typename Add>
int register_cpu_kernels(Add add) {
  try {
    static torch::Library* kernels = [&add] {
      auto* library = new torch::Library(torch::Library::IMPL, "prefill", c10::DispatchKey::CPU,
                                         __FILE__, __LINE__);
      add(*library);
      return library;
    }();
    return kernels != nullptr ? 0 : 1;
  } catch (const std::exception&) {
    return 1;
  }
}
