// The drafter's state (drafter.h): requests starting, accepting and ending, what their scopes
// learn (at once or deferred), warm-ups, and each scope's bounds.
#include "drafter.h"

#include <algorithm>
#include <climits>
#include <cstdint>
#include <exception>
#include <new>
#include <stdexcept>

namespace bsd {

void Drafter::start(const std::string& id, const int32_t* prompt, size_t n, const std::string* scope, int layout) {
    finish(id);  // a restarted id starts clean
    Request& r = requests_.emplace(id, Request(prompt, n, s_.own_branch_length)).first->second;
    r.layout = layout;
    indexed_ += n;
    recent_.begin(id, scope, prompt, n);
    if (scope != nullptr) {
        r.scoped = true;
        r.scope = *scope;
        r.proves = outputs_.find(*scope) != nullptr;
        ++live_[*scope];
    }
}

void Drafter::resume(const std::string& id, const int32_t* tokens, size_t n) {
    auto it = requests_.find(id);
    if (it == requests_.end() || n == 0) return;
    Request& r = it->second;
    if (r.local.size() != r.num_prompt) throw std::invalid_argument("resume comes before any accepted token");
    r.local.extend(tokens, n);
    indexed_ += n;
    r.num_prompt += n;
    recent_.resumed(id);
}

void Drafter::accept(const std::string& id, const int32_t* tokens, size_t n) {
    auto it = requests_.find(id);
    if (it == requests_.end() || n == 0) return;
    Request& r = it->second;
    r.local.extend(tokens, n);
    indexed_ += n;
    if (!r.scoped) return;
    if (deferred_) {
        if (r.pending == 0) pending_.push_back(id);
        r.pending += n;
        return;
    }
    insert(r, n);
}

void Drafter::flush() {
    for (const std::string& id : pending_) {
        auto it = requests_.find(id);
        if (it != requests_.end() && it->second.pending > 0) insert(it->second, it->second.pending);
    }
    pending_.clear();
}

void Drafter::set_deferred(bool on) {
    if (!on) flush();  // a failure leaves it deferred, the tokens still queued
    deferred_ = on;
}

void Drafter::finish(const std::string& id) {
    auto it = requests_.find(id);
    if (it == requests_.end()) return;
    Request& r = it->second;
    std::exception_ptr failed;  // it ends whatever fails (its scope then misses some of its output)
    try {
        teach_output(id, r);
    } catch (...) {
        failed = std::current_exception();
    }
    auto queued = std::find(pending_.begin(), pending_.end(), id);
    if (queued != pending_.end()) pending_.erase(queued);
    recent_.cancel(id);
    auto live = live_.find(r.scope);
    if (r.scoped && live != live_.end() && --live->second == 0) live_.erase(live);
    indexed_ -= r.local.size();
    requests_.erase(it);
    if (failed) std::rethrow_exception(failed);
}

void Drafter::warm(const std::string& scope, const int32_t* t, size_t n, size_t first, size_t last) {
    Trie& trie = output(scope);
    if (proven_.insert(scope).second) make_room(scope);  // an operator's corpus is no one-off
    {
        Tally tally(trie, nodes_);
        trie.insert_sequence(t, n, s_.branch_length, first, last);
    }
    keep_bounds(scope);
}

size_t Drafter::bytes() const {
    size_t n = recent_.bytes();
    for (const auto& item : outputs_.items()) n += item.second.bytes();
    for (const auto& item : requests_) n += item.second.local.bytes();
    return n;
}

int64_t Drafter::scope_bytes(const std::string& scope) const {
    const Trie* t = outputs_.find(scope);
    const size_t recent = recent_.bytes(scope);
    if (t == nullptr && recent == 0) return -1;
    return static_cast<int64_t>((t != nullptr ? t->bytes() : 0) + recent);
}

std::vector<std::string> Drafter::scopes() const {
    std::vector<std::string> out;
    for (const auto& item : outputs_.items()) out.push_back(item.first);
    return out;
}

Trie& Drafter::output(const std::string& scope) {
    Trie* trie = outputs_.find(scope);
    if (trie != nullptr) {
        outputs_.touch(scope);
        return *trie;
    }
    Trie& made = outputs_.add(scope, ++serial_);
    make_room(scope);
    return made;
}

// 2Q over the scope count: scopes on probation hold at most a quarter of it (at least one), and
// past either bound an idle one of the same part goes, least recently used first; a proven
// scope gives way only to proven ones (or, failing any idle probation scope, past the total).
// So a flood of one-off tenants churns the probation bucket and never evicts a tenant that
// came back.
void Drafter::make_room(const std::string& keep) {
    const size_t cap = s_.trie_max_scopes;
    const size_t probation_cap = std::max<size_t>(1, cap / 4);
    const size_t protected_cap = cap > probation_cap ? cap - probation_cap : 1;
    if (outputs_.size() - proven_.size() > probation_cap) evict_idle(keep, false);
    if (proven_.size() > protected_cap) evict_idle(keep, true);
    if (outputs_.size() > cap && !evict_idle(keep, false)) evict_idle(keep, true);
}

// Its scope learns the rest of its output (the trie, then its recent outputs) as it ends. A
// scope is made on probation (by its first output); a request that started after it was made
// proves it by ending: a tenant that came back, which a flood of one-off tenants never is.
void Drafter::teach_output(const std::string& id, Request& r) {
    if (r.pending > 0) insert(r, r.pending);
    if (!r.scoped) return;
    const size_t out = r.local.size() - r.num_prompt;
    // Recent outputs live and go with their scope's trie: the scope count bounds both.
    if (out > 0 && outputs_.find(r.scope) == nullptr) output(r.scope);
    if (r.proves && outputs_.find(r.scope) != nullptr && proven_.insert(r.scope).second) make_room(r.scope);
    recent_.end(id, r.local.data() + r.num_prompt, out);
    keep_bounds(r.scope);
}

void Drafter::insert(Request& r, size_t num_new) {
    const int64_t epoch = r.runs_epoch;
    r.runs_epoch = -1;  // until its runs are whole again: after a throw they are found afresh
    if (fail_next != 0) throw_injected();
    Trie& trie = output(r.scope);
    {
        Tally tally(trie, nodes_);
        if (r.runs_of != trie.serial || epoch != trie.epoch) run_ends(r, trie, num_new);
        const size_t keep = s_.branch_length - 1;  // a run of branch_length tokens extends no further
        for (size_t i = r.local.size() - num_new; i < r.local.size(); ++i)
            trie.extend_runs(r.runs, r.local.at(i), keep);
        r.runs_of = trie.serial;
        r.runs_epoch = trie.epoch;
    }
    r.pending = 0;  // only now: a failed insertion leaves them queued for the next flush
    keep_bounds(r.scope);
}

void Drafter::throw_injected() {
    const int kind = fail_next;
    fail_next = 0;
    if (kind == 1) throw std::bad_alloc();
    if (kind == 2) throw std::runtime_error("injected failure");
    throw kind;
}

// The runs of the output ending before the `num_new` newest tokens, found from the root:
// for a request new to `trie`, or after a prune.
void Drafter::run_ends(Request& r, Trie& trie, size_t num_new) {
    r.runs.clear();
    const size_t end = r.local.size() - num_new;
    const int64_t room = static_cast<int64_t>(end) - static_cast<int64_t>(r.num_prompt);
    const int64_t longest = std::min(static_cast<int64_t>(s_.branch_length) - 1, room);
    for (int64_t i = longest; i > 0; --i) r.runs.push_back(trie.path(r.local.data() + end - i, static_cast<size_t>(i)));
}

// A scope over its node cap or byte quota trims its own oldest state, never another scope's:
// the larger of its trie (counts halved, nodes under 1 deleted, the arrays rebuilt to size,
// so the memory goes back) and its recent outputs (the oldest half) gives way first. Over the
// quota it trims to half of it: arrays grow by doubling, so it then grows a while untrimmed.
void Drafter::keep_bounds(const std::string& scope) {
    Trie* trie = outputs_.find(scope);
    if (trie == nullptr) return;
    const size_t low = static_cast<size_t>(scope_bytes(scope)) > s_.scope_bytes ? s_.scope_bytes / 2 : SIZE_MAX;
    while (trie->num_nodes > s_.trie_capacity || static_cast<size_t>(scope_bytes(scope)) > low) {
        const bool recent_first = recent_.bytes(scope) > trie->bytes() || trie->num_nodes == 0;
        if (recent_first && trie->num_nodes <= s_.trie_capacity && recent_.trim_oldest(scope)) continue;
        if (trie->num_nodes == 0) return;  // nothing left to trim: the bare trie is under any quota
        Tally tally(*trie, nodes_);
        trie->prune();
        trie->compact();
    }
}

bool Drafter::evict_idle(const std::string& keep, bool proven) {
    for (const auto& item : outputs_.items()) {
        if (item.first != keep && live_.find(item.first) == live_.end() && (proven_.count(item.first) > 0) == proven) {
            drop_scope(std::string(item.first));
            return true;
        }
    }
    return false;
}

void Drafter::drop_scope(const std::string& scope) {
    const Trie* trie = outputs_.find(scope);
    if (trie == nullptr) return;
    nodes_ -= trie->num_nodes;
    outputs_.erase(scope);
    proven_.erase(scope);
    recent_.drop(scope);
}

}  // namespace bsd
