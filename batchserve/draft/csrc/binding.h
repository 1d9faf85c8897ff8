// The extension module's glue (module.cpp): arguments read into C++ values, and C++ exceptions
// raised as Python ones. No C++ exception may leave a CPython entry point (it would terminate the
// process), and none may skip reacquiring the GIL: every call runs its C++ inside `guarded` or,
// with the GIL released, inside `released`, and the readers below catch their own allocations.
#pragma once

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <climits>
#include <cstdint>
#include <exception>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

namespace bsd_py {

// The exception being handled, raised as a Python one; call it inside a catch block, the GIL held.
inline PyObject* raise_current() noexcept {
    try {
        throw;
    } catch (const std::bad_alloc&) {
        return PyErr_NoMemory();
    } catch (const std::invalid_argument& e) {
        PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const std::exception& e) {
        PyErr_SetString(PyExc_RuntimeError, e.what());
    } catch (...) {
        PyErr_SetString(PyExc_RuntimeError, "the native drafter failed (a non-standard C++ exception)");
    }
    return nullptr;
}

// Runs `body` (the GIL held), a C++ exception raised as a Python one.
template <class F>
PyObject* guarded(F&& body) noexcept {
    try {
        return body();
    } catch (...) {
        return raise_current();
    }
}

// Runs `body` with the GIL released (it must read no Python object). An exception is caught there
// and raised once the GIL is back: unwinding past Py_END_ALLOW_THREADS would leave this thread
// without its state, and the error would then be set without the GIL.
template <class F>
PyObject* released(F&& body) noexcept {
    std::exception_ptr failed;
    Py_BEGIN_ALLOW_THREADS
    try {
        body();
    } catch (...) {
        failed = std::current_exception();
    }
    Py_END_ALLOW_THREADS
    if (!failed) Py_RETURN_NONE;
    try {
        std::rethrow_exception(failed);
    } catch (...) {
        return raise_current();
    }
}

// A sequence of ints in [0, 2**31) into `out`; false with a Python error set.
inline bool tokens_of(PyObject* obj, std::vector<int32_t>& out) noexcept {
    PyObject* seq = PySequence_Fast(obj, "tokens must be a sequence of ints");
    if (seq == nullptr) return false;
    bool ok = true;
    try {
        const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
        PyObject** items = PySequence_Fast_ITEMS(seq);
        out.clear();
        out.reserve(static_cast<size_t>(n));
        for (Py_ssize_t i = 0; ok && i < n; ++i) {
            const long v = PyLong_AsLong(items[i]);
            if (v == -1 && PyErr_Occurred()) {
                ok = false;
            } else if (v < 0 || v > INT32_MAX) {
                PyErr_Format(PyExc_ValueError, "token ids must be in [0, 2**31), got %ld", v);
                ok = false;
            } else {
                out.push_back(static_cast<int32_t>(v));
            }
        }
    } catch (...) {
        raise_current();
        ok = false;
    }
    Py_DECREF(seq);
    return ok;
}

inline bool str_of(PyObject* obj, std::string& out) noexcept {
    Py_ssize_t n = 0;
    const char* s = PyUnicode_AsUTF8AndSize(obj, &n);
    if (s == nullptr) return false;
    try {
        out.assign(s, static_cast<size_t>(n));
    } catch (...) {
        raise_current();
        return false;
    }
    return true;
}

inline bool count_args(Py_ssize_t n, Py_ssize_t want, const char* name) {
    if (n == want) return true;
    PyErr_Format(PyExc_TypeError, "%s takes %zd arguments, got %zd", name, want, n);
    return false;
}

// A tuple of `size` items, item(i) a new reference or nullptr (an error set): nullptr then.
template <class F>
PyObject* tuple_of(size_t size, F&& item) {
    PyObject* out = PyTuple_New(static_cast<Py_ssize_t>(size));
    for (size_t i = 0; out != nullptr && i < size; ++i) {
        PyObject* value = item(i);
        if (value == nullptr) {
            Py_CLEAR(out);
            break;
        }
        PyTuple_SET_ITEM(out, static_cast<Py_ssize_t>(i), value);
    }
    return out;
}

// A list of str; nullptr with a Python error set.
inline PyObject* list_of(const std::vector<std::string>& names) {
    PyObject* out = PyList_New(static_cast<Py_ssize_t>(names.size()));
    for (size_t i = 0; out != nullptr && i < names.size(); ++i) {
        PyObject* item = PyUnicode_FromStringAndSize(names[i].data(), static_cast<Py_ssize_t>(names[i].size()));
        if (item == nullptr) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, static_cast<Py_ssize_t>(i), item);
    }
    return out;
}

}  // namespace bsd_py
