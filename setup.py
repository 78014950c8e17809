"""Build wiring for the C++ helpers (buffer reuse, host gradient arithmetic); all other metadata lives
in pyproject.toml."""

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

setup(
    ext_modules=[
        Pybind11Extension(
            "graph_exec._bufpool",
            sorted(["csrc/bufpool.cpp", "csrc/pool.cpp", "csrc/slot_planner.cpp"]),
            cxx_std=17,
        ),
        Pybind11Extension("graph_exec._hostmath", ["csrc/host_math.cpp"], cxx_std=17),
    ],
    cmdclass={"build_ext": build_ext},
)
