// TreeBuilder: a draft tree accumulated by token path, so several matches merge into one tree.
// Node scores are path probabilities: a node's probability given its parent times the parent's.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace bsd {

class TreeBuilder {
public:
    explicit TreeBuilder(size_t budget) : budget_(budget) {}

    bool full() const { return tokens.size() >= budget_; }
    size_t budget() const { return budget_; }
    bool empty() const { return tokens.empty(); }

    int32_t find(int32_t parent, int32_t token) const {
        for (int32_t c = parent < 0 ? root_first_ : first_[static_cast<size_t>(parent)]; c >= 0;
             c = next_[static_cast<size_t>(c)])
            if (tokens[static_cast<size_t>(c)] == token) return c;
        return -1;
    }

    // Add (or find) the node; `prob` is its probability given its parent. Reached again from
    // another match, a node keeps the more confident estimate.
    int32_t add(int32_t parent, int32_t token, double prob) {
        const double score = prob * (parent < 0 ? 1.0 : scores[static_cast<size_t>(parent)]);
        int32_t idx = find(parent, token);
        if (idx >= 0) {
            scores[static_cast<size_t>(idx)] = std::max(scores[static_cast<size_t>(idx)], score);
            return idx;
        }
        idx = static_cast<int32_t>(tokens.size());
        tokens.push_back(token);
        parents.push_back(parent);
        scores.push_back(score);
        first_.push_back(-1);
        last_.push_back(-1);
        next_.push_back(-1);
        int32_t& head = parent < 0 ? root_first_ : first_[static_cast<size_t>(parent)];
        int32_t& tail = parent < 0 ? root_last_ : last_[static_cast<size_t>(parent)];
        if (tail >= 0) next_[static_cast<size_t>(tail)] = idx;
        else head = idx;
        tail = idx;
        return idx;
    }

    void add_chain(const std::vector<std::pair<int32_t, double>>& chain) {
        int32_t parent = -1;
        for (const auto& [token, prob] : chain) {
            if (full()) return;
            parent = add(parent, token, prob);
        }
    }

    // A later match can raise a parent's score above its children's: keep children at or below.
    void finish() {
        for (size_t i = 0; i < tokens.size(); ++i)
            if (parents[i] >= 0) scores[i] = std::min(scores[i], scores[static_cast<size_t>(parents[i])]);
    }

    std::vector<int32_t> tokens;
    std::vector<int32_t> parents;  // -1: a child of the root
    std::vector<double> scores;

private:
    size_t budget_;
    std::vector<int32_t> first_, last_, next_;  // children lists, in insertion order
    int32_t root_first_ = -1, root_last_ = -1;
};

}  // namespace bsd
