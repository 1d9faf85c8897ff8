// The drafter as a CPython extension module (`_batchserve_draft`): one `Drafter` object per
// engine, every call METH_FASTCALL. Token arguments are sequences of non-negative ints. Every
// call is exception-safe (binding.h): a C++ failure is a Python exception, never a crash.
#include "binding.h"  // Python.h first, as CPython asks

#include <string>
#include <vector>

#include "drafter.h"

namespace {

using bsd_py::count_args;
using bsd_py::guarded;
using bsd_py::list_of;
using bsd_py::released;
using bsd_py::str_of;
using bsd_py::tokens_of;
using bsd_py::tuple_of;

constexpr int kAbiVersion = 2;  // batchserve/draft/native.py checks it: a stale build is rebuilt

struct PyDrafter {
    PyObject_HEAD
    bsd::Drafter* d;
};

int init(PyDrafter* self, PyObject* args, PyObject* kwargs) {
    bsd::Settings s{};
    Py_ssize_t branch, own, max_match, min_match, scopes, scope_bytes;
    long long capacity, recent;
    int copy, layout;
    double weight;
    static const char* names[] = {"branch_length", "own_branch_length", "max_match",   "min_match",
                                  "prompt_weight", "trie_capacity",     "scope_bytes", "trie_max_scopes",
                                  "recent_output_tokens", "copy_chain", "layout",      nullptr};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "nnnndLnnLpi", const_cast<char**>(names), &branch, &own, &max_match,
                                     &min_match, &weight, &capacity, &scope_bytes, &scopes, &recent, &copy, &layout))
        return -1;
    if (branch < 2 || own < 2 || min_match < 1 || max_match < min_match || weight <= 0 || capacity < 1 ||
        scope_bytes < 4096 || scopes < 1 || recent < 0 || layout < 0 || layout > 2) {
        PyErr_SetString(PyExc_ValueError, "invalid drafter settings");
        return -1;
    }
    s.branch_length = static_cast<size_t>(branch);
    s.own_branch_length = static_cast<int>(own);
    s.max_match = static_cast<size_t>(max_match);
    s.min_match = static_cast<size_t>(min_match);
    s.prompt_weight = weight;
    s.trie_capacity = capacity;
    s.scope_bytes = static_cast<size_t>(scope_bytes);
    s.trie_max_scopes = static_cast<size_t>(scopes);
    s.recent_output_tokens = recent;
    s.copy_chain = copy != 0;
    s.layout = layout;
    delete self->d;
    self->d = nullptr;
    PyObject* made = guarded([&]() -> PyObject* {
        self->d = new bsd::Drafter(s);
        Py_RETURN_NONE;
    });
    if (made == nullptr) return -1;
    Py_DECREF(made);
    return 0;
}

void dealloc(PyDrafter* self) {
    delete self->d;
    Py_TYPE(self)->tp_free(reinterpret_cast<PyObject*>(self));
}

bsd::Drafter* drafter(PyObject* self) {
    bsd::Drafter* d = reinterpret_cast<PyDrafter*>(self)->d;
    if (d == nullptr) PyErr_SetString(PyExc_RuntimeError, "Drafter not initialized");
    return d;
}

// start(id, prompt, scope or None, layout (-1: the drafter's))
PyObject* start(PyObject* self, PyObject* const* a, Py_ssize_t n) {
    bsd::Drafter* d = drafter(self);
    std::string id, scope;
    std::vector<int32_t> prompt;
    if (d == nullptr || !count_args(n, 4, "start") || !str_of(a[0], id) || !tokens_of(a[1], prompt)) return nullptr;
    const bool scoped = a[2] != Py_None;
    if (scoped && !str_of(a[2], scope)) return nullptr;
    const long layout = PyLong_AsLong(a[3]);
    if (PyErr_Occurred()) return nullptr;
    return guarded([&] {
        d->start(id, prompt.data(), prompt.size(), scoped ? &scope : nullptr, static_cast<int>(layout));
        Py_RETURN_NONE;
    });
}

// resume(id, tokens): a resumed request's earlier output, before any accept: its own text only
PyObject* resume(PyObject* self, PyObject* const* a, Py_ssize_t n) {
    bsd::Drafter* d = drafter(self);
    std::string id;
    std::vector<int32_t> tokens;
    if (d == nullptr || !count_args(n, 2, "resume") || !str_of(a[0], id) || !tokens_of(a[1], tokens)) return nullptr;
    return guarded([&] {
        d->resume(id, tokens.data(), tokens.size());
        Py_RETURN_NONE;
    });
}

