// The Lookahead drafter's state and retrieval (see batchserve/draft/trie.py for the design):
// one output trie per scope, shared by that scope's requests; per running request its own text
// (prompt, resumed and accepted output, indexed); per scope its recent outputs. Each scope is
// bounded on its own (trie nodes, bytes of trie and recent outputs): over a bound it trims its
// own oldest state, never another scope's. propose() builds a request's draft tree in one call.
#pragma once

#include <algorithm>
#include <cstddef>
#include <exception>
#include <cstdint>
#include <new>
#include <queue>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "builder.h"
#include "lru.h"
#include "recent.h"
#include "text.h"
#include "trie.h"

namespace bsd {

enum Layout : int { kHierarchical = 0, kParallel = 1, kSingle = 2 };

// Every field is set by the binding from DraftConfig (batchserve/draft_config.py), where the
// defaults and their reasons live: none is repeated here.
struct Settings {
    size_t branch_length;        // n-gram length inserted into the output tries
    int own_branch_length;       // depth drafted from a request's own text
    size_t max_match, min_match;
    double prompt_weight;        // how much more a request's own n-grams count
    int64_t trie_capacity;       // output-trie nodes per scope before decay-and-prune
    size_t scope_bytes;          // per scope: its output trie and recent outputs
    size_t trie_max_scopes;
    int64_t recent_output_tokens;  // per scope
    bool copy_chain;
    int layout;
};

struct Request {
    Request(const int32_t* prompt, size_t n, int depth) : local(depth), num_prompt(n) { local.extend(prompt, n); }
    Text local;  // prompt + resumed tokens + accepted output
    size_t num_prompt;  // the prompt and resumed tokens: its own text, which no scope ever learns
    bool scoped = false;  // false: reads and feeds no output trie
    std::string scope;
    int layout = -1;  // -1: the drafter's
    // The output trie's nodes of the runs of its output ending at its last inserted token
    // (longest first, each shorter than branch_length), valid for trie `runs_of` at `runs_epoch`.
    std::vector<int32_t> runs;
    uint64_t runs_of = 0;
    int64_t runs_epoch = 0;
    size_t pending = 0;  // accepted tokens not yet inserted into the output trie (deferred)
};

struct Tree {
    std::vector<int32_t> tokens, parents;
    std::vector<double> scores;
    int match = 0;
};

class Drafter {
public:
    explicit Drafter(const Settings& s) : s_(s), recent_(s.recent_output_tokens, s.own_branch_length) {}

    void start(const std::string& id, const int32_t* prompt, size_t n, const std::string* scope, int layout) {
        finish(id);  // a restarted id starts clean
        Request& r = requests_.emplace(id, Request(prompt, n, s_.own_branch_length)).first->second;
        r.layout = layout;
        indexed_ += n;
        recent_.begin(id, scope, prompt, n);
        if (scope != nullptr) {
            r.scoped = true;
            r.scope = *scope;
            ++live_[*scope];
        }
    }

    // A resumed request's earlier output (a client's): its own text to draft from, never taught
    // to its scope's trie or recent outputs (anyone could send any tokens as resumed).
    void resume(const std::string& id, const int32_t* tokens, size_t n) {
        auto it = requests_.find(id);
        if (it == requests_.end() || n == 0) return;
        Request& r = it->second;
        if (r.local.size() != r.num_prompt) throw std::invalid_argument("resume comes before any accepted token");
        r.local.extend(tokens, n);
        indexed_ += n;
        r.num_prompt += n;
        recent_.resumed(id);
    }

    void accept(const std::string& id, const int32_t* tokens, size_t n) {
        auto it = requests_.find(id);
        if (it == requests_.end() || n == 0) return;
        Request& r = it->second;
        r.local.extend(tokens, n);
        indexed_ += n;
        if (!r.scoped) return;
        if (deferred) {
            if (r.pending == 0) pending_.push_back(id);
            r.pending += n;
            return;
        }
        insert(r, n);
    }

    // Insert every deferred token into its scope's trie (in the order the requests accepted).
    void flush() {
        for (const std::string& id : pending_) {
            auto it = requests_.find(id);
            if (it != requests_.end() && it->second.pending > 0) insert(it->second, it->second.pending);
        }
        pending_.clear();
    }

