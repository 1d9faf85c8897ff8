// Text: a token array with an inverted index (the positions each token occurs at, ascending),
// extended per token. It answers the drafter's questions about a request's own prompt and
// output, and about a scope's recent outputs, in time proportional to the occurrences of the
// key's last token, not to the text's length:
// - find: the most recent occurrences of a key (a node of the trie of all its n-grams);
// - copy_source: the longest suffix of a key that occurred before with a token after it, and
//   where each of its occurrences (at that length) ends;
// - continuation: what followed the most recent of those, with each token's share among the
//   occurrences that still agree (what a trie's counts would give it).
#pragma once

#include <algorithm>
#include <cstdint>
#include <unordered_map>
#include <utility>
#include <vector>

namespace bsd {

constexpr int32_t kSeparator = -1;  // between two outputs in a scope's recent text: no token equals it
constexpr size_t kMaxOccurrences = 256;  // occurrences of a key drafting looks at, the most recent
using Chain = std::vector<std::pair<int32_t, double>>;  // (token, share among agreeing occurrences)

class Text {
public:
    explicit Text(int depth = 12) : depth_(depth) {}

    int depth() const { return depth_; }
    size_t size() const { return tok_.size(); }
    const int32_t* data() const { return tok_.data(); }
    int32_t at(size_t i) const { return tok_[i]; }

    void extend(const int32_t* t, size_t n) {
        for (size_t i = 0; i < n; ++i) {
            if (t[i] != kSeparator) at_[t[i]].push_back(static_cast<int32_t>(tok_.size()));
            tok_.push_back(t[i]);
        }
    }
    // The text from `first` on, renumbered from 0 (a scope dropping its oldest outputs).
    void drop_front(size_t first) {
        std::vector<int32_t> rest(tok_.begin() + static_cast<std::ptrdiff_t>(first), tok_.end());
        std::vector<int32_t>().swap(tok_);  // clear() would keep the capacity: release it
        std::unordered_map<int32_t, std::vector<int32_t>>().swap(at_);
        tok_.reserve(rest.size());
        extend(rest.data(), rest.size());
    }

    // Where the most recent kMaxOccurrences occurrences of key[0, m) end (the position after
    // each), ascending; empty when none.
    void find(const int32_t* key, size_t m, std::vector<int32_t>& ends) const {
        ends.clear();
        auto it = at_.find(key[m - 1]);
        if (it == at_.end()) return;
        const std::vector<int32_t>& ps = it->second;
        for (auto p = ps.rbegin(); p != ps.rend() && ends.size() < kMaxOccurrences; ++p) {
            if (static_cast<size_t>(*p) + 1 < m) break;  // too close to the start: so are the rest
            if (agrees(*p, key, m, m) == m) ends.push_back(*p + 1);
        }
        std::reverse(ends.begin(), ends.end());
    }

    // m: the longest suffix of key[0, n) (at most `limit` tokens) that occurs with a token
    // after it; `after`: the position after each occurrence of that suffix, ascending (the most
    // recent kMaxOccurrences). m is 0 when nothing matches.
    size_t copy_source(const int32_t* key, size_t n, size_t limit, std::vector<int32_t>& after) const {
        after.clear();
        limit = std::min(limit, n);
        if (limit < 1 || tok_.size() < 2) return 0;
        auto it = at_.find(key[n - 1]);
        if (it == at_.end()) return 0;
        const std::vector<int32_t>& ps = it->second;
        size_t best = 0;
        for (auto p = ps.rbegin(); p != ps.rend(); ++p) {
            if (static_cast<size_t>(*p) + 1 >= tok_.size()) continue;  // no token after it
            const size_t a = agrees(*p, key, n, limit);
            if (a > best) {
                best = a;
                after.clear();
            }
            if (a == best && after.size() < kMaxOccurrences) after.push_back(*p + 1);
            if (best == limit && after.size() == kMaxOccurrences) break;  // nothing can beat these
        }
        std::reverse(after.begin(), after.end());
        return best;
    }

    // What followed the most recent occurrence in `after` (ascending), up to `length` tokens
    // and the text's depth, each with its share among the occurrences agreeing so far.
    void continuation(std::vector<int32_t> after, size_t length, Chain& chain) const {
        chain.clear();
        if (after.empty()) return;
        const size_t from = static_cast<size_t>(after.back());
        const size_t to = std::min(tok_.size(), from + std::min(length, static_cast<size_t>(depth_)));
        for (size_t i = from; i < to; ++i) {
            const int32_t token = tok_[i];
            if (after.size() == 1) {  // one occurrence left: it is the copy, every share 1
                for (size_t j = i; j < to; ++j) chain.emplace_back(tok_[j], 1.0);
                return;
            }
            size_t kept = 0, agree = 0;
            for (int32_t a : after) {
                if (static_cast<size_t>(a) >= tok_.size()) continue;
                ++kept;
                if (tok_[static_cast<size_t>(a)] == token) after[agree++] = a + 1;
            }
            chain.emplace_back(token, static_cast<double>(agree) / static_cast<double>(kept));
            after.resize(agree);
        }
    }

    // About what it holds in memory: the tokens, and per distinct token its positions and a map entry.
    size_t bytes() const {
        size_t n = tok_.capacity() * sizeof(int32_t);
        for (const auto& item : at_) n += item.second.capacity() * sizeof(int32_t) + 64;
        return n;
    }

private:
    // How many tokens, back from position p, agree with key[0, n) back from its end (at most `limit`).
    size_t agrees(int32_t p, const int32_t* key, size_t n, size_t limit) const {
        size_t k = 0;
        while (k < limit && static_cast<size_t>(p) >= k && tok_[static_cast<size_t>(p) - k] == key[n - 1 - k]) ++k;
        return k;
    }

    int depth_;  // the longest path (find) and continuation drafted from this text
    std::vector<int32_t> tok_;
    std::unordered_map<int32_t, std::vector<int32_t>> at_;  // token -> positions, ascending
};

}  // namespace bsd