PyObject* accept(PyObject* self, PyObject* const* a, Py_ssize_t n) {
    bsd::Drafter* d = drafter(self);
    std::string id;
    std::vector<int32_t> tokens;
    if (d == nullptr || !count_args(n, 2, "accept") || !str_of(a[0], id) || !tokens_of(a[1], tokens)) return nullptr;
    return guarded([&] {
        d->accept(id, tokens.data(), tokens.size());
        Py_RETURN_NONE;
    });
}

PyObject* finish(PyObject* self, PyObject* const* a, Py_ssize_t n) {
    bsd::Drafter* d = drafter(self);
    std::string id;
    if (d == nullptr || !count_args(n, 1, "finish") || !str_of(a[0], id)) return nullptr;
    return guarded([&] {
        d->finish(id);
        Py_RETURN_NONE;
    });
}

PyObject* flush(PyObject* self, PyObject* const*, Py_ssize_t n) {
    bsd::Drafter* d = drafter(self);
    if (d == nullptr || !count_args(n, 0, "flush")) return nullptr;
    // Only the loop thread calls the drafter, and flush reads no Python object: let the step's
    // thread run meanwhile (the engine calls it while the forward runs).
    return released([d] { d->flush(); });
}

PyObject* set_deferred(PyObject* self, PyObject* const* a, Py_ssize_t n) {
    bsd::Drafter* d = drafter(self);
    if (d == nullptr || !count_args(n, 1, "set_deferred")) return nullptr;
    const int on = PyObject_IsTrue(a[0]);
    if (on < 0) return nullptr;
    return guarded([&] {
        if (!on) d->flush();  // a failure leaves it deferred, the tokens still queued
        d->deferred = on != 0;
        Py_RETURN_NONE;
    });
}

// fail_next(kind): a test hook; the next trie insertion throws (1: bad_alloc, 2: runtime_error,
// 3: a non-standard exception; 0: none)
PyObject* fail_next(PyObject* self, PyObject* const* a, Py_ssize_t n) {
    bsd::Drafter* d = drafter(self);
    if (d == nullptr || !count_args(n, 1, "fail_next")) return nullptr;
    const long kind = PyLong_AsLong(a[0]);
    if (kind == -1 && PyErr_Occurred()) return nullptr;
    if (kind < 0 || kind > 3) {
        PyErr_SetString(PyExc_ValueError, "kind must be 0, 1, 2 or 3");
        return nullptr;
    }
    d->fail_next = static_cast<int>(kind);
    Py_RETURN_NONE;
}

// propose(id, key (the text's last tokens), total (the text's length), budget) ->
// None or (tokens, parents (None: the root), scores, match)
PyObject* propose(PyObject* self, PyObject* const* a, Py_ssize_t n) {
    bsd::Drafter* d = drafter(self);
    std::string id;
    std::vector<int32_t> key;
    if (d == nullptr || !count_args(n, 4, "propose") || !str_of(a[0], id) || !tokens_of(a[1], key)) return nullptr;
    const Py_ssize_t total = PyLong_AsSsize_t(a[2]);
    const Py_ssize_t budget = PyLong_AsSsize_t(a[3]);
    if (PyErr_Occurred()) return nullptr;
    return guarded([&]() -> PyObject* {
        bsd::Tree tree;
        if (total < 1 || budget < 1 ||
            !d->propose(id, key.data(), key.size(), static_cast<size_t>(total), static_cast<size_t>(budget), tree))
            Py_RETURN_NONE;
        const size_t size = tree.tokens.size();
        PyObject* tokens = tuple_of(size, [&](size_t i) { return PyLong_FromLong(tree.tokens[i]); });
        PyObject* parents = tuple_of(size, [&](size_t i) {
            return tree.parents[i] < 0 ? Py_NewRef(Py_None) : PyLong_FromLong(tree.parents[i]);
        });
        PyObject* scores = tuple_of(size, [&](size_t i) { return PyFloat_FromDouble(tree.scores[i]); });
        if (tokens == nullptr || parents == nullptr || scores == nullptr) {
            Py_XDECREF(tokens);
            Py_XDECREF(parents);
            Py_XDECREF(scores);
            return nullptr;
        }
        return Py_BuildValue("(NNNi)", tokens, parents, scores, tree.match);
    });
}

