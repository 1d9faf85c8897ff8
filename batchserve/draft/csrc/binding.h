// The binding's pieces (module.cpp), defined in binding.cpp: the drafter a Python object holds,
// its lock, and the argument readers that keep each refusal's Python error (nanobind's own casters
// may only refuse with a TypeError; a token out of range is a ValueError, as it always was).
#pragma once

#include <nanobind/nanobind.h>

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <vector>

#include "drafter.h"

namespace bsd_py {

namespace nb = nanobind;

constexpr int kAbiVersion = 3;  // batchserve/draft/native.py checks it: a stale build is rebuilt

// What a Python Drafter holds: the drafter and its lock. A call's C++ runs with the lock held:
// flush() runs with the GIL released (the engine calls it beside the forward), so another thread
// calling in meanwhile waits for it instead of racing it. No Python code runs under the lock:
// arguments are read before it and results built after it (a finalizer calling in would wait on
// its own thread).
struct Bound {
    explicit Bound(const bsd::Settings& s) : d(s) {}
    bsd::Drafter d;
    std::mutex mu;
};

// The drafter's lock for one call, waited for without the GIL (its holder may be in flush()).
class Locked {
public:
    explicit Locked(Bound& b);
    void unlock() { lock_.unlock(); }

private:
    std::unique_lock<std::mutex> lock_;
};

// A sequence of ints, each in [0, 2**31): else TypeError, ValueError or OverflowError.
struct Tokens {
    explicit Tokens(nb::handle obj);
    const int32_t* data() const { return v.data(); }
    size_t size() const { return v.size(); }
    std::vector<int32_t> v;
};

// Any object's truth value (PyObject_IsTrue), raising what it raises.
bool truth(nb::handle obj);

// The settings, checked: ValueError("invalid drafter settings") where one is out of range.
bsd::Settings settings(Py_ssize_t branch, Py_ssize_t own, Py_ssize_t max_match, Py_ssize_t min_match, double weight,
                       long long capacity, Py_ssize_t scope_bytes, Py_ssize_t scopes, long long recent,
                       nb::handle copy, int layout);

// Whatever a C++ call throws that is no std::exception: a RuntimeError, never a crash (nanobind
// raises the standard ones: bad_alloc a MemoryError, invalid_argument a ValueError, ...).
void non_standard(const std::exception_ptr& thrown, void*);

}  // namespace bsd_py
