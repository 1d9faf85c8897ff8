// The drafter as a CPython extension module (`_batchserve_draft`) on nanobind: one `Drafter`
// object per engine, its methods in the one table below, its constants (constants.h) exported.
//
// Why nanobind (over pybind11 and over the C API by hand): a call costs what the hand-written
// METH_FASTCALL glue cost (nanobind dispatches by vectorcall: about 20 ns for a method with no
// arguments, 80 ns with propose's four, where pybind11 took 70 and 165 ns, which made a small
// propose 25% slower); it builds as fast (its library is one more source, nb_combined.cpp, in the
// same g++ command: batchserve/draft/native.py); and it does what the glue did by hand: C++
// exceptions raised as Python ones, never a crash (binding.h), the GIL reacquired however a call
// that released it ends (nb::gil_scoped_release is RAII), and an object whose __init__ never ran
// or failed refused by every method (a TypeError). By the author of pybind11, on PyPI.
#include "binding.h"  // nanobind first, as CPython asks

#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <new>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "drafter.h"

namespace bsd_py {

namespace {

// A new reference as an object; nullptr (a Python error set, as after a failed allocation) raised.
nb::object checked(PyObject* made) {
    if (made == nullptr) throw nb::python_error();
    return nb::steal(made);
}

// A tuple of `size` items, item(i) a new reference or nullptr. The C API's own calls: a proposal's
// tuples built this way cost 90 ns less than from nanobind's objects (a tenth of a small propose).
template <class F>
nb::object tuple_of(size_t size, F&& item) {
    nb::object out = checked(PyTuple_New(static_cast<Py_ssize_t>(size)));
    for (size_t i = 0; i < size; ++i)
        PyTuple_SET_ITEM(out.ptr(), static_cast<Py_ssize_t>(i), checked(item(i)).release().ptr());
    return out;
}

nb::list list_of(const std::vector<std::string>& names) {
    nb::list out;
    for (const std::string& name : names) out.append(nb::str(name.data(), name.size()));
    return out;
}

void init(Bound* self, Py_ssize_t branch, Py_ssize_t own, Py_ssize_t max_match, Py_ssize_t min_match, double weight,
          long long capacity, Py_ssize_t scope_bytes, Py_ssize_t scopes, long long recent, nb::handle copy,
          int layout) {
    new (self) Bound(settings(branch, own, max_match, min_match, weight, capacity, scope_bytes, scopes, recent, copy,
                              layout));
}

// start(id, prompt, scope or None, layout (-1: the drafter's))
void start(Bound& b, const std::string& id, nb::handle prompt, const std::optional<std::string>& scope, long layout) {
    const Tokens tokens(prompt);
    if (layout < -1 || layout >= bsd::kNumLayouts)
        throw nb::value_error("layout must be -1 (the drafter's), 0, 1 or 2");
    Locked hold(b);
    b.d.start(id, tokens.data(), tokens.size(), scope ? &*scope : nullptr, static_cast<int>(layout));
}

// resume(id, tokens) and accept(id, tokens)
using TokensCall = void (bsd::Drafter::*)(const std::string&, const int32_t*, size_t);
template <TokensCall method>
void with_tokens(Bound& b, const std::string& id, nb::handle tokens) {
    const Tokens read(tokens);
    Locked hold(b);
    (b.d.*method)(id, read.data(), read.size());
}

void finish(Bound& b, const std::string& id) {
    Locked hold(b);
    b.d.finish(id);
}

void set_deferred(Bound& b, nb::handle on) {
    const bool yes = truth(on);
    Locked hold(b);
    b.d.set_deferred(yes);
}

void flush(Bound& b) {
    // Only the loop thread calls the drafter, and flush reads no Python object: let the step's
    // thread run meanwhile (the engine calls it while the forward runs).
    nb::gil_scoped_release nogil;
    std::lock_guard<std::mutex> hold(b.mu);
    b.d.flush();
}

// fail_next(kind): a test hook; the next trie insertion throws (1: bad_alloc, 2: runtime_error,
// 3: a non-standard exception; 0: none)
void fail_next(Bound& b, long kind) {
    if (kind < 0 || kind > 3) throw nb::value_error("kind must be 0, 1, 2 or 3");
    Locked hold(b);
    b.d.fail_next = static_cast<int>(kind);
}

// propose(id, key (the text's last tokens), total (the text's length), budget) ->
// None or (tokens, parents (None: the root), scores, match)
nb::object propose(Bound& b, const std::string& id, nb::handle key, Py_ssize_t total, Py_ssize_t budget) {
    const Tokens read(key);
    bsd::Tree t;
    if (total < 1 || budget < 1) return nb::none();
    Locked hold(b);
    if (!b.d.propose(id, read.data(), read.size(), static_cast<size_t>(total), static_cast<size_t>(budget), t))
        return nb::none();
    hold.unlock();
    const size_t n = t.tokens.size();
    const nb::object tokens = tuple_of(n, [&](size_t i) { return PyLong_FromLong(t.tokens[i]); });
    const nb::object parents = tuple_of(n, [&](size_t i) {
        return t.parents[i] < 0 ? Py_NewRef(Py_None) : PyLong_FromLong(t.parents[i]);
    });
    const nb::object scores = tuple_of(n, [&](size_t i) { return PyFloat_FromDouble(t.scores[i]); });
    const nb::object match = checked(PyLong_FromLong(t.match));
    return checked(PyTuple_Pack(4, tokens.ptr(), parents.ptr(), scores.ptr(), match.ptr()));
}

int match_length(Bound& b, const std::string& id, nb::handle key) {
    const Tokens read(key);
    Locked hold(b);
    return b.d.match_length(id, read.data(), read.size());
}

// warm(scope, tokens, first, last): count the runs of `tokens` that start in [first, last)
void warm(Bound& b, const std::string& scope, nb::handle tokens, Py_ssize_t first, Py_ssize_t last) {
    const Tokens read(tokens);
    if (first < 0 || last < first) throw nb::value_error("need 0 <= first <= last");
    Locked hold(b);
    b.d.warm(scope, read.data(), read.size(), static_cast<size_t>(first), static_cast<size_t>(last));
}

// stats() -> dict: nodes, indexed_tokens, requests, pending, recent_tokens, scopes (output tries,
// least recently used first), recent_scopes (likewise)
nb::dict stats(Bound& b) {
    Locked hold(b);
    const int64_t nodes = b.d.num_nodes(), recent_tokens = b.d.recent().num_tokens();
    const size_t indexed = b.d.num_indexed_tokens(), requests = b.d.num_requests(), pending = b.d.num_pending();
    const std::vector<std::string> scopes = b.d.scopes(), recent = b.d.recent().scopes();
    hold.unlock();
    nb::dict out;
    out["nodes"] = nodes;
    out["indexed_tokens"] = indexed;
    out["requests"] = requests;
    out["pending"] = pending;
    out["recent_tokens"] = recent_tokens;
    out["scopes"] = list_of(scopes);
    out["recent_scopes"] = list_of(recent);
    return out;
}

size_t memory(Bound& b) {
    Locked hold(b);
    return b.d.bytes();
}

// scope_bytes(scope) -> None or the bytes the scope holds (its output trie and recent outputs)
nb::object scope_bytes(Bound& b, const std::string& scope) {
    Locked hold(b);
    const int64_t bytes = b.d.scope_bytes(scope);
    hold.unlock();
    if (bytes < 0) return nb::none();
    return nb::int_(bytes);
}

// trie(scope) -> None or {path tuple: count} of every node of the scope's output trie
nb::object trie(Bound& b, const std::string& scope) {
    std::vector<int32_t> paths;                     // every node's path, one after another
    std::vector<std::pair<size_t, double>> nodes;  // (path length, count) per node
    Locked hold(b);
    const bsd::Trie* t = b.d.trie(scope);
    if (t == nullptr) return nb::none();
    t->each([&](const std::vector<int32_t>& path, double count) {
        paths.insert(paths.end(), path.begin(), path.end());
        nodes.emplace_back(path.size(), count);
    });
    hold.unlock();
    nb::dict out;
    size_t at = 0;
    for (const auto& [length, count] : nodes) {
        out[tuple_of(length, [&](size_t i) { return PyLong_FromLong(paths[at + i]); })] = nb::float_(count);
        at += length;
    }
    return out;
}

// recent_text(scope) -> None or the scope's recent outputs as one list (-1 between two outputs)
nb::object recent_text(Bound& b, const std::string& scope) {
    Locked hold(b);
    const bsd::Text* t = b.d.recent().text(scope);
    if (t == nullptr) return nb::none();
    const std::vector<int32_t> text(t->data(), t->data() + t->size());
    hold.unlock();
    nb::list out;
    for (int32_t token : text) out.append(nb::int_(token));
    return out;
}

void exports(nb::module_& m) {
    nb::dict layouts;
    for (int code = 0; code < bsd::kNumLayouts; ++code) layouts[bsd::kLayoutNames[code]] = code;
    m.attr("LAYOUTS") = layouts;  // name -> the code the settings and start() take
    m.attr("MATCH_CAP") = bsd::kMatchCap;
    m.attr("SEPARATOR") = bsd::kSeparator;
    m.attr("MAX_OCCURRENCES") = bsd::kMaxOccurrences;
    m.attr("COPY_PER_MATCH") = bsd::kCopyPerMatch;
    m.attr("COPY_MIN_MATCH") = bsd::kCopyMinMatch;
    m.def("abi_version", [] { return kAbiVersion; }, "the source's interface version");
}

}  // namespace

}  // namespace bsd_py

