"""Which of a request's KV blocks come from, and go to, the allocator's prefix cache."""

from __future__ import annotations

from batchserve.request import Request
from batchserve.scheduler.block_allocator import BlockAllocator, block_key


class PrefixCache:
    """The scheduler's side of prefix caching: keys per request, reuse at admission,
    registration after each commit, and counts of what was looked up and found (tokens)."""

    def __init__(self, allocator: BlockAllocator, trie_scope: str, enabled: bool = True) -> None:
        self.allocator = allocator
        self.trie_scope = trie_scope
        self.enabled = enabled
        self.queried_tokens = 0  # since start: tokens of the requests that looked up their prefix
        self.hit_tokens = 0  # of those, tokens whose K/V was reused

    def scope(self, req: Request) -> str:
        """Whose cached blocks `req` may reuse: the same isolation as its drafts. `request`
        scope uses the arrival number, never the client-chosen request id. Siblings of one call
        (`req.group`) share theirs where the scope, or prefix caching being off, would not."""
        if req.group and (not self.enabled or self.trie_scope == "request"):
            return f"n:{req.tenant}:{req.group}"
        return {"global": "g", "tenant": f"t:{req.tenant}"}.get(self.trie_scope, f"r:{req.arrival_seq}")

    def active(self, req: Request) -> bool:
        """Whether `req`'s blocks are looked up and registered: with prefix caching on, and for
        siblings of one call whatever the setting (they compute their prompt once between them)."""
        return self.enabled or bool(req.group)

    def keys(self, req: Request, num_blocks: int) -> list[bytes]:
        """`req.block_keys`, extended to cover at least its first `num_blocks` full blocks (each
        key is computed once per request; callers index, no copy on the per-step path)."""
        keys = req.block_keys
        if len(keys) < num_blocks:
            bs, scope = self.allocator.block_size, self.scope(req)
            for i in range(len(keys), num_blocks):
                keys.append(block_key(keys[-1] if keys else b"", req.all_token_ids[i * bs : (i + 1) * bs], scope))
        return keys

    def reuse(self, req: Request) -> int:
        """Start a block-less request on the longest cached run of its full blocks; returns the
        tokens reused. At least one token is left to compute, so the step has its logits. A
        request scoring its prompt (prompt logprobs) computes it all: it needs every row's logits."""
        if not self.active(req) or req.block_ids or req.scoring:
            return 0
        n = (req.num_tokens - 1) // self.allocator.block_size
        hits = self.allocator.lookup(self.keys(req, n)[:n])
        req.block_ids = hits
        req.num_cached_blocks = len(hits)
        req.num_computed_tokens = len(hits) * self.allocator.block_size
        return req.num_computed_tokens

    def uncached_keys(self, req: Request) -> list[bytes]:
        """Keys of `req`'s full blocks that are not cached yet: a running request is computing
        them (its prompt chunks) or will be, so they are cached within a step or a few."""
        if not self.active(req):
            return []
        full = req.num_tokens // self.allocator.block_size
        return self.keys(req, full)[req.num_cached_blocks : full]

    def should_wait(self, req: Request, in_flight: set[bytes]) -> bool:
        """After `reuse`: True if the next block `req` would compute is one that a running
        request is computing now (same tokens, same scope). Admitted later, `req` finds it
        cached instead of computing it a second time (cache-aware admission, as SGLang orders
        its queue by cached prefix)."""
        if not in_flight or req.scoring:
            return False
        nxt = req.num_computed_tokens // self.allocator.block_size
        if nxt >= (req.num_tokens - 1) // self.allocator.block_size:
            return False  # nothing full is left to share: the rest is its own tail
        return self.keys(req, nxt + 1)[nxt] in in_flight

    def count(self, req: Request, cached: int) -> None:
        """Record an admission's lookup (`cached` tokens found); a first admission's are its prompt's."""
        if not self.active(req):
            return
        self.queried_tokens += req.num_tokens
        self.hit_tokens += cached
        if req.stats.queue_seconds is None and not req.stats.num_preemptions:  # not a recompute
            req.stats.cached_prompt_tokens = min(cached, req.num_prompt_tokens)

    def register(self, req: Request) -> None:
        """Cache `req`'s blocks whose every slot now holds committed K/V of its own tokens."""
        if not self.active(req):
            return
        full = min(req.num_computed_tokens, req.num_tokens) // self.allocator.block_size
        keys = self.keys(req, full)
        for i in range(req.num_cached_blocks, full):
            self.allocator.cache(req.block_ids[i], keys[i])
        req.num_cached_blocks = max(req.num_cached_blocks, full)
