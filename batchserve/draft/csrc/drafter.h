// The Lookahead drafter's state and retrieval (see batchserve/draft/trie.py for the design):
// one output trie per scope, shared by that scope's requests; per running request its own text
// (prompt, resumed and accepted output, indexed); per scope its recent outputs. Each scope is
// bounded on its own (trie nodes, bytes of trie and recent outputs): over a bound it trims its
// own oldest state, never another scope's. propose() builds a request's draft tree in one call.
// The state's bodies are in drafter.cpp, retrieval's in retrieve.cpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "builder.h"
#include "constants.h"
#include "lru.h"
#include "recent.h"
#include "text.h"
#include "trie.h"

namespace bsd {

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
    int layout;                  // a Layout
};

struct Request {
    Request(const int32_t* prompt, size_t n, int depth) : local(depth), num_prompt(n) { local.extend(prompt, n); }
    Text local;  // prompt + resumed tokens + accepted output
    size_t num_prompt;  // the prompt and resumed tokens: its own text, which no scope ever learns
    bool scoped = false;  // false: reads and feeds no output trie
    bool proves = false;  // its scope existed when it started: its ending proves the scope (2Q)
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

    // A request starts (a running id starts clean); `scope` null: it reads and feeds no scope.
    void start(const std::string& id, const int32_t* prompt, size_t n, const std::string* scope, int layout);
    // A resumed request's earlier output (a client's): its own text to draft from, never taught
    // to its scope's trie or recent outputs (anyone could send any tokens as resumed).
    void resume(const std::string& id, const int32_t* tokens, size_t n);
    // Tokens accepted: its own text at once; its scope's trie now, or at flush() if deferred.
    void accept(const std::string& id, const int32_t* tokens, size_t n);
    // Insert every deferred token into its scope's trie (in the order the requests accepted).
    void flush();
    // Queue trie insertion until flush(); turning it off flushes first (a failure leaves it on).
    void set_deferred(bool on);
    // The request ends: its scope learns the rest of its output, its own text goes.
    void finish(const std::string& id);
    // Load t[first, last) run starts of an earlier output into a scope's trie.
    void warm(const std::string& scope, const int32_t* t, size_t n, size_t first, size_t last);

    // The draft tree for request `id` whose text ends with key[0, n) (its last tokens; the
    // whole text is `total` tokens long), at most `budget` nodes. False: nothing to draft.
    bool propose(const std::string& id, const int32_t* key, size_t n, size_t total, size_t budget, Tree& out);
    // The longest suffix of key[0, n) seen before with a token after it: in the request's own
    // text (up to kMatchCap) or its scope's outputs (up to the trie's depth).
    int match_length(const std::string& id, const int32_t* key, size_t n);

    int64_t num_nodes() const { return nodes_; }
    size_t num_indexed_tokens() const { return indexed_; }
    size_t num_requests() const { return requests_.size(); }
    size_t num_pending() const { return pending_.size(); }
    const Recent& recent() const { return recent_; }
    const Trie* trie(const std::string& scope) const { return outputs_.find(scope); }
    // About the memory it holds: output tries, running requests' texts, recent outputs.
    size_t bytes() const;
    // What the scope holds (its output trie and recent outputs), what its quota bounds; -1: no such scope.
    int64_t scope_bytes(const std::string& scope) const;
    std::vector<std::string> scopes() const;  // output tries, least recently used first

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
    // Keeps the drafter's node total true however the insertion in its scope ends (a throw too).
    struct Tally {
        Tally(const Trie& t, int64_t& total) : trie(t), nodes(total), before(t.num_nodes) {}
        ~Tally() { nodes += trie.num_nodes - before; }
        const Trie& trie;
        int64_t& nodes;
        int64_t before;
    };

    // drafter.cpp: the state.
    Trie& output(const std::string& scope);
    void teach_output(const std::string& id, Request& r);
    void insert(Request& r, size_t num_new);
    void throw_injected();
    void run_ends(Request& r, Trie& trie, size_t num_new);
    void keep_bounds(const std::string& scope);
    bool evict_idle(const std::string& keep, bool proven);
    void make_room(const std::string& keep);
    void drop_scope(const std::string& scope);

    // retrieve.cpp: the proposal.
    int match_of(Request& r, const int32_t* key, size_t n, int own);
    Pair match_start(Search& s, Request& r, const int32_t* key, size_t m);
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
    // Scopes a second request has ended in (2Q's protected part); the others are on probation:
    // created when a first request ended, they share one bucket of the scope count and go first.
    std::unordered_set<std::string> proven_;
    std::unordered_map<std::string, Request> requests_;
    std::vector<std::string> pending_;  // requests with deferred tokens, in acceptance order
    bool deferred_ = false;  // accept() queues trie insertion until flush()
    size_t indexed_ = 0;
    Recent recent_;
    Chain chain_, theirs_;
    std::vector<int32_t> scratch_;
};

}  // namespace bsd
