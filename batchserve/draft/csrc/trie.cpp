// The output trie's changes (trie.h): the child table's writes, counting runs, decay and rebuild.
#include "trie.h"

#include <utility>

namespace bsd {

ChildTable::ChildTable(size_t expected) {
    size_t capacity = 64;
    while ((expected + 1) * 4 > capacity * 3) capacity *= 2;
    rehash(capacity);
}

void ChildTable::put(int32_t parent, int32_t token, int32_t child) {
    if ((size_ + 1) * 4 > keys_.size() * 3) rehash(keys_.size() * 2);
    const uint64_t k = key(parent, token);
    size_t i = slot(k);
    while (vals_[i] >= 0 && keys_[i] != k) i = (i + 1) & mask_;
    if (vals_[i] < 0) ++size_;
    keys_[i] = k;
    vals_[i] = child;
}

void ChildTable::erase(int32_t parent, int32_t token) {
    const uint64_t k = key(parent, token);
    size_t i = slot(k);
    while (true) {
        if (vals_[i] < 0) return;
        if (keys_[i] == k) break;
        i = (i + 1) & mask_;
    }
    // Backward shift: move later entries of the probe run into the hole.
    size_t hole = i;
    for (size_t j = (i + 1) & mask_; vals_[j] >= 0; j = (j + 1) & mask_) {
        const size_t home = slot(keys_[j]);
        const bool movable = hole <= j ? (home <= hole || home > j) : (home <= hole && home > j);
        if (movable) {
            keys_[hole] = keys_[j];
            vals_[hole] = vals_[j];
            hole = j;
        }
    }
    vals_[hole] = -1;
    --size_;
}

void ChildTable::rehash(size_t capacity) {
    std::vector<uint64_t> keys(capacity);
    std::vector<int32_t> vals(capacity, -1);
    keys.swap(keys_);
    vals.swap(vals_);
    mask_ = capacity - 1;
    size_ = 0;
    for (size_t i = 0; i < keys.size(); ++i)
        if (vals[i] >= 0) put(static_cast<int32_t>(keys[i] >> 32), static_cast<int32_t>(keys[i]), vals[i]);
}

int32_t Trie::child_or_add(int32_t parent, int32_t token) {
    int32_t c = table_.get(parent, token);
    if (c >= 0) return c;
    if (!free_.empty()) {
        c = free_.back();
        free_.pop_back();
        nodes_[static_cast<size_t>(c)] = TrieNode();
    } else {
        c = static_cast<int32_t>(nodes_.size());
        nodes_.emplace_back();
    }
    TrieNode& n = nodes_[static_cast<size_t>(c)];
    n.token = token;
    TrieNode& p = nodes_[static_cast<size_t>(parent)];
    if (p.last >= 0) nodes_[static_cast<size_t>(p.last)].next = c;
    else p.first = c;
    p.last = c;
    table_.put(parent, token, c);
    ++num_nodes;
    return c;
}

void Trie::insert_sequence(const int32_t* t, size_t n, size_t branch, size_t first, size_t last) {
    for (size_t s = first; s < last && s < n; ++s) {
        int32_t node = kRoot;
        for (size_t i = s; i < n && i < s + branch; ++i) {
            node = child_or_add(node, t[i]);
            nodes_[static_cast<size_t>(node)].count += 1.0;
        }
    }
}

void Trie::extend_runs(std::vector<int32_t>& runs, int32_t token, size_t keep) {
    scratch_.clear();
    for (int32_t node : runs) scratch_.push_back(node);
    scratch_.push_back(kRoot);
    runs.clear();
    for (int32_t node : scratch_) {
        const int32_t c = child_or_add(node, token);
        nodes_[static_cast<size_t>(c)].count += 1.0;
        runs.push_back(c);
    }
    if (runs.size() > keep) runs.erase(runs.begin(), runs.end() - static_cast<std::ptrdiff_t>(keep));
}

int32_t Trie::path(const int32_t* t, size_t n) {
    int32_t node = kRoot;
    for (size_t i = 0; i < n; ++i) node = child_or_add(node, t[i]);
    return node;
}

int Trie::suffix_match(const int32_t* key, size_t n, int limit) const {
    int best = 0;
    for (int m = 1; m <= limit && static_cast<size_t>(m) <= n; ++m) {
        const int32_t node = find(key + n - m, static_cast<size_t>(m));
        if (node < 0 || nodes_[static_cast<size_t>(node)].first < 0) break;
        best = m;
    }
    return best;
}

void Trie::prune() {
    ++epoch;
    std::vector<int32_t> stack{kRoot};
    while (!stack.empty()) {
        const int32_t at = stack.back();
        stack.pop_back();
        int32_t prev = -1;
        for (int32_t c = nodes_[static_cast<size_t>(at)].first; c >= 0;) {
            TrieNode& n = nodes_[static_cast<size_t>(c)];
            const int32_t next = n.next;
            n.count /= 2;
            if (n.count < 1) {
                TrieNode& p = nodes_[static_cast<size_t>(at)];
                if (prev >= 0) nodes_[static_cast<size_t>(prev)].next = next;
                else p.first = next;
                if (p.last == c) p.last = prev;
                table_.erase(at, n.token);
                free_subtree(c);
            } else {
                stack.push_back(c);
                prev = c;
            }
            c = next;
        }
    }
}

void Trie::compact() {
    ++epoch;
    std::vector<TrieNode> nodes;
    nodes.reserve(static_cast<size_t>(num_nodes) + 1);
    ChildTable table(static_cast<size_t>(num_nodes));
    nodes.emplace_back();
    std::vector<std::pair<int32_t, int32_t>> stack{{kRoot, kRoot}};  // (old id, new id)
    while (!stack.empty()) {
        const auto [from, to] = stack.back();
        stack.pop_back();
        for (int32_t c = nodes_[static_cast<size_t>(from)].first; c >= 0; c = nodes_[static_cast<size_t>(c)].next) {
            const int32_t made = static_cast<int32_t>(nodes.size());
            TrieNode n;
            n.token = nodes_[static_cast<size_t>(c)].token;
            n.count = nodes_[static_cast<size_t>(c)].count;
            nodes.push_back(n);  // reserved: no reallocation, `parent` stays valid
            TrieNode& parent = nodes[static_cast<size_t>(to)];
            if (parent.last >= 0) nodes[static_cast<size_t>(parent.last)].next = made;
            else parent.first = made;
            parent.last = made;
            table.put(to, n.token, made);
            stack.emplace_back(c, made);
        }
    }
    nodes_.swap(nodes);
    table_ = std::move(table);
    std::vector<int32_t>().swap(free_);
    std::vector<int32_t>().swap(scratch_);
}

void Trie::free_subtree(int32_t top) {
    std::vector<int32_t> stack{top};
    while (!stack.empty()) {
        const int32_t at = stack.back();
        stack.pop_back();
        for (int32_t c = nodes_[static_cast<size_t>(at)].first; c >= 0; c = nodes_[static_cast<size_t>(c)].next) {
            table_.erase(at, nodes_[static_cast<size_t>(c)].token);
            stack.push_back(c);
        }
        free_.push_back(at);
        --num_nodes;
    }
}

}  // namespace bsd
