// Retrieval (drafter.h): a request's draft tree from its own text, its scope's recent outputs and
// its scope's output trie (batchserve/draft/trie.py describes the design), in one call.
#include "drafter.h"

#include <algorithm>
#include <queue>
#include <unordered_map>

namespace bsd {

bool Drafter::propose(const std::string& id, const int32_t* key, size_t n, size_t total, size_t budget, Tree& out) {
    if (budget < 1 || n == 0) return false;
    auto it = requests_.find(id);
    if (it == requests_.end()) return false;
    Request& r = it->second;
    Search s;
    s.text = &r.local;
    s.trie = r.scoped ? outputs_.find(r.scope) : nullptr;
    const int layout = r.layout >= 0 ? r.layout : s_.layout;
    TreeBuilder b(budget);
    int own = -1;  // the match in the request's own text, when measured
    if (s_.copy_chain) {
        // What followed the longest earlier match, first: where the request is copying from
        // (its own text's, or a recent output's if longer), the most recent occurrence.
        own = static_cast<int>(copy_chain(r.local, key, n, kMatchCap, chain_, scratch_));
        const int seen = static_cast<int>(recent_.copy(id, r.local, key, n, theirs_, scratch_));
        if (seen > own) {
            own = seen;
            chain_.swap(theirs_);
        }
        b.add_chain(chain_);
    }
    // Multi-stage retrieval: the longest matching suffix first; shorter ones fill what is left.
    const size_t longest = std::min({s_.max_match, total, s_.branch_length - 1, n});
    for (size_t m = longest; m >= s_.min_match && m > 0; --m) {
        if (b.full() || (layout == kSingle && !b.empty())) break;  // a copy chain may be the one branch
        const Pair start = match_start(s, r, key + n - m, m);
        if (start.local < 0 && start.out < 0) continue;
        if (layout == kParallel) {
            parallel(s, start, b);
        } else if (layout == kSingle) {
            Chain chain;
            heaviest_chain(s, start, static_cast<int64_t>(b.budget()), chain);
            b.add_chain(chain);
        } else {
            best_first(s, start, b);
        }
    }
    if (b.empty()) return false;
    b.finish();
    out.tokens.swap(b.tokens);
    out.parents.swap(b.parents);
    out.scores.swap(b.scores);
    out.match = match_of(r, key, n, own);
    return true;
}

// Where key[0, m) is in the request's own text (an index node) and in its scope's output trie.
Drafter::Pair Drafter::match_start(Search& s, Request& r, const int32_t* key, size_t m) {
    Pair start{-1, -1};
    if (m <= std::min(r.local.size(), static_cast<size_t>(r.local.depth()))) {
        INode node{m, {}, false, {}};
        r.local.find(key, m, node.ends);
        if (!node.ends.empty()) {
            start.local = static_cast<int32_t>(s.nodes.size());
            s.nodes.push_back(std::move(node));
        }
    }
    if (s.trie != nullptr) start.out = s.trie->find(key, m);
    return start;
}

int Drafter::match_length(const std::string& id, const int32_t* key, size_t n) {
    auto it = requests_.find(id);
    return it == requests_.end() ? 0 : match_of(it->second, key, n, -1);
}

// The match a tree reports: `own` (the copy chain's, when measured) or the request's own text's,
// raised to its scope's trie's where that is longer.
int Drafter::match_of(Request& r, const int32_t* key, size_t n, int own) {
    int match = own >= 0 ? own : static_cast<int>(r.local.copy_source(key, n, kMatchCap, scratch_));
    const Trie* trie = r.scoped ? outputs_.find(r.scope) : nullptr;
    const int deepest = static_cast<int>(s_.branch_length) - 1;
    if (trie != nullptr && match < deepest) match = std::max(match, trie->suffix_match(key, n, deepest));
    return match;
}

const std::vector<std::pair<int32_t, int32_t>>& Drafter::grouped(Search& s, int32_t node) {
    if (s.nodes[static_cast<size_t>(node)].grouped) return s.nodes[static_cast<size_t>(node)].kids;
    const size_t depth = s.nodes[static_cast<size_t>(node)].depth + 1;
    std::vector<std::pair<int32_t, int32_t>> kids;
    if (depth <= static_cast<size_t>(s.text->depth())) {
        // This node's occurrences with a next token, grouped by it, groups in first-occurrence order.
        std::vector<std::pair<int32_t, std::vector<int32_t>>> groups;
        std::unordered_map<int32_t, size_t> where;
        const std::vector<int32_t>& ends = s.nodes[static_cast<size_t>(node)].ends;
        for (int32_t e : ends) {
            if (static_cast<size_t>(e) >= s.text->size()) continue;
            const int32_t token = s.text->at(static_cast<size_t>(e));
            size_t g = groups.size();
            if (groups.size() < 8) {
                for (size_t i = 0; i < groups.size(); ++i)
                    if (groups[i].first == token) g = i;
            } else {
                if (where.empty())
                    for (size_t i = 0; i < groups.size(); ++i) where.emplace(groups[i].first, i);
                auto w = where.find(token);
                if (w != where.end()) g = w->second;
                else where.emplace(token, g);
            }
            if (g == groups.size()) groups.emplace_back(token, std::vector<int32_t>());
            groups[g].second.push_back(e + 1);
        }
        for (auto& [token, after] : groups) {
            kids.emplace_back(token, static_cast<int32_t>(s.nodes.size()));
            s.nodes.push_back(INode{depth, std::move(after), false, {}});
        }
    }
    INode& self = s.nodes[static_cast<size_t>(node)];  // after the pushes: the arena may have moved
    self.kids = std::move(kids);
    self.grouped = true;
    return self.kids;
}

// Each continuation of `pair` with its weight and its share of all continuations' weight: the
// scope's first (creation order), then the request's own new ones (first occurrence first).
void Drafter::children(Search& s, Pair pair, std::vector<Kid>& kids) {
    kids.clear();
    const double pw = s_.prompt_weight;
    static const std::vector<std::pair<int32_t, int32_t>> none;
    const auto& own = pair.local >= 0 ? grouped(s, pair.local) : none;
    auto count = [&](int32_t node) { return static_cast<double>(s.nodes[static_cast<size_t>(node)].ends.size()); };
    if (pair.out >= 0) {
        std::unordered_map<int32_t, int32_t> by_token;  // the request's own continuations, when many
        if (own.size() > 8) by_token.insert(own.begin(), own.end());
        for (int32_t c = s.trie->node(pair.out).first; c >= 0; c = s.trie->node(c).next) {
            const int32_t token = s.trie->node(c).token;
            int32_t local = -1;
            if (own.size() > 8) {
                auto hit = by_token.find(token);
                if (hit != by_token.end()) local = hit->second;
            } else {
                for (const auto& [t, node] : own)
                    if (t == token) local = node;
            }
            const double mine = local >= 0 ? count(local) * pw : 0.0;
            kids.push_back(Kid{token, Pair{local, c}, mine + s.trie->node(c).count, 0.0});
        }
        for (const auto& [token, node] : own)
            if (s.trie->child(pair.out, token) < 0)
                kids.push_back(Kid{token, Pair{node, -1}, count(node) * pw, 0.0});
    } else {
        for (const auto& [token, node] : own) kids.push_back(Kid{token, Pair{node, -1}, count(node) * pw, 0.0});
    }
    double total = 0.0;
    for (const Kid& k : kids) total += k.w;
    for (Kid& k : kids) k.prob = total > 0 ? k.w / total : 0.0;
}

// Hierarchical: the heaviest nodes under the match, best first, shared prefixes merged.
void Drafter::best_first(Search& s, Pair start, TreeBuilder& b) {
    struct Item {
        double w;
        uint64_t seq;
        int32_t parent, token;
        Pair pair;
        double prob;
    };
    auto later = [](const Item& a, const Item& c) { return a.w < c.w || (a.w == c.w && a.seq > c.seq); };
    std::priority_queue<Item, std::vector<Item>, decltype(later)> heap(later);
    uint64_t seq = 0;
    std::vector<Kid> kids;
    auto push = [&](Pair pair, int32_t parent) {
        children(s, pair, kids);
        for (const Kid& k : kids) heap.push(Item{k.w, seq++, parent, k.token, k.pair, k.prob});
    };
    push(start, -1);
    while (!heap.empty() && !b.full()) {
        const Item top = heap.top();
        heap.pop();
        const int32_t idx = b.add(top.parent, top.token, top.prob);
        if (!b.full()) push(top.pair, idx);  // else its children would never be popped
    }
}

// The heaviest path under `pair`, at most `limit` steps, appended to `chain`: (token,
// probability given the previous) per step.
void Drafter::heaviest_chain(Search& s, Pair pair, int64_t limit, Chain& chain) {
    std::vector<Kid> kids;
    for (int64_t added = 0; added < limit; ++added) {
        children(s, pair, kids);
        if (kids.empty()) break;
        const Kid* best = &kids[0];
        for (const Kid& k : kids)
            if (k.w > best->w) best = &k;
        chain.emplace_back(best->token, best->prob);
        pair = best->pair;
    }
}

// Parallel: disjoint chains, the heaviest path under each of the heaviest first tokens, each up
// to branch_length; no prefix sharing below the root.
void Drafter::parallel(Search& s, Pair start, TreeBuilder& b) {
    std::vector<Kid> kids;
    children(s, start, kids);
    std::stable_sort(kids.begin(), kids.end(), [](const Kid& a, const Kid& c) { return a.w > c.w; });
    for (const Kid& k : kids) {
        if (b.full()) return;
        if (b.find(-1, k.token) >= 0) continue;  // an earlier (longer) match has a branch starting with it
        const int64_t room = std::min(static_cast<int64_t>(s_.branch_length),
                                      static_cast<int64_t>(b.budget()) - static_cast<int64_t>(b.tokens.size()));
        Chain chain{{k.token, k.prob}};
        heaviest_chain(s, k.pair, room - 1, chain);
        b.add_chain(chain);
    }
}

}  // namespace bsd
