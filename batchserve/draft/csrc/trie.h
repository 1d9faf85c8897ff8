// The counted n-gram trie of a scope's outputs: how often each run of tokens occurred.
//
// Nodes live in one array (freed slots reused); a node's children form a list in creation order
// (the order retrieval breaks ties in), and one open-addressing table maps (parent, token) to a
// child, so a lookup costs a probe or two however many children the root has. The lookups are
// inline here; the rest of the bodies are in trie.cpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace bsd {

// (parent, token) -> child, linear probing, deletion by backward shift (no tombstones).
class ChildTable {
public:
    // Room for `expected` entries without a rehash (a rebuilt trie's table sized to its nodes).
    explicit ChildTable(size_t expected = 0);

    int32_t get(int32_t parent, int32_t token) const {
        const uint64_t k = key(parent, token);
        for (size_t i = slot(k);; i = (i + 1) & mask_) {
            if (vals_[i] < 0) return -1;
            if (keys_[i] == k) return vals_[i];
        }
    }
    void put(int32_t parent, int32_t token, int32_t child);
    void erase(int32_t parent, int32_t token);

    size_t bytes() const { return keys_.capacity() * sizeof(uint64_t) + vals_.capacity() * sizeof(int32_t); }

private:
    static uint64_t key(int32_t parent, int32_t token) {
        return (static_cast<uint64_t>(static_cast<uint32_t>(parent)) << 32) | static_cast<uint32_t>(token);
    }
    size_t slot(uint64_t k) const {
        k ^= k >> 33;
        k *= 0xff51afd7ed558ccdULL;
        k ^= k >> 33;
        return static_cast<size_t>(k) & mask_;
    }
    void rehash(size_t capacity);

    std::vector<uint64_t> keys_;
    std::vector<int32_t> vals_;  // -1: empty
    size_t mask_ = 0;
    size_t size_ = 0;
};

struct TrieNode {
    int32_t token = -1;
    int32_t first = -1;  // first child (creation order)
    int32_t last = -1;   // last child
    int32_t next = -1;   // next sibling
    double count = 0.0;  // times this path occurred as a run (halved by each prune)
};

class Trie {
public:
    static constexpr int32_t kRoot = 0;

    explicit Trie(uint64_t serial) : serial(serial) { nodes_.emplace_back(); }

    const TrieNode& node(int32_t i) const { return nodes_[static_cast<size_t>(i)]; }
    int32_t child(int32_t parent, int32_t token) const { return table_.get(parent, token); }
    // The node of key[0, m), or -1.
    int32_t find(const int32_t* key, size_t m) const {
        int32_t node = kRoot;
        for (size_t i = 0; i < m && node >= 0; ++i) node = table_.get(node, key[i]);
        return node;
    }

    // The child of `parent` carrying `token`, made (count 0) if missing.
    int32_t child_or_add(int32_t parent, int32_t token);
    // Count every run of up to `branch` tokens of t[0, n) that starts in [first, last).
    void insert_sequence(const int32_t* t, size_t n, size_t branch, size_t first, size_t last);
    // The runs that end at a new token: each of `runs` (longest first) extended by it, then the
    // token alone, each counted once; keeps the `keep` shortest (a longer run extends no further).
    void extend_runs(std::vector<int32_t>& runs, int32_t token, size_t keep);
    // The node of t[0, n), made uncounted where a prune removed it.
    int32_t path(const int32_t* t, size_t n);
    // The longest suffix of key[0, n) (at most `limit` tokens) that is a path with children.
    int suffix_match(const int32_t* key, size_t n, int limit) const;

    // Halve every count; delete the nodes that fall below 1, with their subtrees.
    void prune();
    // Rebuild the nodes and the table to fit what is left (a prune frees slots but never memory):
    // children keep their creation order; node ids change, so held ones go stale (epoch).
    void compact();

    // Every node's path and count, depth first in creation order (tests read the trie with it).
    template <class F>
    void each(F&& visit) const {
        std::vector<int32_t> path;
        walk(kRoot, path, visit);
    }

    size_t bytes() const {
        return nodes_.capacity() * sizeof(TrieNode) + free_.capacity() * sizeof(int32_t) + table_.bytes();
    }

    int64_t num_nodes = 0;  // the root excluded
    int64_t epoch = 0;      // prunes so far: a node held outside the trie may be gone since
    uint64_t serial;        // which trie this is: a scope dropped and made again is another

private:
    void free_subtree(int32_t top);
    template <class F>
    void walk(int32_t at, std::vector<int32_t>& path, F& visit) const {
        for (int32_t c = nodes_[static_cast<size_t>(at)].first; c >= 0; c = nodes_[static_cast<size_t>(c)].next) {
            path.push_back(nodes_[static_cast<size_t>(c)].token);
            visit(path, nodes_[static_cast<size_t>(c)].count);
            walk(c, path, visit);
            path.pop_back();
        }
    }

    std::vector<TrieNode> nodes_;  // [0]: the root
    std::vector<int32_t> free_;
    std::vector<int32_t> scratch_;
    ChildTable table_;
};

}  // namespace bsd