NB_MODULE(_batchserve_draft, m) {
    using namespace bsd_py;
    m.doc() = "batchserve's native drafter";
    nb::register_exception_translator(non_standard);
    nb::set_leak_warnings(false);  // an engine's drafter may live until the interpreter ends: no leak
    nb::class_<Bound>(m, "Drafter", "the Lookahead drafter's tries, texts and retrieval")
        .def("__init__", &init, nb::arg("branch_length"), nb::arg("own_branch_length"), nb::arg("max_match"),
             nb::arg("min_match"), nb::arg("prompt_weight"), nb::arg("trie_capacity"), nb::arg("scope_bytes"),
             nb::arg("trie_max_scopes"), nb::arg("recent_output_tokens"), nb::arg("copy_chain"), nb::arg("layout"))
        .def("start", &start, "start(id, prompt, scope or None, layout): a request starts (a running id starts clean)")
        .def("resume", &with_tokens<&bsd::Drafter::resume>,
             "resume(id, tokens): a resumed request's earlier output, before any accept: its own text only")
        .def("accept", &with_tokens<&bsd::Drafter::accept>,
             "accept(id, tokens): tokens accepted; the scope's trie learns them now, or at flush() if deferred")
        .def("finish", &finish,
             "finish(id): the request ends; its own text is dropped, its output kept as a recent output")
        .def("flush", &flush, "flush(): insert every deferred token into its scope's trie (the GIL released)")
        .def("set_deferred", &set_deferred,
             "set_deferred(on): queue trie insertion until flush() (turning it off flushes)")
        .def("propose", &propose, "propose(id, key, total, budget) -> None or (tokens, parents, scores, match)")
        .def("match_length", &match_length,
             "match_length(id, key) -> the longest suffix of key seen before with a token after it")
        .def("warm", &warm, "warm(scope, tokens, first, last): count the runs of tokens starting in [first, last)")
        .def("stats", &stats, "stats() -> dict of sizes and scopes")
        .def("memory", &memory, "memory() -> about the bytes it holds (tries, texts, recent outputs)")
        .def("scope_bytes", &scope_bytes,
             "scope_bytes(scope) -> None or the bytes its output trie and recent outputs hold")
        .def("fail_next", &fail_next, "fail_next(kind): a test hook: the next trie insertion throws")
        .def("trie", &trie, "trie(scope) -> None or {path: count}")
        .def("recent_text", &recent_text, "recent_text(scope) -> None or the scope's recent outputs, -1 between two");
    exports(m);
}
