// The binding's pieces (binding.h): the lock, the argument readers, the settings' check.
#include "binding.h"

#include <climits>
#include <exception>
#include <string>

namespace bsd_py {

Locked::Locked(Bound& b) : lock_(b.mu, std::try_to_lock) {
    if (!lock_.owns_lock()) {
        nb::gil_scoped_release nogil;
        lock_.lock();
    }
}

Tokens::Tokens(nb::handle obj) {
    nb::object seq = nb::steal(PySequence_Fast(obj.ptr(), "tokens must be a sequence of ints"));
    if (!seq.is_valid()) throw nb::python_error();
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq.ptr());
    PyObject** items = PySequence_Fast_ITEMS(seq.ptr());
    v.reserve(static_cast<size_t>(n));
    for (Py_ssize_t i = 0; i < n; ++i) {
        const long t = PyLong_AsLong(items[i]);
        if (t == -1 && PyErr_Occurred()) throw nb::python_error();
        if (t < 0 || t > INT32_MAX)
            throw nb::value_error(("token ids must be in [0, 2**31), got " + std::to_string(t)).c_str());
        v.push_back(static_cast<int32_t>(t));
    }
}

bool truth(nb::handle obj) {
    const int on = PyObject_IsTrue(obj.ptr());
    if (on < 0) throw nb::python_error();
    return on != 0;
}

bsd::Settings settings(Py_ssize_t branch, Py_ssize_t own, Py_ssize_t max_match, Py_ssize_t min_match, double weight,
                       long long capacity, Py_ssize_t scope_bytes, Py_ssize_t scopes, long long recent,
                       nb::handle copy, int layout) {
    if (branch < 2 || own < 2 || own > INT_MAX || min_match < 1 || max_match < min_match || !(weight > 0) ||
        capacity < 1 || scope_bytes < 4096 || scopes < 1 || recent < 0 || layout < 0 || layout >= bsd::kNumLayouts)
        throw nb::value_error("invalid drafter settings");
    bsd::Settings s{};
    s.branch_length = static_cast<size_t>(branch);
    s.own_branch_length = static_cast<int>(own);
    s.max_match = static_cast<size_t>(max_match);
    s.min_match = static_cast<size_t>(min_match);
    s.prompt_weight = weight;
    s.trie_capacity = capacity;
    s.scope_bytes = static_cast<size_t>(scope_bytes);
    s.trie_max_scopes = static_cast<size_t>(scopes);
    s.recent_output_tokens = recent;
    s.copy_chain = truth(copy);
    s.layout = layout;
    return s;
}

void non_standard(const std::exception_ptr& thrown, void*) {
    try {
        std::rethrow_exception(thrown);
    } catch (const std::exception&) {
        throw;  // nanobind's own translation
    } catch (...) {
        PyErr_SetString(PyExc_RuntimeError, "the native drafter failed (a non-standard C++ exception)");
    }
}

}  // namespace bsd_py
