// graph_exec._hostadd: in-place addition between host memory blocks given by address, for
// gradient accumulation on MindSpore's CPU back end. kernels/grad_buffers.py is its only user: it
// takes both addresses from Tensor.data_ptr() after checking dtype, shape and contiguity.
//
// Why C++: numpy needs an ndarray per operand, and MindSpore's asnumpy() costs about 4.6 us per
// tensor (numpy parses the buffer's format string), two per parameter per backward. A plain loop
// over two addresses is the same IEEE addition (no fast-math: every element is one rounded add,
// bit-identical to numpy and to MindSpore's assign_add).
#include <pybind11/pybind11.h>

#include <cstddef>
#include <cstdint>
#include <stdexcept>

namespace py = pybind11;

namespace {

// Only blocks this long (tens of microseconds of adding) let other Python threads run meanwhile;
// for shorter ones releasing and re-taking the GIL would be a visible share of the call.
constexpr std::size_t kReleaseGilFrom = std::size_t{1} << 16;

template <typename T>
void add_into(std::uintptr_t dst, std::uintptr_t src, std::size_t count) {
    if (count == 0) {
        return;
    }
    if (dst == 0 || src == 0) {
        throw std::invalid_argument("add_into: null address for a non-empty block");
    }
    T *out = reinterpret_cast<T *>(dst);
    const T *in = reinterpret_cast<const T *>(src);
    auto loop = [&] {
        for (std::size_t i = 0; i < count; ++i) {
            out[i] += in[i];
        }
    };
    if (count >= kReleaseGilFrom) {
        py::gil_scoped_release release;
        loop();
    } else {
        loop();
    }
}

}  // namespace

PYBIND11_MODULE(_hostadd, m) {
    m.doc() = "dst[i] += src[i] for i < count, on host memory given by address (float32, float64).";
    m.def("add_float32", &add_into<float>, py::arg("dst"), py::arg("src"), py::arg("count"),
          "dst[i] += src[i] over count float32 elements.");
    m.def("add_float64", &add_into<double>, py::arg("dst"), py::arg("src"), py::arg("count"),
          "dst[i] += src[i] over count float64 elements.");
}
