"""Plausible wrong answers to notebook 10's exercises, each failing for a reason the checker names."""


def no_wrap(points, key):
    """Forgets that the ring closes: past the last point it keeps the last point's replica."""
    ordered = sorted(points)
    return next((r for p, r in ordered if p >= key), ordered[-1][1])


def strictly_after(points, key):
    """Takes the first point strictly after the key."""
    ordered = sorted(points)
    return next((r for p, r in ordered if p > key), ordered[0][1])


def counts_every_held_block(prompt_hashes, streams):
    """Counts every block a replica holds, as if a hit need not be a prefix (and ignores removals)."""
    counts = []
    for stream in streams:
        held = set()
        for kind, *hashes in stream:
            if kind == "stored":
                held.update(hashes[0])
        counts.append(sum(h in held for h in prompt_hashes))
    return max(range(len(streams)), key=lambda r: (counts[r], -r))


def ignores_removals(prompt_hashes, streams):
    """Applies stored events only: a replica never loses a block."""
    best, best_n = 0, -1
    for r, stream in enumerate(streams):
        held = set()
        for kind, *hashes in stream:
            if kind == "stored":
                held.update(hashes[0])
        n = 0
        for h in prompt_hashes:
            if h not in held:
                break
            n += 1
        if n > best_n:
            best, best_n = r, n
    return best


def divided_by_replicas(single_replica_hit_rate, queries_per_customer, num_replicas):
    """Divides the rate by N, as if each replica saw only its share of the hits."""
    return single_replica_hit_rate / num_replicas


def one_miss_per_replica(single_replica_hit_rate, queries_per_customer, num_replicas):
    """Charges a first miss on every replica, visited or not."""
    q, n = queries_per_customer, num_replicas
    return max(0.0, single_replica_hit_rate * (q - min(n, q)) / (q - 1)) if q > 1 else 0.0


WRONG = {
    "10.ring_pick": [
        (no_wrap, "the ring wraps around"),
        (strictly_after, "at or after, not strictly after"),
    ],
    "10.precise_choice": [
        (counts_every_held_block, "a"),
        (ignores_removals, "BlockRemoved"),
    ],
    "10.random_hit_rate": [
        (divided_by_replicas, ""),
        (one_miss_per_replica, ""),
    ],
}
