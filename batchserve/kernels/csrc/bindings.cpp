// The kernels as a CPython extension module (`_batchserve_cpu`): a METH_FASTCALL call costs a
// fraction of a microsecond where ctypes costs several, and a one-row step makes about 300 of
// them. Every argument is a Python int (a pointer, a size, a stride) or float; the GIL is
// released while a kernel runs.
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"

namespace {

// Parse `n` arguments by `kinds` ('i': int, 'f': float) into a[] (ints) and f[] (floats, by position).
bool parse(PyObject* const* args, Py_ssize_t n, const char* kinds, int64_t* a, double* f) {
    const Py_ssize_t want = static_cast<Py_ssize_t>(strlen(kinds));
    if (n != want) {
        PyErr_Format(PyExc_TypeError, "expected %zd arguments, got %zd", want, n);
        return false;
    }
    for (Py_ssize_t i = 0; i < n; ++i) {
        if (kinds[i] == 'f') f[i] = PyFloat_AsDouble(args[i]);
        else a[i] = PyLong_AsLongLong(args[i]);
    }
    return !PyErr_Occurred();
}

template <class T>
T* p(int64_t v) { return reinterpret_cast<T*>(static_cast<intptr_t>(v)); }

#define KERNEL(name, kinds, call)                                                 \
    PyObject* py_##name(PyObject*, PyObject* const* args, Py_ssize_t n) {        \
        int64_t a[32] = {0};                                                      \
        double f[32] = {0};                                                       \
        if (!parse(args, n, kinds, a, f)) return nullptr;                         \
        Py_BEGIN_ALLOW_THREADS call;                                              \
        Py_END_ALLOW_THREADS Py_RETURN_NONE;                                      \
    }

KERNEL(block_pack, "iiiiiii",
       bs_block_pack(a[0], p<const uint8_t>(a[1]), a[2], a[3], a[4], p<uint8_t>(a[5]), static_cast<int>(a[6])))
KERNEL(block_linear, "iiiii",
       bs_block_linear(p<const float>(a[0]), a[1], p<const int64_t>(a[2]), p<float>(a[3]), static_cast<int>(a[4])))
KERNEL(bf16_pack, "iiiii",
       bs_bf16_pack(p<const uint16_t>(a[0]), a[1], a[2], p<uint16_t>(a[3]), static_cast<int>(a[4])))
KERNEL(bf16_linear, "iiiiiiii",
       bs_bf16_linear(p<const float>(a[0]), a[1], a[2], p<const uint16_t>(a[3]), a[4], p<void>(a[5]),
                      static_cast<int>(a[6]), static_cast<int>(a[7])))
KERNEL(attention, "iiiiiiiiiiiiiiiiiiiiiiiffiii",
       bs_attention(p<const float>(a[0]), a[1], a[2], a[3], a[4], a[5], a[6], p<const float>(a[7]), a[8], a[9],
                    p<const float>(a[10]), a[11], a[12], p<const int64_t>(a[13]), p<float>(a[14]), p<float>(a[15]),
                    a[16], p<const int32_t>(a[17]), p<const int32_t>(a[18]), p<const int32_t>(a[19]),
                    p<const int32_t>(a[20]), p<const int32_t>(a[21]), p<const int32_t>(a[22]),
                    static_cast<float>(f[23]), static_cast<float>(f[24]), p<const float>(a[25]), p<float>(a[26]),
                    static_cast<int>(a[27])))
KERNEL(rms_norm, "iiiiifiii",
       bs_rms_norm(p<const float>(a[0]), p<const float>(a[1]), p<const float>(a[2]), a[3], a[4],
                   static_cast<float>(f[5]), p<float>(a[6]), p<float>(a[7]), static_cast<int>(a[8])))
KERNEL(moe_experts, "iiiiiiiiiffiii",
       bs_moe_experts(p<const float>(a[0]), a[1], a[2], a[3], p<const int64_t>(a[4]), p<const float>(a[5]),
                      p<const int64_t>(a[6]), a[7], a[8], static_cast<float>(f[9]), static_cast<float>(f[10]),
                      p<float>(a[11]), p<float>(a[12]), static_cast<int>(a[13])))
KERNEL(router_logits, "iiiiiiii",
       bs_router_logits(p<const float>(a[0]), a[1], a[2], p<const float>(a[3]), p<const float>(a[4]), a[5],
                        p<float>(a[6]), static_cast<int>(a[7])))
KERNEL(moe_route, "iiiiiiiiii",
       bs_moe_route(p<const float>(a[0]), a[1], a[2], a[3], a[4], static_cast<int>(a[5]), static_cast<int>(a[6]),
                    p<int64_t>(a[7]), p<float>(a[8]), static_cast<int>(a[9])))
