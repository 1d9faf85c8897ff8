// Text: a token array with an inverted index (the positions each token occurs at, ascending),
// extended per token. It answers the drafter's questions about a request's own prompt and
// output, and about a scope's recent outputs, in time proportional to the occurrences of the
// key's last token, not to the text's length:
// - find: the most recent occurrences of a key (a node of the trie of all its n-grams);
// - copy_source: the longest suffix of a key that occurred before with a token after it, and
//   where each of its occurrences (at that length) ends;
// - continuation: what followed the most recent of those, with each token's share among the
//   occurrences that still agree (what a trie's counts would give it).
// The bodies are in text.cpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <unordered_map>
#include <utility>
#include <vector>

#include "constants.h"

namespace bsd {

using Chain = std::vector<std::pair<int32_t, double>>;  // (token, share among agreeing occurrences)

class Text {
public:
    explicit Text(int depth) : depth_(depth) {}

    int depth() const { return depth_; }
    size_t size() const { return tok_.size(); }
    const int32_t* data() const { return tok_.data(); }
    int32_t at(size_t i) const { return tok_[i]; }

    void extend(const int32_t* t, size_t n);
    // The text from `first` on, renumbered from 0 (a scope dropping its oldest outputs).
    void drop_front(size_t first);

    // Where the most recent kMaxOccurrences occurrences of key[0, m) end (the position after
    // each), ascending; empty when none.
    void find(const int32_t* key, size_t m, std::vector<int32_t>& ends) const;

    // m: the longest suffix of key[0, n) (at most `limit` tokens) that occurs with a token
    // after it; `after`: the position after each occurrence of that suffix, ascending (the most
    // recent kMaxOccurrences). m is 0 when nothing matches.
    size_t copy_source(const int32_t* key, size_t n, size_t limit, std::vector<int32_t>& after) const;

    // What followed the most recent occurrence in `after` (ascending), up to `length` tokens
    // and the text's depth, each with its share among the occurrences agreeing so far.
    void continuation(std::vector<int32_t> after, size_t length, Chain& chain) const;

    // About what it holds in memory: the tokens, and per distinct token its positions and a map entry.
    size_t bytes() const;

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
