// Python binding of the buffer pool and the slot planner: graph_exec._bufpool.
// Only graph_exec/bufpool.py imports this module; it documents the public API.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "pool.hpp"
#include "slot_planner.hpp"

namespace py = pybind11;
using graph_exec::Block;
using graph_exec::Lifetime;
using graph_exec::Pool;
using graph_exec::PoolError;

namespace {

std::string type_name(PyObject *obj) { return Py_TYPE(obj)->tp_name; }

std::string repr(PyObject *obj) { return py::repr(py::handle(obj)).cast<std::string>(); }

bool is_int(PyObject *obj) {
    static PyObject *integral = py::object(py::module_::import("numbers").attr("Integral")).release().ptr();
    return !PyBool_Check(obj) && (PyLong_Check(obj) || PyObject_IsInstance(obj, integral) == 1);
}

constexpr char kItemHasObject = 0x01;  // NPY_ITEM_HASOBJECT in a numpy dtype's flags
constexpr std::int64_t kInt64Min = std::numeric_limits<std::int64_t>::min();
constexpr std::int64_t kInt64Max = std::numeric_limits<std::int64_t>::max();

// An int argument in [lo, hi]: a Python int or a numbers.Integral such as numpy.int64, never a
// bool (True would silently mean 1). A wrong type is a TypeError, a value out of range PoolError.
// `name()` builds the argument's name for the message, only when there is an error.
template <typename Name>
std::int64_t int_arg(PyObject *obj, Name name, std::int64_t lo = kInt64Min, std::int64_t hi = kInt64Max,
                     const char *range_note = "") {
    int overflow = 0;
    if (PyLong_CheckExact(obj)) {  // fast path
        const long long value = PyLong_AsLongLongAndOverflow(obj, &overflow);
        if (overflow == 0 && value >= lo && value <= hi) {
            return value;
        }
    }
    if (!is_int(obj)) {
        throw py::type_error(name() + " must be an int, got " + type_name(obj));
    }
    py::object index = py::reinterpret_steal<py::object>(PyNumber_Index(obj));
    if (!index) {
        throw py::error_already_set();
    }
    const long long value = PyLong_AsLongLongAndOverflow(index.ptr(), &overflow);
    if (overflow != 0 || value < lo || value > hi) {
        throw PoolError(name() + " must be in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]" +
                        range_note + ", got " + repr(obj));
    }
    return value;
}

// The name of a plain argument, for int_arg.
auto named(const char *name) {
    return [name] { return std::string(name); };
}

std::vector<Lifetime> parse_lifetimes(py::handle lifetimes) {
    py::object seq = py::reinterpret_steal<py::object>(PySequence_Fast(
        lifetimes.ptr(), "lifetimes must be a sequence of (first_step, last_step, nbytes) tuples"));
    if (!seq) {
        throw py::error_already_set();
    }
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq.ptr());
    PyObject **items = PySequence_Fast_ITEMS(seq.ptr());
    std::vector<Lifetime> out(static_cast<std::size_t>(n));
    for (Py_ssize_t i = 0; i < n; ++i) {
        PyObject *item = items[i];
        if (!(PyTuple_Check(item) || PyList_Check(item)) || PySequence_Fast_GET_SIZE(item) != 3) {
            throw py::type_error("lifetimes[" + std::to_string(i) +
                                 "] must be a (first_step, last_step, nbytes) tuple, got " + repr(item));
        }
        PyObject **fields = PySequence_Fast_ITEMS(item);
        auto field = [&](int k, const char *name) {
            return int_arg(fields[k], [&] {
                return "lifetimes[" + std::to_string(i) + "][" + std::to_string(k) + "] (" + name + ")";
            });
        };
        Lifetime &lifetime = out[static_cast<std::size_t>(i)];
        lifetime = {field(0, "first_step"), field(1, "last_step"), field(2, "nbytes")};
    }
    return out;
}

// A numpy array of `dtype` and `shape` over the block's memory. The array's base is the Block
// object, which owns the memory, so the array stays valid however the pool is used afterwards.
py::array view(py::object self, py::object dtype, py::object shape) {
    const Block &block = self.cast<const Block &>();
    void *data = block.data();  // refuses a released block
    const py::dtype dt = py::isinstance<py::dtype>(dtype) ? py::reinterpret_borrow<py::dtype>(dtype)
                                                          : py::dtype::from_args(dtype);
    if (dt.flags() & kItemHasObject) {
        throw PoolError("dtype " + repr(dt.ptr()) + " holds Python objects and cannot view raw memory");
    }
    if (dt.itemsize() == 0) {
        throw PoolError("dtype " + repr(dt.ptr()) + " has no size");
    }
    std::vector<py::ssize_t> dims;
    if (is_int(shape.ptr())) {
        dims.push_back(int_arg(shape.ptr(), named("shape"), 0));
    } else {
        py::object seq = py::reinterpret_steal<py::object>(
            PySequence_Fast(shape.ptr(), "shape must be an int or a sequence of ints"));
        if (!seq) {
            throw py::error_already_set();
        }
        for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq.ptr()); ++i) {
            dims.push_back(int_arg(PySequence_Fast_GET_ITEM(seq.ptr(), i),
                                   [i] { return "shape[" + std::to_string(i) + "]"; }, 0));
        }
    }
    std::uint64_t bytes = static_cast<std::uint64_t>(dt.itemsize());
    for (py::ssize_t dim : dims) {
        if (__builtin_mul_overflow(bytes, static_cast<std::uint64_t>(dim), &bytes)) {
            bytes = std::numeric_limits<std::uint64_t>::max();
        }
    }
    if (bytes > block.nbytes()) {
        throw PoolError("a view of shape " + repr(shape.ptr()) + " and dtype " + repr(dt.ptr()) + " needs " +
                        (bytes == std::numeric_limits<std::uint64_t>::max() ? std::string("more than 2**64")
                                                                            : std::to_string(bytes)) +
                        " bytes; the block has nbytes=" + std::to_string(block.nbytes()));
    }
    return py::array(dt, dims, data, self);
}

}  // namespace