KERNEL(silu_mul, "iiiii", bs_silu_mul(p<const float>(a[0]), a[1], a[2], p<float>(a[3]), static_cast<int>(a[4])))
KERNEL(clamped_swiglu, "iiiffii",
       bs_clamped_swiglu(p<const float>(a[0]), a[1], a[2], static_cast<float>(f[3]), static_cast<float>(f[4]),
                         p<float>(a[5]), static_cast<int>(a[6])))
KERNEL(rotary, "iiiiiiiiii",
       bs_rotary(p<const float>(a[0]), a[1], a[2], a[3], a[4], a[5], p<const float>(a[6]), p<const float>(a[7]),
                 p<float>(a[8]), static_cast<int>(a[9])))

// Returns the seconds its attention took (a float).
PyObject* py_decoder_layers(PyObject*, PyObject* const* args, Py_ssize_t n) {
    int64_t a[32] = {0};
    double f[32] = {0};
    if (!parse(args, n, "iiiiiiiiiiiifiiiiiiiiiiiifiiii", a, f)) return nullptr;
    double seconds = 0.0;
    Py_BEGIN_ALLOW_THREADS seconds = bs_decoder_layers(
        p<const int64_t>(a[0]), a[1], p<const float>(a[2]), a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10],
        static_cast<int>(a[11]), static_cast<float>(f[12]), p<const float>(a[13]), p<const float>(a[14]),
        p<const int64_t>(a[15]), p<float>(a[16]), p<float>(a[17]), a[18], p<const int32_t>(a[19]),
        p<const int32_t>(a[20]), p<const int32_t>(a[21]), p<const int32_t>(a[22]), p<const int32_t>(a[23]),
        p<const int32_t>(a[24]), static_cast<float>(f[25]), p<float>(a[26]), p<float>(a[27]), p<float>(a[28]),
        static_cast<int>(a[29]));
    Py_END_ALLOW_THREADS return PyFloat_FromDouble(seconds);
}

PyObject* py_layers_workspace(PyObject*, PyObject* const* args, Py_ssize_t n) {
    int64_t a[32] = {0};
    double f[32] = {0};
    if (!parse(args, n, "iiiiiiii", a, f)) return nullptr;
    return PyLong_FromLongLong(bs_layers_workspace(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]));
}

PyObject* py_moe_workspace(PyObject*, PyObject* const* args, Py_ssize_t n) {
    int64_t a[32] = {0};
    double f[32] = {0};
    if (!parse(args, n, "iii", a, f)) return nullptr;
    return PyLong_FromLongLong(bs_moe_workspace(a[0], a[1], a[2]));
}

PyObject* py_bf16_packed_size(PyObject*, PyObject* const* args, Py_ssize_t n) {
    int64_t a[32] = {0};
    double f[32] = {0};
    if (!parse(args, n, "ii", a, f)) return nullptr;
    return PyLong_FromLongLong(bs_bf16_packed_size(a[0], a[1]));
}

PyObject* py_block_packed_size(PyObject*, PyObject* const* args, Py_ssize_t n) {
    int64_t a[32] = {0};
    double f[32] = {0};
    if (!parse(args, n, "iii", a, f)) return nullptr;
    return PyLong_FromLongLong(bs_block_packed_size(a[0], a[1], a[2]));
}

PyObject* py_block_wide(PyObject*, PyObject*) { return PyLong_FromLong(bs_block_wide()); }
PyObject* py_bf16_columns(PyObject*, PyObject*) { return PyLong_FromLong(bs_bf16_columns()); }
PyObject* py_layer_fields(PyObject*, PyObject*) { return PyLong_FromLongLong(bs_layer_fields()); }
PyObject* py_abi_version(PyObject*, PyObject*) { return PyLong_FromLong(bs_abi_version()); }

#define METHOD(name) {#name, reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(py_##name)), METH_FASTCALL, nullptr}
PyMethodDef methods[] = {
    METHOD(bf16_pack), METHOD(bf16_linear),
    METHOD(bf16_packed_size), METHOD(attention), METHOD(rms_norm), METHOD(silu_mul), METHOD(clamped_swiglu), METHOD(rotary),
    METHOD(decoder_layers), METHOD(moe_experts), METHOD(moe_workspace), METHOD(router_logits), METHOD(moe_route), METHOD(block_pack), METHOD(block_linear), METHOD(block_packed_size),
    {"block_wide", py_block_wide, METH_NOARGS, nullptr}, METHOD(layers_workspace), {"layer_fields", py_layer_fields, METH_NOARGS, nullptr},
    {"bf16_columns", py_bf16_columns, METH_NOARGS, nullptr}, {"abi_version", py_abi_version, METH_NOARGS, nullptr},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_batchserve_cpu", "batchserve's CPU kernels", -1, methods,
                      nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__batchserve_cpu() { return PyModule_Create(&module); }
