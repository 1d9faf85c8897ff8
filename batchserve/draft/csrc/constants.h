// The drafter's constants, each defined here once. The module exports every one (module.cpp);
// batchserve/draft/native.py checks at load time the ones Python also names (MATCH_CAP in
// batchserve/trees/tree.py, DRAFT_LAYOUTS in batchserve/draft_config.py), and the tests read the
// rest from the module instead of restating them. Settings (drafter.h) carry what is configurable.
#pragma once

#include <cstddef>
#include <cstdint>

namespace bsd {

// How a proposal spends its budget, in the order of DRAFT_LAYOUTS: best first over the merged
// matches, disjoint chains under the root, or one chain.
enum Layout : int { kHierarchical = 0, kParallel = 1, kSingle = 2 };
constexpr int kNumLayouts = 3;
constexpr const char* kLayoutNames[kNumLayouts] = {"hierarchical", "parallel", "single"};

constexpr int kMatchCap = 32;             // the longest match a tree reports (DraftTree.match)
constexpr int32_t kSeparator = -1;        // between two outputs in a scope's recent text: no token equals it
constexpr size_t kMaxOccurrences = 256;   // occurrences of a key drafting looks at, the most recent
constexpr size_t kCopyPerMatch = 2;       // a copy chain drafts this many tokens per token of match
constexpr size_t kCopyMinMatch = 3;       // below this a match is a guess the counts make better

}  // namespace bsd