PYBIND11_MODULE(_bufpool, m) {
    m.doc() = "C++ core of graph_exec.bufpool (import that module instead).";
    // BufferPoolError(GraphExecError, ValueError): the library's error family, and a bad value.
    const py::object graph_exec_error = py::module_::import("graph_exec.errors").attr("GraphExecError");
    py::register_exception<PoolError>(m, "BufferPoolError",
                                      py::make_tuple(graph_exec_error, py::handle(PyExc_ValueError)));

    m.attr("ALIGNMENT") = graph_exec::kAlignment;
    m.def("size_class", [](py::handle nbytes) {
        const std::int64_t n = int_arg(nbytes.ptr(), named("nbytes"), 1, graph_exec::kMaxBlockLimit);
        return graph_exec::size_class_bytes(graph_exec::size_class_index(static_cast<std::uint64_t>(n)));
    });

    py::class_<Block>(m, "Block", py::buffer_protocol(),
                      "Aligned host memory from a BufferPool (see graph_exec.bufpool).")
        .def_property_readonly("nbytes", &Block::nbytes)
        .def_property_readonly("capacity", &Block::capacity)
        .def_property_readonly("released", &Block::released)
        .def_property_readonly("address", &Block::address)
        .def("view", &view, py::arg("dtype"), py::arg("shape"),
             "Writable C-contiguous numpy array of `dtype` and `shape` over the block's first bytes, "
             "no copy. Raises BufferPoolError if the block is released or the view exceeds nbytes.")
        .def_buffer([](Block &block) {
            return py::buffer_info(block.data(), 1, py::format_descriptor<std::uint8_t>::format(), 1,
                                   {static_cast<py::ssize_t>(block.nbytes())}, {py::ssize_t{1}},
                                   /*readonly=*/false);
        })
        // numpy.asarray tries the buffer protocol first and falls back to this when it refuses
        // (a released block): raise here too, instead of letting numpy build an object array.
        .def("__array__",
             [](py::object self, const py::args &, const py::kwargs &) {
                 const auto nbytes = py::int_(self.cast<const Block &>().nbytes());
                 return view(self, py::dtype::of<std::uint8_t>(), nbytes);
             })
        .def("__repr__", [](const Block &block) {
            return "<Block nbytes=" + std::to_string(block.nbytes()) + " capacity=" +
                   std::to_string(block.capacity()) + (block.released() ? " released>" : ">");
        });

    py::class_<Pool, std::shared_ptr<Pool>>(m, "Pool")
        .def(py::init([](py::handle max_block_bytes) {
                 return std::make_shared<Pool>(
                     int_arg(max_block_bytes.ptr(), named("max_block_bytes"), 1, graph_exec::kMaxBlockLimit));
             }),
             py::arg("max_block_bytes"))
        .def_property_readonly("max_block_bytes", &Pool::max_block_bytes)
        .def(
            "acquire",
            [](Pool &pool, py::handle nbytes) {
                return pool.acquire(
                    int_arg(nbytes.ptr(), named("nbytes"), 1, pool.max_block_bytes(), " (max_block_bytes)"));
            },
            py::arg("nbytes"))
        .def("release", &Pool::release, py::arg("block"))
        .def("trim", &Pool::trim)
        .def("stats", [](const Pool &pool) {
            const graph_exec::PoolStats s = pool.stats();
            py::dict d;
            d["acquires"] = s.acquires;
            d["allocations"] = s.allocations;
            d["reuses"] = s.reuses;
            d["releases"] = s.releases;
            d["auto_releases"] = s.auto_releases;
            d["live_blocks"] = s.live_blocks;
            d["live_bytes"] = s.live_bytes;
            d["peak_bytes"] = s.peak_bytes;
            d["reserved_bytes"] = s.reserved_bytes;
            d["free_blocks"] = s.free_blocks;
            return d;
        });

    m.def("plan_slots", [](py::handle lifetimes) {
        const std::vector<Lifetime> parsed = parse_lifetimes(lifetimes);
        graph_exec::SlotPlan plan;
        {
            py::gil_scoped_release unlocked;  // pure C++ from here on
            plan = graph_exec::plan_slots(parsed);
        }
        return py::make_tuple(plan.slot_of, plan.slot_sizes, plan.peak_bytes, plan.total_bytes);
    });
}