    void finish(const std::string& id) {
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

    // Load t[first, last) run starts of an earlier output into a scope's trie.
    void warm(const std::string& scope, const int32_t* t, size_t n, size_t first, size_t last) {
        Trie& trie = output(scope);
        {
            Tally tally(trie, nodes_);
            trie.insert_sequence(t, n, s_.branch_length, first, last);
        }
        keep_bounds(scope);
    }

    // The draft tree for request `id` whose text ends with key[0, n) (its last tokens; the
    // whole text is `total` tokens long), at most `budget` nodes. False: nothing to draft.
    bool propose(const std::string& id, const int32_t* key, size_t n, size_t total, size_t budget, Tree& out);

    // The longest suffix of key[0, n) seen before with a token after it: in the request's own
    // text (up to kMatchCap) or its scope's outputs (up to the trie's depth).
    int match_length(const std::string& id, const int32_t* key, size_t n) {
        auto it = requests_.find(id);
        return it == requests_.end() ? 0 : match_of(it->second, key, n, -1);
    }

    int64_t num_nodes() const { return nodes_; }
    size_t num_indexed_tokens() const { return indexed_; }
    size_t num_requests() const { return requests_.size(); }
    size_t num_pending() const { return pending_.size(); }
    const Recent& recent() const { return recent_; }
    // About the memory it holds: output tries, running requests' texts, recent outputs.
    size_t bytes() const {
        size_t n = recent_.bytes();
        for (const auto& item : outputs_.items()) n += item.second.bytes();
        for (const auto& item : requests_) n += item.second.local.bytes();
        return n;
    }
    const Trie* trie(const std::string& scope) const { return outputs_.find(scope); }
    // What the scope holds (its output trie and recent outputs), what its quota bounds; -1: no such scope.
    int64_t scope_bytes(const std::string& scope) const {
        const Trie* t = outputs_.find(scope);
        const size_t recent = recent_.bytes(scope);
        if (t == nullptr && recent == 0) return -1;
        return static_cast<int64_t>((t != nullptr ? t->bytes() : 0) + recent);
    }
    std::vector<std::string> scopes() const {
        std::vector<std::string> out;
        for (const auto& item : outputs_.items()) out.push_back(item.first);
        return out;
    }

    bool deferred = false;  // accept() queues trie insertion until flush()
    // A test hook: the next trie insertion throws (1: bad_alloc, 2: runtime_error, 3: a non-std
    // exception), as a real failure would, so tests can reach the binding's error paths.
    int fail_next = 0;

private:
    struct Pair {
        int32_t local;  // an index node (arena), or -1
        int32_t out;    // an output-trie node, or -1
    };
    struct Kid {
        int32_t token;
        Pair pair;
        double w, prob;
    };
    struct INode {  // a path of a request's own text seen as a trie node
        size_t depth;
        std::vector<int32_t> ends;  // the position after each occurrence, ascending
        bool grouped = false;
        std::vector<std::pair<int32_t, int32_t>> kids;  // (token, node), first occurrence first
    };
    struct Search {  // one propose's scratch
        const Text* text = nullptr;
        const Trie* trie = nullptr;
        std::vector<INode> nodes;
    };

    Trie& output(const std::string& scope) {
        Trie* trie = outputs_.find(scope);
        if (trie != nullptr) {
            outputs_.touch(scope);
            return *trie;
        }
        Trie& made = outputs_.add(scope, ++serial_);
        if (outputs_.size() > s_.trie_max_scopes) evict_idle(scope);
        return made;
    }

    // Keeps the drafter's node total true however the insertion in its scope ends (a throw too).
    struct Tally {
        Tally(const Trie& t, int64_t& total) : trie(t), nodes(total), before(t.num_nodes) {}
        ~Tally() { nodes += trie.num_nodes - before; }
        const Trie& trie;
        int64_t& nodes;
        int64_t before;
    };

    // Its scope learns the rest of its output (the trie, then its recent outputs) as it ends.
    void teach_output(const std::string& id, Request& r) {
        if (r.pending > 0) insert(r, r.pending);
        if (!r.scoped) return;
        const size_t out = r.local.size() - r.num_prompt;
        // Recent outputs live and go with their scope's trie: the scope count bounds both.
        if (out > 0 && outputs_.find(r.scope) == nullptr) output(r.scope);
        recent_.end(id, r.local.data() + r.num_prompt, out);
        keep_bounds(r.scope);
    }

    void insert(Request& r, size_t num_new) {
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

    void throw_injected() {
        const int kind = fail_next;
        fail_next = 0;
        if (kind == 1) throw std::bad_alloc();
        if (kind == 2) throw std::runtime_error("injected failure");
        throw kind;
    }

    // The runs of the output ending before the `num_new` newest tokens, found from the root:
    // for a request new to `trie`, or after a prune.
    void run_ends(Request& r, Trie& trie, size_t num_new) {
        r.runs.clear();
        const size_t end = r.local.size() - num_new;
        const int64_t room = static_cast<int64_t>(end) - static_cast<int64_t>(r.num_prompt);
        const int64_t longest = std::min(static_cast<int64_t>(s_.branch_length) - 1, room);
        for (int64_t i = longest; i > 0; --i)
            r.runs.push_back(trie.path(r.local.data() + end - i, static_cast<size_t>(i)));
    }

    // A scope over its node cap or byte quota trims its own oldest state, never another scope's:
    // the larger of its trie (counts halved, nodes under 1 deleted, the arrays rebuilt to size,
    // so the memory goes back) and its recent outputs (the oldest half) gives way first. Over the
    // quota it trims to half of it: arrays grow by doubling, so it then grows a while untrimmed.
    void keep_bounds(const std::string& scope) {
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

    bool evict_idle(const std::string& keep) {
        for (const auto& item : outputs_.items()) {
            if (item.first != keep && live_.find(item.first) == live_.end()) {
                drop_scope(std::string(item.first));
                return true;
            }
        }
        return false;
    }

    void drop_scope(const std::string& scope) {
        const Trie* trie = outputs_.find(scope);
        if (trie == nullptr) return;
        nodes_ -= trie->num_nodes;
        outputs_.erase(scope);
        recent_.drop(scope);
    }

    int match_of(Request& r, const int32_t* key, size_t n, int own);
    void children(Search& s, Pair pair, std::vector<Kid>& kids);
    const std::vector<std::pair<int32_t, int32_t>>& grouped(Search& s, int32_t node);
    void best_first(Search& s, Pair start, TreeBuilder& b);
    void heaviest_chain(Search& s, Pair pair, int64_t limit, Chain& chain);
    void parallel(Search& s, Pair start, TreeBuilder& b);

    Settings s_;
    LruMap<Trie> outputs_;  // per scope, least recently used first
    int64_t nodes_ = 0;     // in every output trie, kept as they change
    uint64_t serial_ = 0;
    std::unordered_map<std::string, int> live_;  // running requests per scope
    std::unordered_map<std::string, Request> requests_;
    std::vector<std::string> pending_;  // requests with deferred tokens, in acceptance order
    size_t indexed_ = 0;
    Recent recent_;
    Chain chain_, theirs_;
    std::vector<int32_t> scratch_;
};

}  // namespace bsd