PyObject* match_length(PyObject* self, PyObject* const* a, Py_ssize_t n) {
    bsd::Drafter* d = drafter(self);
    std::string id;
    std::vector<int32_t> key;
    if (d == nullptr || !count_args(n, 2, "match_length") || !str_of(a[0], id) || !tokens_of(a[1], key)) return nullptr;
    return guarded([&] { return PyLong_FromLong(d->match_length(id, key.data(), key.size())); });
}

// warm(scope, tokens, first, last): count the runs of `tokens` that start in [first, last)
PyObject* warm(PyObject* self, PyObject* const* a, Py_ssize_t n) {
    bsd::Drafter* d = drafter(self);
    std::string scope;
    std::vector<int32_t> tokens;
    if (d == nullptr || !count_args(n, 4, "warm") || !str_of(a[0], scope) || !tokens_of(a[1], tokens)) return nullptr;
    const Py_ssize_t first = PyLong_AsSsize_t(a[2]);
    const Py_ssize_t last = PyLong_AsSsize_t(a[3]);
    if (PyErr_Occurred()) return nullptr;
    if (first < 0 || last < first) {
        PyErr_SetString(PyExc_ValueError, "need 0 <= first <= last");
        return nullptr;
    }
    return guarded([&] {
        d->warm(scope, tokens.data(), tokens.size(), static_cast<size_t>(first), static_cast<size_t>(last));
        Py_RETURN_NONE;
    });
}

// stats() -> dict: nodes, indexed_tokens, requests, pending, recent_tokens, scopes (output tries,
// least recently used first), recent_scopes (likewise)
PyObject* stats(PyObject* self, PyObject* const*, Py_ssize_t n) {
    bsd::Drafter* d = drafter(self);
    if (d == nullptr || !count_args(n, 0, "stats")) return nullptr;
    return guarded([&]() -> PyObject* {
        const std::vector<std::string> names = d->scopes(), recent = d->recent().scopes();
        PyObject* scopes = list_of(names);
        PyObject* recent_scopes = scopes != nullptr ? list_of(recent) : nullptr;
        if (recent_scopes == nullptr) {
            Py_XDECREF(scopes);
            return nullptr;
        }
        return Py_BuildValue("{s:L,s:n,s:n,s:n,s:L,s:N,s:N}", "nodes", static_cast<long long>(d->num_nodes()),
                             "indexed_tokens", static_cast<Py_ssize_t>(d->num_indexed_tokens()), "requests",
                             static_cast<Py_ssize_t>(d->num_requests()), "pending",
                             static_cast<Py_ssize_t>(d->num_pending()), "recent_tokens",
                             static_cast<long long>(d->recent().num_tokens), "scopes", scopes, "recent_scopes",
                             recent_scopes);
    });
}

PyObject* memory(PyObject* self, PyObject* const*, Py_ssize_t n) {
    bsd::Drafter* d = drafter(self);
    if (d == nullptr || !count_args(n, 0, "memory")) return nullptr;
    return guarded([&] { return PyLong_FromSize_t(d->bytes()); });
}

// scope_bytes(scope) -> None or the bytes the scope holds (its output trie and recent outputs)
PyObject* scope_bytes(PyObject* self, PyObject* const* a, Py_ssize_t n) {
    bsd::Drafter* d = drafter(self);
    std::string scope;
    if (d == nullptr || !count_args(n, 1, "scope_bytes") || !str_of(a[0], scope)) return nullptr;
    return guarded([&]() -> PyObject* {
        const int64_t bytes = d->scope_bytes(scope);
        if (bytes < 0) Py_RETURN_NONE;
        return PyLong_FromLongLong(bytes);
    });
}

// trie(scope) -> None or {path tuple: count} of every node of the scope's output trie
PyObject* trie(PyObject* self, PyObject* const* a, Py_ssize_t n) {
    bsd::Drafter* d = drafter(self);
    std::string scope;
    if (d == nullptr || !count_args(n, 1, "trie") || !str_of(a[0], scope)) return nullptr;
    const bsd::Trie* t = d->trie(scope);
    if (t == nullptr) Py_RETURN_NONE;
    PyObject* out = PyDict_New();
    if (out == nullptr) return nullptr;
    bool ok = true;
    PyObject* done = guarded([&] {
        t->each([&](const std::vector<int32_t>& path, double count) {
            if (!ok) return;
            PyObject* key = tuple_of(path.size(), [&](size_t i) { return PyLong_FromLong(path[i]); });
            PyObject* value = key != nullptr ? PyFloat_FromDouble(count) : nullptr;
            ok = value != nullptr && PyDict_SetItem(out, key, value) == 0;
            Py_XDECREF(key);
            Py_XDECREF(value);
        });
        Py_RETURN_NONE;
    });
    if (done == nullptr || !ok) {
        Py_XDECREF(done);
        Py_DECREF(out);
        return nullptr;
    }
    Py_DECREF(done);
    return out;
}

