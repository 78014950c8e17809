// graph_exec._hostmath: arithmetic on gradient accumulators in host memory, given by address, for
// MindSpore's CPU back end. kernels/grad_buffers.py (accumulation) and kernels/grad_ops.py (the
// end of a step: unscaling, the overflow check, a norm's share, clipping, zeroing) are its only
// users: they take the addresses from Tensor.data_ptr() after checking dtype and contiguity, and
// wait for MindSpore's queued ops first.
//
// Why C++: numpy needs an ndarray per tensor, and MindSpore's asnumpy() costs about 4.6 us per
// tensor (numpy parses the buffer's format string), while data_ptr() costs well under one; a
// whole-model pass also fuses what numpy does in three (multiply, isfinite, the share). Every
// element is the same IEEE operation numpy and MindSpore's CPU kernels do (no fast-math): one
// rounded add or multiply. Shares are reduced in double, in a fixed order.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

// Only work this long (tens of microseconds) lets other Python threads run meanwhile; for less,
// releasing and re-taking the GIL would be a visible share of the call.
constexpr std::size_t kReleaseGilFrom = std::size_t{1} << 16;

template <typename Work>
void run_releasing_gil_if_long(std::size_t elements, Work &&work) {
    if (elements >= kReleaseGilFrom) {
        py::gil_scoped_release release;
        work();
    } else {
        work();
    }
}

template <typename T>
T *block(std::uintptr_t address, std::size_t count, const char *who) {
    if (address == 0 && count != 0) {
        throw std::invalid_argument(std::string(who) + ": null address for a non-empty block");
    }
    return reinterpret_cast<T *>(address);
}

void check_lengths(std::size_t addresses, std::size_t counts, const char *who) {
    if (addresses != counts) {
        throw std::invalid_argument(std::string(who) + ": " + std::to_string(addresses) + " addresses but " +
                                    std::to_string(counts) + " counts");
    }
}

template <typename T>
void add_into(std::uintptr_t dst, std::uintptr_t src, std::size_t count) {
    T *out = block<T>(dst, count, "add");
    const T *in = block<T>(src, count, "add");
    run_releasing_gil_if_long(count, [&] {
        for (std::size_t i = 0; i < count; ++i) {
            out[i] += in[i];
        }
    });
}

// One block's contribution to a norm share: the sum of |v|^p in double, or the largest |v| for
// p = inf. NaN is carried as numpy does:
// a NaN anywhere makes the share NaN.
struct Share {
    double value = 0.0;
    bool nan = false;
};

// The sum of term(values[i]) in double, in eight interleaved partial sums (so that the additions
// are not one chain of dependent adds), combined in a fixed order.
template <typename T, typename Term>
double lane_sum(const T *values, std::size_t count, Term term) {
    constexpr std::size_t kLanes = 8;
    double partial[kLanes] = {};
    std::size_t i = 0;
    for (; i + kLanes <= count; i += kLanes) {
        for (std::size_t lane = 0; lane < kLanes; ++lane) {
            partial[lane] += term(static_cast<double>(values[i + lane]));
        }
    }
    for (; i < count; ++i) {
        partial[0] += term(static_cast<double>(values[i]));
    }
    double total = 0.0;
    for (double value : partial) {
        total += value;
    }
    return total;
}

template <typename T>
void add_share(const T *values, std::size_t count, double norm_type, Share &share) {
    if (std::isinf(norm_type)) {
        double largest = share.value;
        for (std::size_t i = 0; i < count; ++i) {
            const double magnitude = std::fabs(static_cast<double>(values[i]));
            share.nan |= magnitude != magnitude;
            largest = std::max(largest, magnitude);
        }
        share.value = largest;
        return;
    }
    if (norm_type == 2.0) {
        share.value += lane_sum(values, count, [](double v) { return v * v; });
    } else {
        share.value += lane_sum(values, count, [norm_type](double v) { return std::pow(std::fabs(v), norm_type); });
    }
}

// Every block multiplied in place by factor (rounded to T first; factor 1 writes nothing), then,
// of the products: (every value finite, the norm_type share of the blocks marked counted). The
// check reads the products, as mindspore.amp.all_finite on the unscaled gradients would.
template <typename T>
std::pair<bool, double> scale_and_measure(const std::vector<std::uintptr_t> &addresses,
                                          const std::vector<std::size_t> &counts, double factor,
                                          const std::vector<bool> &counted, double norm_type) {
    check_lengths(addresses.size(), counts.size(), "scale_and_measure");
    check_lengths(addresses.size(), counted.size(), "scale_and_measure (counted)");
    if (!(norm_type > 0.0)) {
        throw std::invalid_argument("scale_and_measure: norm_type must be positive, got " +
                                    std::to_string(norm_type));
    }
    std::vector<T *> blocks;
    std::size_t elements = 0;
    for (std::size_t b = 0; b < addresses.size(); ++b) {
        blocks.push_back(block<T>(addresses[b], counts[b], "scale_and_measure"));
        elements += counts[b];
    }
    const T f = static_cast<T>(factor);
    const bool write = f != T(1);
    bool finite = true;
    Share share;
    run_releasing_gil_if_long(elements, [&] {
        for (std::size_t b = 0; b < blocks.size(); ++b) {
            T *values = blocks[b];
            unsigned bad = 0;  // v - v is 0 for a finite v, NaN (unequal to 0) for inf and NaN
            if (write) {
                for (std::size_t i = 0; i < counts[b]; ++i) {
                    values[i] *= f;
                    bad |= values[i] - values[i] != T(0);
                }
            } else {
                for (std::size_t i = 0; i < counts[b]; ++i) {
                    bad |= values[i] - values[i] != T(0);
                }
            }
            finite &= bad == 0;
            if (counted[b]) {
                add_share(values, counts[b], norm_type, share);
            }
        }
    });
    return {finite, share.nan ? std::numeric_limits<double>::quiet_NaN() : share.value};
}

template <typename T>
void zero(const std::vector<std::uintptr_t> &addresses, const std::vector<std::size_t> &counts) {
    check_lengths(addresses.size(), counts.size(), "zero");
    for (std::size_t b = 0; b < addresses.size(); ++b) {
        T *values = block<T>(addresses[b], counts[b], "zero");
        if (counts[b] != 0) {
            std::memset(values, 0, counts[b] * sizeof(T));  // all-zero bits: +0.0
        }
    }
}

template <typename T>
void define(py::module_ &m, const char *suffix) {
    const std::string s(suffix);
    m.def(("add_" + s).c_str(), &add_into<T>, py::arg("dst"), py::arg("src"), py::arg("count"),
          ("dst[i] += src[i] over count " + s + " elements.").c_str());
    m.def(("scale_and_measure_" + s).c_str(), &scale_and_measure<T>, py::arg("addresses"), py::arg("counts"),
          py::arg("factor"), py::arg("counted"), py::arg("norm_type"),
          ("Multiply " + s +
           " blocks in place by factor; return (all finite, norm share of the counted blocks).")
              .c_str());
    m.def(("zero_" + s).c_str(), &zero<T>, py::arg("addresses"), py::arg("counts"),
          ("Set " + s + " blocks to +0.0.").c_str());
}

}  // namespace

PYBIND11_MODULE(_hostmath, m) {
    m.doc() = "Arithmetic on host memory blocks given by address (float32, float64): accumulate, "
              "scale and measure, zero.";
    define<float>(m, "float32");
    define<double>(m, "float64");
}