// recent_text(scope) -> None or the scope's recent outputs as one list (-1 between two outputs)
PyObject* recent_text(PyObject* self, PyObject* const* a, Py_ssize_t n) {
    bsd::Drafter* d = drafter(self);
    std::string scope;
    if (d == nullptr || !count_args(n, 1, "recent_text") || !str_of(a[0], scope)) return nullptr;
    const bsd::Text* t = d->recent().text(scope);
    if (t == nullptr) Py_RETURN_NONE;
    PyObject* out = PyList_New(static_cast<Py_ssize_t>(t->size()));
    for (size_t i = 0; out != nullptr && i < t->size(); ++i) {
        PyObject* item = PyLong_FromLong(t->at(i));
        if (item == nullptr) Py_CLEAR(out);
        else PyList_SET_ITEM(out, static_cast<Py_ssize_t>(i), item);
    }
    return out;
}

#define FAST(name, doc) {#name, reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(name)), METH_FASTCALL, doc}

PyMethodDef methods[] = {
    FAST(start, "start(id, prompt, scope or None, layout): a request starts (a running id starts clean)"),
    FAST(resume, "resume(id, tokens): a resumed request's earlier output, before any accept: its own text only"),
    FAST(accept, "accept(id, tokens): tokens accepted; the scope's trie learns them now, or at flush() if deferred"),
    FAST(finish, "finish(id): the request ends; its own text is dropped, its output kept as a recent output"),
    FAST(flush, "flush(): insert every deferred token into its scope's trie"),
    FAST(set_deferred, "set_deferred(on): queue trie insertion until flush() (turning it off flushes)"),
    FAST(propose, "propose(id, key, total, budget) -> None or (tokens, parents, scores, match)"),
    FAST(match_length, "match_length(id, key) -> the longest suffix of key seen before with a token after it"),
    FAST(warm, "warm(scope, tokens, first, last): count the runs of tokens starting in [first, last)"),
    FAST(stats, "stats() -> dict of sizes and scopes"),
    FAST(memory, "memory() -> about the bytes it holds (tries, texts, recent outputs)"),
    FAST(scope_bytes, "scope_bytes(scope) -> None or the bytes its output trie and recent outputs hold"),
    FAST(fail_next, "fail_next(kind): a test hook: the next trie insertion throws (see the C++ comment)"),
    FAST(trie, "trie(scope) -> None or {path: count}"),
    FAST(recent_text, "recent_text(scope) -> None or the scope's recent outputs, -1 between two"),
    {nullptr, nullptr, 0, nullptr},
};

PyTypeObject DrafterType = {
    PyVarObject_HEAD_INIT(nullptr, 0) "_batchserve_draft.Drafter",
};

PyObject* abi_version(PyObject*, PyObject*) { return PyLong_FromLong(kAbiVersion); }

PyMethodDef module_methods[] = {
    {"abi_version", abi_version, METH_NOARGS, "the source's interface version"},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_batchserve_draft", "batchserve's native drafter", -1, module_methods};

}  // namespace

PyMODINIT_FUNC PyInit__batchserve_draft(void) {
    DrafterType.tp_basicsize = sizeof(PyDrafter);
    DrafterType.tp_flags = Py_TPFLAGS_DEFAULT;
    DrafterType.tp_doc = "the Lookahead drafter's tries, texts and retrieval";
    DrafterType.tp_new = PyType_GenericNew;
    DrafterType.tp_init = reinterpret_cast<initproc>(init);
    DrafterType.tp_dealloc = reinterpret_cast<destructor>(dealloc);
    DrafterType.tp_methods = methods;
    if (PyType_Ready(&DrafterType) < 0) return nullptr;
    PyObject* m = PyModule_Create(&module);
    if (m == nullptr) return nullptr;
    Py_INCREF(&DrafterType);
    if (PyModule_AddObject(m, "Drafter", reinterpret_cast<PyObject*>(&DrafterType)) < 0) {
        Py_DECREF(&DrafterType);
        Py_DECREF(m);
        return nullptr;
    }
    return m;
}
